// Inner loops of the CPU backend, kept apart from the op plumbing so each has a scalar twin that
// tests compare against.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace mb::cpu {

float dot_f32(const float* a, const float* b, int64_t n);
// Converts n weights of `dtype` to f32.
void to_f32(DType dtype, const void* src, float* dst, int64_t n);
// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);
float gelu_tanh(float x);
// Sum of n floats, streaming: used to measure read bandwidth.
float sum_f32(const float* x, int64_t n);

// Scalar references.
float dot_f32_ref(const float* a, const float* b, int64_t n);

}  // namespace mb::cpu
