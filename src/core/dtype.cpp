#include "core/dtype.h"

#include <utility>

#include "core/error.h"

namespace mb {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
    case DType::Q8_0: return "Q8_0";
    case DType::Q4_0: return "Q4_0";
    case DType::Q4_1: return "Q4_1";
    case DType::Q5_0: return "Q5_0";
    case DType::Q5_1: return "Q5_1";
    case DType::Q4_K: return "Q4_K";
    case DType::Q5_K: return "Q5_K";
    case DType::Q6_K: return "Q6_K";
  }
  return "?";
}

namespace {
constexpr std::pair<std::string_view, DType> kWeightDtypes[] = {
    {"f32", DType::F32}, {"bf16", DType::BF16}, {"f16", DType::F16},
    {"q8_0", DType::Q8_0}, {"q4_0", DType::Q4_0}, {"q4_k", DType::Q4_K}};
}  // namespace

std::optional<DType> weight_dtype_from_name(std::string_view name) {
  for (const auto& [n, t] : kWeightDtypes)
    if (n == name) return t;
  return std::nullopt;
}

std::vector<std::string> weight_dtype_names() {
  std::vector<std::string> names;
  for (const auto& [n, t] : kWeightDtypes) names.emplace_back(n);
  return names;
}

bool dtype_is_quantized(DType t) { return dtype_block_size(t) > 1; }

int64_t dtype_block_size(DType t) {
  switch (t) {
    case DType::Q8_0: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
      return 32;
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      return 256;
    default:
      return 1;
  }
}

size_t dtype_block_bytes(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::I64: return 8;
    case DType::U8: case DType::BOOL: return 1;
    case DType::Q8_0: return 2 + 32;
    case DType::Q4_0: return 2 + 16;
    case DType::Q4_1: return 2 + 2 + 16;
    case DType::Q5_0: return 2 + 4 + 16;
    case DType::Q5_1: return 2 + 2 + 4 + 16;
    case DType::Q4_K: return 2 + 2 + 12 + 128;
    case DType::Q5_K: return 2 + 2 + 12 + 32 + 128;
    case DType::Q6_K: return 128 + 64 + 16 + 2;
  }
  return 0;
}

size_t dtype_size(DType t) {
  MB_CHECK(!dtype_is_quantized(t), "{} is a block type: its elements have no byte size", dtype_name(t));
  return dtype_block_bytes(t);
}

size_t dtype_row_bytes(DType t, int64_t n) {
  const int64_t bs = dtype_block_size(t);
  MB_CHECK(n >= 0 && n % bs == 0, "a {} row of {} elements is not a whole number of {}-element blocks",
           dtype_name(t), n, bs);
  return size_t(n / bs) * dtype_block_bytes(t);
}

// Portable conversions, bit-identical to the F16C instructions (vcvtph2ps / vcvtps2ph with round to
// nearest even), so this file needs no ISA flags: NaNs keep their payload and become quiet.
float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0);
  } else if (exp == 0) {
    const float f = float(mant) * 0x1p-24f;  // zero or subnormal: exact
    return sign ? -f : f;
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  u &= 0x7fffffffu;
  if (u >= 0x47800000u)  // >= 65536 (or inf, NaN): nothing left to round
    return sign | (u > 0x7f800000u ? uint16_t(0x7e00 | ((u >> 13) & 0x3ff)) : uint16_t(0x7c00));
  if (u < 0x38800000u) {  // below 2^-14: f16 subnormal or zero; the float add rounds to nearest even
    float a;
    std::memcpy(&a, &u, 4);
    a += 0.5f;  // aligns units of 2^-24 with the bottom of the mantissa
    uint32_t b;
    std::memcpy(&b, &a, 4);
    return sign | uint16_t(b - 0x3f000000u);
  }
  // Rebias the exponent and round to nearest even on the 13 dropped bits; a carry out of the
  // mantissa bumps the exponent, up to inf for [65520, 65536).
  u += (uint32_t(15 - 127) << 23) + 0xfff + ((u >> 13) & 1);
  return sign | uint16_t(u >> 13);
}

}  // namespace mb
