// The CUDA backend (H100/H200 class GPUs): the ops of backend.h as CUDA kernels plus cuBLAS for
// large matrix products. Only backend_factory.cpp and the CUDA tests include this.
#pragma once
#include <memory>

#include "backends/backend.h"

namespace mb::cuda {

// GPUs the CUDA runtime sees (0 when there is no driver or no GPU).
int device_count();
// The first GPU's compute capability as major * 10 + minor (90: Hopper), 0 without one.
int compute_capability();
// A backend on GPU `device`; a clear error when there is none or it cannot be used.
std::unique_ptr<Backend> make_backend(int device);

}  // namespace mb::cuda
