#include "models/model.h"

#include "models/architecture.h"

namespace mb {

std::unique_ptr<Model> load_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                  const ModelLoadOptions& opts) {
  const Architecture& arch = ck->architecture();
  return arch.make_model(std::move(ck), backend, opts);
}

}  // namespace mb
