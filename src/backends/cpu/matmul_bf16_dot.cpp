// AVX512-BF16 kernels for rounded products (bf16_gemm.h), for CPUs with VDPBF16PS and without AMX
// (AMD Zen 4 and 5, Intel Cooper Lake). This file alone is built with the AVX512-BF16 flags;
// cpu::matmul calls it only after checking the CPU. Only intrinsics and plain loops, as in
// matmul_amx.cpp.
//
// Roles: weight rows in lanes, tokens broadcast. A vector holds one k pair of 16 weight rows (each
// lane a row's bf16 at k = 2p and 2p + 1, as they lie in the row) and a token's pair is one 32-bit
// broadcast, so VDPBF16PS adds both products of the pair into each row's f32 lane. The register
// tile is 32 rows (two vectors) by kTokens tokens: per pair, 2 vector loads and kTokens broadcasts
// feed 2 kTokens products, and each accumulator is 16 outputs of one token, stored straight into
// its row of y. The weights go into a per-task panel (pairs of 32 rows, in L2) once per k slice;
// every token tile runs against it, the slice's partial sums waiting in y.
#include "backends/cpu/bf16_gemm.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "backends/cpu/bf16_bits_avx512.h"

namespace mb::cpu {
namespace {

constexpr int kTokens = 12;           // tokens a tile: 24 accumulators, 2 weight vectors, a broadcast
constexpr int64_t kRows = 32;         // weight rows of the register tile
constexpr int64_t kSlicePairs = 128;  // k pairs of a panel slice
constexpr int64_t kPanelRows = 256;   // rows of a panel: 256 rows x 256 k of bf16 = 128 KB

inline int64_t pairs(int64_t k) { return (k + 1) / 2; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline __mmask16 low_bits16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}
inline __mmask32 low_bits32(int64_t n) {
  return n >= 32 ? __mmask32(0xffffffffu) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1u);
}
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Packed activations: per tile of kTokens tokens, [pair][kTokens] 32-bit words, a word holding the
// token's bf16 of k = 2p (low half) and 2p + 1 (high half). Tokens past n and k past the end are 0.
size_t k_xp_bytes(int64_t n, int64_t k) {
  return size_t((n + kTokens - 1) / kTokens) * size_t(pairs(k)) * kTokens * 4;
}

// Per token, 32 k at a time: rounded (split_bf16<1>, the AMX kernels' rounding), the high halves
// gathered into 16 pair words, and those scattered kTokens words apart into the tile.
void k_pack_x(const MatArgs& a, uint16_t* xp16, int64_t tile0, int64_t tile1) {
  int32_t* xp = reinterpret_cast<int32_t*>(xp16);
  const int64_t np = pairs(a.k);
  alignas(64) int16_t odd[32];
  for (int i = 0; i < 32; ++i) odd[i] = int16_t(2 * i + 1);
  const __m512i high_halves = _mm512_load_si512(odd);
  alignas(64) int32_t stride[16];
  for (int i = 0; i < 16; ++i) stride[i] = i * kTokens;
  const __m512i index = _mm512_load_si512(stride);
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    int32_t* dst = xp + tile * np * kTokens;
    for (int t = 0; t < kTokens; ++t) {
      const int64_t token = tile * kTokens + t;
      for (int64_t k0 = 0; k0 < a.k; k0 += 32) {
        __m512i words = _mm512_setzero_si512();
        if (token < a.n) {
          const float* src = a.x + token * a.ldx + k0;
          __m512i lo[1], hi[1];
          split_bf16(_mm512_maskz_loadu_ps(low_bits16(a.k - k0), src), lo);
          split_bf16(_mm512_maskz_loadu_ps(low_bits16(a.k - k0 - 16), src + 16), hi);
          words = _mm512_permutex2var_epi16(lo[0], high_halves, hi[0]);
        }
        _mm512_mask_i32scatter_epi32(dst + (k0 / 2) * kTokens + t, low_bits16(np - k0 / 2), index, words, 4);
      }
    }
  }
}

// Rows [r, r + rows) and pairs [p0, p0 + np) of the weights into the panel: per group of 32 rows,
// [pair][32] words (row 32g + l in lane l), rows past `rows` (to the group's end) and k past the
// end zero. 16 rows of 16 pairs are one 16 x 16 transpose of 32-bit lanes.
void pack_panel(const MatArgs& a, int64_t r, int64_t rows, int64_t p0, int64_t np, int32_t* panel) {
  const uint8_t* wb = static_cast<const uint8_t*>(a.w);
  for (int64_t g16 = 0; g16 < (rows + kRows - 1) / kRows * 2; ++g16) {
    int32_t* group = panel + (g16 / 2) * kSlicePairs * kRows + (g16 % 2) * 16;
    for (int64_t pp = 0; pp < np; pp += 16) {
      const int64_t k0 = 2 * (p0 + pp);
      const __mmask32 mask = low_bits32(min64(a.k - k0, 2 * (np - pp)));
      __m512i v[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = g16 * 16 + i;
        v[i] = row < rows ? _mm512_maskz_loadu_epi16(mask, wb + size_t(r + row) * a.w_stride + size_t(k0) * 2)
                          : _mm512_setzero_si512();
      }
      transpose16(v);
      for (int j = 0; j < 16 && pp + j < np; ++j) _mm512_store_si512(group + (pp + j) * kRows, v[j]);
    }
  }
}

// y[t][0, rows) of the register tile's tokens, from zero (first slice) or the partial sums in y.
void tile_products(const int32_t* pan, const int32_t* xt, int64_t np, float* y, int64_t ldy, int64_t rows,
                   int64_t tokens, bool first) {
  const __mmask16 m0 = low_bits16(rows), m1 = low_bits16(rows - 16);
  __m512 acc[2][kTokens];
  for (int t = 0; t < kTokens; ++t) {
    const bool load = !first && t < tokens;
    acc[0][t] = load ? _mm512_maskz_loadu_ps(m0, y + t * ldy) : _mm512_setzero_ps();
    acc[1][t] = load ? _mm512_maskz_loadu_ps(m1, y + t * ldy + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < np; ++p) {
    const __m512bh w0 = as_bh(_mm512_load_si512(pan + p * kRows));
    const __m512bh w1 = as_bh(_mm512_load_si512(pan + p * kRows + 16));
#pragma GCC unroll 12
    for (int t = 0; t < kTokens; ++t) {
      const __m512bh x = as_bh(_mm512_set1_epi32(xt[p * kTokens + t]));
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w0, x);
      acc[1][t] = _mm512_dpbf16_ps(acc[1][t], w1, x);
    }
  }
  for (int t = 0; t < tokens; ++t) {
    _mm512_mask_storeu_ps(y + t * ldy, m0, acc[0][t]);
    if (m1) _mm512_mask_storeu_ps(y + t * ldy + 16, m1, acc[1][t]);
  }
}

size_t k_scratch_bytes(int64_t, int64_t) { return size_t(kPanelRows) * kSlicePairs * 4; }

void k_gemm(const MatArgs& a, const uint16_t* xp16, int64_t r0, int64_t r1, void* scratch) {
  const int32_t* xp = reinterpret_cast<const int32_t*>(xp16);
  int32_t* panel = static_cast<int32_t*>(scratch);
  const int64_t np_all = pairs(a.k), tiles = (a.n + kTokens - 1) / kTokens;
  for (int64_t rb = r0; rb < r1; rb += kPanelRows) {
    const int64_t rows = min64(kPanelRows, r1 - rb);
    for (int64_t p0 = 0; p0 < np_all; p0 += kSlicePairs) {
      const int64_t np = min64(kSlicePairs, np_all - p0);
      pack_panel(a, rb, rows, p0, np, panel);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int32_t* xt = xp + (tile * np_all + p0) * kTokens;
        const int64_t t0 = tile * kTokens, tokens = min64(kTokens, a.n - t0);
        for (int64_t g = 0; g * kRows < rows; ++g)
          tile_products(panel + g * kSlicePairs * kRows, xt, np, a.y + t0 * a.ldy + rb + g * kRows, a.ldy,
                        min64(kRows, rows - g * kRows), tokens, p0 == 0);
      }
    }
  }
}

int64_t k_task_rows(int64_t) { return kPanelRows; }

const Bf16GemmKernels kRounded = {kTokens, kRows, k_task_rows, k_xp_bytes, k_scratch_bytes, k_pack_x, k_gemm, false};

}  // namespace

const Bf16GemmKernels* avx512_bf16_rounded_kernels() { return &kRounded; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
const Bf16GemmKernels* avx512_bf16_rounded_kernels() { return nullptr; }
}  // namespace mb::cpu

#endif
