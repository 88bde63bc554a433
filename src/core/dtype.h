// Element types of weights and activations. Quantized types are ggml's block formats: a run of
// `dtype_block_size` elements stored as `dtype_block_bytes` bytes (scales + packed integers), so a
// row of n elements takes dtype_row_bytes(t, n) bytes. Enumerator values are not file codes; GGUF
// maps its own type ids (formats/gguf.cpp).
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mb {

enum class DType : uint8_t {
  F32, F16, BF16, I32, I64, U8, BOOL,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
};

std::string_view dtype_name(DType t);
// The weight types a `--dtype` flag names (lower case, as llama.cpp spells them); "auto", which
// keeps the checkpoint's types, is the caller's to handle. nullopt for any other name.
std::optional<DType> weight_dtype_from_name(std::string_view name);
// Those names in order ("f32", "bf16", ...), for flag checks and error messages.
std::vector<std::string> weight_dtype_names();
// Bytes per element of a plain type; throws for block types, whose elements have no byte size.
size_t dtype_size(DType t);
bool dtype_is_quantized(DType t);
int64_t dtype_block_size(DType t);  // elements per block; 1 for plain types
size_t dtype_block_bytes(DType t);  // bytes per block; dtype_size for plain types
// Bytes of a row of n elements; throws when n is not a whole number of blocks.
size_t dtype_row_bytes(DType t, int64_t n);

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
