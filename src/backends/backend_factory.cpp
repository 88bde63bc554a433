#include "backends/backend.h"
#include "core/error.h"
#ifdef MARKBASE_HAVE_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

namespace mb {

bool cuda_device_available() {
#ifdef MARKBASE_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

int cuda_compute_capability() {
#ifdef MARKBASE_HAVE_CUDA
  return cuda::compute_capability();
#else
  return 0;
#endif
}

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") {
#ifdef MARKBASE_HAVE_CUDA
    return cuda::make_backend(0);
#else
    fail("device 'cuda': this markbase was built without CUDA (no nvcc when it was configured); rebuild with the "
         "CUDA toolkit installed, or use --device cpu");
#endif
  }
  fail("unknown device '{}' (expected cpu or cuda)", device);
}

}  // namespace mb
