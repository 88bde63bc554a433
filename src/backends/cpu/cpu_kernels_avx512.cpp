// AVX-512 (F, BW, VL, DQ) build of the SIMD kernels; this file alone is compiled with those flags
// and only runs after cpu_kernels.cpp has checked the CPU and the OS (ZMM state enabled).
#include "backends/cpu/cpu_isa.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>

namespace mb::cpu {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int L = 16;
  static constexpr int kGemmRows = 12;  // 2 x 12 accumulators + 2 x loads + 1 broadcast of 32 zmm
  static constexpr int kAttnRows = 8;
  static constexpr int kPvVecs = 4;
  static constexpr Isa kIsa = Isa::Avx512;
  static constexpr const char* kName = "avx512";

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 mask(int n) { return __mmask16((1u << n) - 1u); }
  static V load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static void store_n(float* p, V v, int n) { _mm512_mask_storeu_ps(p, mask(n), v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V abs(V a) { return _mm512_abs_ps(a); }
  // Lanes where x < lim take a, the others b.
  static V select_lt(V x, V lim, V a, V b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lim, _CMP_LT_OQ), b, a); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

  static V widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  template <WType W> static V wload(const void* p) {
    if constexpr (W == WType::F32) return _mm512_loadu_ps(p);
    else if constexpr (W == WType::BF16) return widen_bf16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    else return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  template <WType W> static V wload_n(const void* p, int n) {
    if constexpr (W == WType::F32) return _mm512_maskz_loadu_ps(mask(n), p);
    else if constexpr (W == WType::BF16) return widen_bf16(_mm256_maskz_loadu_epi16(mask(n), p));
    else return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p));
  }

  static __m128 half4(V v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  }
  static float reduce_add(V v) {
    __m128 b = half4(v);
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  static float reduce_max(V v) {
    __m256 a = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  // Lanes lo..hi (clamped to the vector) keep s; the others become fill.
  static V keep_lanes(V s, int lo, int hi, float fill) {
    lo = lo < 0 ? 0 : lo;
    hi = hi > L - 1 ? L - 1 : hi;
    if (lo > hi) return set1(fill);
    const __mmask16 m = __mmask16(((1u << (hi + 1)) - 1u) & ~((1u << lo) - 1u));
    return _mm512_mask_blend_ps(m, set1(fill), s);
  }
  // Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r, scaled by 2^n.
  static V exp(V x0) {
    const V x = _mm512_min_ps(_mm512_max_ps(x0, set1(-87.3f)), set1(88.f));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.9875691500e-4f);
    p = fma(p, r, set1(1.3981999507e-3f));
    p = fma(p, r, set1(8.3334519073e-3f));
    p = fma(p, r, set1(4.1665795894e-2f));
    p = fma(p, r, set1(1.6666665459e-1f));
    p = fma(p, r, set1(5.0000001201e-1f));
    p = fma(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, set1(1.f)));
    p = _mm512_scalef_ps(p, n);
    // Outside the clamp: underflow to 0, overflow to inf, NaN stays NaN (as expf).
    p = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, set1(-87.3f), _CMP_LT_OQ), p, zero());
    p = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, set1(88.f), _CMP_GT_OQ), p, set1(__builtin_inff()));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), p, x0);
  }
  // In-place 16 x 16 transpose: afterwards r[c][i] is the old r[i][c].
  static void transpose(V r[16]) {
    V t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 4; ++j) {
        t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
        t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
      }
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
      r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
  }
};

using T = Avx512;
#include "backends/cpu/cpu_kernels_simd.inc"

}  // namespace

const KernelTable* table_avx512() { return &kTable; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
const KernelTable* table_avx512() { return nullptr; }
}  // namespace mb::cpu

#endif
