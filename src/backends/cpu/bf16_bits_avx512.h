// AVX-512 pieces the bf16 GEMMs share (matmul_amx.cpp, matmul_bf16_dot.cpp): a 32-bit transpose
// and the rounding / splitting of f32 activations into bf16. Only files built with AVX-512 flags
// include it; its functions have internal linkage, so no copy of them is shared with (or picked
// for) code that runs on any CPU.
#pragma once
#include <immintrin.h>

namespace mb::cpu {
namespace {

// Rows r of a 16 x 16 matrix of 32-bit lanes become its columns.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // s[4g + j], 128-bit lane l: column 4l + j of rows 4g .. 4g + 3.
  __m512i s[16];
  for (int g = 0; g < 4; ++g) {
    s[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    s[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    s[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    s[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i u0 = _mm512_shuffle_i32x4(s[j], s[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i u1 = _mm512_shuffle_i32x4(s[j], s[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i v0 = _mm512_shuffle_i32x4(s[8 + j], s[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(s[8 + j], s[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
    r[j] = _mm512_shuffle_i32x4(u0, v0, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_i32x4(u1, v1, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + j] = _mm512_shuffle_i32x4(u0, v0, _MM_SHUFFLE(3, 1, 3, 1));
    r[12 + j] = _mm512_shuffle_i32x4(u1, v1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// f32 bits rounded to the nearest bf16, ties to even (core/dtype.h's f32_to_bf16), in the high
// half of each lane.
inline __m512i round_bf16(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_and_si512(r, _mm512_set1_epi32(int32_t(0xffff0000u)));
}

// x = Σ part[p] for p < P, each part bf16: part[0] = bf16(x) (nearest even), each next part
// bf16 of what is left (the remainders are exact in f32). Three parts hold all 24 bits of x's
// significand, so the split is exact except that tile products read bf16 denormals as zero (parts
// below 2^-126, from |x| < ~2^-110). Where rounding would carry x past the largest bf16, part[0] is
// x truncated instead, so it stays finite; inf and NaN keep part[0] = x (truncated, NaNs kept
// quiet) and zero parts after it. The parts come out as f32 bits whose low halves are zero.
template <int P> inline void split_bf16(__m512 x, __m512i (&part)[P]) {
  const __m512i u = _mm512_castps_si512(x), abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000), high_half = _mm512_set1_epi32(int32_t(0xffff0000u));
  const __mmask16 nonfinite = _mm512_cmpge_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
  __m512i h = round_bf16(u);
  const __mmask16 carried = _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, abs_mask), inf);
  h = _mm512_mask_and_epi32(h, carried | nonfinite, u, high_half);
  part[0] = _mm512_mask_or_epi32(h, nan, h, _mm512_set1_epi32(0x00400000));
  __m512 rest = _mm512_maskz_sub_ps(__mmask16(~nonfinite), x, _mm512_castsi512_ps(part[0]));
  for (int p = 1; p < P; ++p) {
    part[p] = round_bf16(_mm512_castps_si512(rest));
    rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(part[p]));
  }
}

}  // namespace
}  // namespace mb::cpu
