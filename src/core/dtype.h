// Element types of weights and activations. Quantized types (later) are block formats: a dtype
// with a block size and bytes per block, not a separate class hierarchy.
#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

namespace mb {

enum class DType : uint8_t { F32, F16, BF16, I32, I64, U8, BOOL };

std::string_view dtype_name(DType t);
size_t dtype_size(DType t);  // bytes per element

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch does when casting to bfloat16; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace mb
