// AVX-512 VNNI kernel of the integer matmul (qmatmul.h). This file alone is built with those flags;
// qmatmul_kernel() calls it only after checking the CPU. Hand-written because no library has
// kernels for GGUF's block formats.
#include "backends/cpu/qmatmul.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace mb::cpu {
namespace {

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __mmask64 load_mask(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return _cvtu64_mask64(v);
}

// The 8 vectors of codes of one 32-k block (vector q: k = 4q..4q+3 of the 16 rows).
template <DType T> inline void unpack(const uint8_t* cb, __m512i (&c)[8]) {
  if constexpr (T == DType::Q8_0) {
    for (int q = 0; q < 8; ++q) c[q] = _mm512_loadu_si512(cb + 64 * q);
  } else {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(cb + 64 * p);
      c[2 * p] = _mm512_and_si512(v, lo);
      c[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
    }
    if constexpr (T == DType::Q5_0 || T == DType::Q6_K) {
      const __m512i b4 = _mm512_set1_epi8(16);
      for (int q = 0; q < 8; ++q) c[q] = _mm512_mask_add_epi8(c[q], load_mask(cb + 256 + 8 * q), c[q], b4);
    }
    if constexpr (T == DType::Q6_K) {
      const __m512i b5 = _mm512_set1_epi8(32);
      for (int q = 0; q < 8; ++q) c[q] = _mm512_mask_add_epi8(c[q], load_mask(cb + 320 + 8 * q), c[q], b5);
    }
  }
}

// Σ c·q over quads [q0, q1) as two independent VPDPBUSD chains.
template <int Q0, int Q1> inline __m512i dot(const __m512i (&c)[8], const int8_t* xq) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int q = Q0; q < Q1; q += 2) {
    s0 = _mm512_dpbusd_epi32(s0, c[q], bcast4(xq + 4 * q));
    s1 = _mm512_dpbusd_epi32(s1, c[q + 1], bcast4(xq + 4 * q + 4));
  }
  return _mm512_add_epi32(s0, s1);
}

inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// acc = fma(float(dot), a·dx, acc); acc = fma(b, dsum, acc): the scalar twin's order.
inline __m512 accumulate(__m512 acc, __m512i dot, __m512 a, __m512 b, float dx, float dsum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(b, _mm512_set1_ps(dsum), acc);
}

// Bytes ahead of the codes being read that each block prefetches.
constexpr size_t kPrefetch = 2048;

template <DType T, int NT>
void group_tokens(const QPacked& w, const QActs& x, int64_t g, int64_t tb, float* y, int64_t ldy, __mmask16 rows) {
  constexpr QLayout Lay = qlayout(T);
  const int64_t nb = w.k / 32;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int8_t* xr[NT];
  const float *dx[NT], *ds[NT];
  for (int t = 0; t < NT; ++t) {
    xr[t] = x.qrow(tb + t);
    dx[t] = x.dx.data() + (tb + t) * nb;
    ds[t] = (T == DType::Q6_K ? x.dsum16.data() + 2 * (tb + t) * nb : x.dsum32.data() + (tb + t) * nb);
  }
  const uint8_t* cb = w.codes(g, 0);
  const uint8_t* su = w.scales(g, 0);
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  for (int64_t bi = 0; bi < nb; ++bi, cb += Lay.block_codes) {
    const int blk = int(bi % Lay.blocks_per_unit);
    if (blk == 0 && bi > 0) su += Lay.unit_scales;
    if constexpr (T == DType::Q4_K) {
      if (blk == 0) {
        d = f16x16(su);
        dmin = f16x16(su + 32);
      }
    } else if constexpr (T == DType::Q6_K) {
      if (blk == 0) d = f16x16(su);
    }
    for (size_t off = 0; off < Lay.block_codes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(cb + kPrefetch + off), _MM_HINT_T0);
    __m512i c[8];
    unpack<T>(cb, c);
    const int64_t kb = 32 * bi;
    if constexpr (T == DType::Q6_K) {
      for (int h = 0; h < 2; ++h) {
        const __m512 a = _mm512_mul_ps(d, i8x16(su + 32 + 16 * (2 * blk + h)));
        const __m512 b = _mm512_mul_ps(a, _mm512_set1_ps(-32.f));
        for (int t = 0; t < NT; ++t) {
          const __m512i s = h == 0 ? dot<0, 4>(c, xr[t] + kb) : dot<4, 8>(c, xr[t] + kb);
          acc[t] = accumulate(acc[t], s, a, b, dx[t][bi], ds[t][2 * bi + h]);
        }
      }
    } else {
      __m512 a, b;
      if constexpr (T == DType::Q4_K) {
        a = _mm512_mul_ps(d, u8x16(su + 64 + 16 * blk));
        b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, u8x16(su + 192 + 16 * blk))),
                                                 _mm512_set1_epi32(int32_t(0x80000000u))));
      } else {
        a = f16x16(su);
        constexpr float off = T == DType::Q8_0 ? -128.f : T == DType::Q5_0 ? -16.f : -8.f;
        b = _mm512_mul_ps(a, _mm512_set1_ps(off));
      }
      for (int t = 0; t < NT; ++t) acc[t] = accumulate(acc[t], dot<0, 8>(c, xr[t] + kb), a, b, dx[t][bi], ds[t][bi]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (tb + t) * ldy + g * kQRows, rows, acc[t]);
}

template <DType T>
void kernel_t(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t valid = std::min<int64_t>(kQRows, w.m - g * kQRows);
    const __mmask16 rows = __mmask16((1u << valid) - 1u);
    int64_t t = t0;
    // Tiles of 8 tokens share each unpacked code vector (8 codes + 8 sums + scales fit in 32 zmm).
    for (; t + 8 <= t1; t += 8) group_tokens<T, 8>(w, x, g, t, y, ldy, rows);
    if (t + 4 <= t1) {
      group_tokens<T, 4>(w, x, g, t, y, ldy, rows);
      t += 4;
    }
    switch (t1 - t) {
      case 3: group_tokens<T, 3>(w, x, g, t, y, ldy, rows); break;
      case 2: group_tokens<T, 2>(w, x, g, t, y, ldy, rows); break;
      case 1: group_tokens<T, 1>(w, x, g, t, y, ldy, rows); break;
      default: break;
    }
  }
}

void kernel(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  switch (w.type) {
    case DType::Q8_0: return kernel_t<DType::Q8_0>(w, x, y, ldy, g0, g1, t0, t1);
    case DType::Q4_0: return kernel_t<DType::Q4_0>(w, x, y, ldy, g0, g1, t0, t1);
    case DType::Q5_0: return kernel_t<DType::Q5_0>(w, x, y, ldy, g0, g1, t0, t1);
    case DType::Q4_K: return kernel_t<DType::Q4_K>(w, x, y, ldy, g0, g1, t0, t1);
    case DType::Q6_K: return kernel_t<DType::Q6_K>(w, x, y, ldy, g0, g1, t0, t1);
    default: return qmatmul_ref(w, x, y, ldy, g0, g1, t0, t1);
  }
}

// quantize_acts_ref with 32 values per step: amax, d = amax / 127, q = round-to-even(x / d·...)
// in the same float operations, so the bytes and scales are identical.
void quantize_rows(const float* x, int64_t ldx, int64_t t0, int64_t t1, QActs& a) {
  const int64_t k = a.k, nb = k / 32;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * ldx + 32 * b;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, abs_mask), _mm512_and_ps(v1, abs_mask)));
      const float d = amax >= 1e-30f ? amax / 127.f : 0.f, id = d > 0.f ? 1.f / d : 0.f;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      int8_t* q = a.q.data() + t * k + 32 * b;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
      const int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      const size_t bi = size_t(t * nb + b);
      a.dx[bi] = d;
      a.dsum32[bi] = d * float(s0 + s1);
      a.dsum16[2 * bi] = d * float(s0);
      a.dsum16[2 * bi + 1] = d * float(s1);
    }
}

}  // namespace

QMatmulFn qmatmul_avx512() { return kernel; }
QuantizeActsFn quantize_acts_avx512() { return quantize_rows; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
QMatmulFn qmatmul_avx512() { return nullptr; }
QuantizeActsFn quantize_acts_avx512() { return nullptr; }
}  // namespace mb::cpu

#endif
