#include "models/model.h"

#include "core/error.h"

namespace mb {

std::unique_ptr<Model> load_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                  const ModelLoadOptions& opts) {
  const std::string family = ck->config.family;
  if (family == "gemma4" || family == "gemma3") return make_gemma_model(std::move(ck), backend, opts);
  fail("no model implementation for architecture family '{}'", family);
}

}  // namespace mb
