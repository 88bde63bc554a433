// ggml's block quantization formats, as GGUF files store them. Each block holds f16 scale(s) and
// packed small integers for 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 ("K" types) elements; the
// layouts below are ggml's, byte for byte, so mapped GGUF tensors are used in place.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace mb {

namespace blocks {

// x = d * q, q in [-128, 127]
struct Q8_0 { uint16_t d; int8_t qs[32]; };
// x = d * (q - 8); element j in the low nibble of qs[j], element j + 16 in the high nibble
struct Q4_0 { uint16_t d; uint8_t qs[16]; };
// x = d * q + m
struct Q4_1 { uint16_t d, m; uint8_t qs[16]; };
// x = d * (q - 16); bit 4 of element j is bit j of qh (little endian)
struct Q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct Q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
// 8 sub-blocks of 32 with 6-bit scale sc and min m packed in `scales`: x = d*sc*q - dmin*m.
// qs[32*g + l] holds element 64*g + l (low nibble) and 64*g + 32 + l (high nibble).
struct Q4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
// Q4_K plus a fifth bit: bit 2g of qh[l] for element 64*g + l, bit 2g+1 for 64*g + 32 + l.
struct Q5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
// 16 sub-blocks of 16 with int8 scales: x = d * scales[s] * (q - 32), q 6 bits (ql nibble + qh pair).
struct Q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };

static_assert(sizeof(Q8_0) == 34 && sizeof(Q4_0) == 18 && sizeof(Q4_1) == 20 && sizeof(Q5_0) == 22 &&
              sizeof(Q5_1) == 24 && sizeof(Q4_K) == 144 && sizeof(Q5_K) == 176 && sizeof(Q6_K) == 210);

// Sub-block j's 6-bit scale and min from a K block's 12 packed bytes.
inline void k_scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace blocks

// n floats (a whole number of blocks) -> dtype_row_bytes(t, n) bytes. Bit-identical to ggml's
// reference quantizers (quantize_row_*_ref), hence to the gguf Python package for the types it
// quantizes. Also accepts F32, F16 and BF16 (round to nearest even).
void quantize_row(DType t, const float* src, void* dst, int64_t n);
// The inverse, bit-identical to ggml's dequantize_row_* and gguf-py's dequantize.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);

// Σ w[i]·x[i] for a row w of dtype t (a block type, F32, F16 or BF16), the reference for the inner
// loop of a matmul with weights left in their file format: dequantizes block by block and sums in
// double. The CPU backend's kernels for it (cpu::vec_dot) are tested against it; they differ only
// by float summation order.
float vec_dot_ref(DType t, const void* row, const float* x, int64_t n);

}  // namespace mb
