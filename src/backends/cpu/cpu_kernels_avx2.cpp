// AVX2 + FMA + F16C build of the SIMD kernels; this file alone is compiled with those flags and
// only runs after cpu_kernels.cpp has checked the CPU and the OS (YMM state enabled).
#include "backends/cpu/cpu_isa.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace mb::cpu {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int L = 8;
  static constexpr int kGemmRows = 6;  // 2 x 6 accumulators + 2 x loads + 1 broadcast of 16 ymm
  static constexpr int kAttnRows = 6;
  static constexpr int kPvVecs = 2;
  static constexpr Isa kIsa = Isa::Avx2;
  static constexpr const char* kName = "avx2";

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256i mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_n(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static void store_n(float* p, V v, int n) { _mm256_maskstore_ps(p, mask(n), v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  // Lanes where x < lim take a, the others b.
  static V select_lt(V x, V lim, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, lim, _CMP_LT_OQ)); }
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

  static V widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  template <WType W> static V wload(const void* p) {
    if constexpr (W == WType::F32) return _mm256_loadu_ps(static_cast<const float*>(p));
    else if constexpr (W == WType::BF16) return widen_bf16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    else return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  template <WType W> static V wload_n(const void* p, int n) {
    if constexpr (W == WType::F32) {
      return load_n(static_cast<const float*>(p), n);
    } else {
      alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const uint16_t* s = static_cast<const uint16_t*>(p);
      for (int i = 0; i < n; ++i) tmp[i] = s[i];
      return wload<W>(tmp);
    }
  }

  static float reduce_add(V v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  static float reduce_max(V v) {
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  static V keep_lanes(V s, int lo, int hi, float fill) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(lo - 1));
    const __m256i le = _mm256_cmpgt_epi32(_mm256_set1_epi32(hi + 1), idx);
    return _mm256_blendv_ps(set1(fill), s, _mm256_castsi256_ps(_mm256_and_si256(ge, le)));
  }
  // Cephes expf; 2^n built in the exponent field, n in [-126, 127] after the clamp.
  static V exp(V x0) {
    const V x = _mm256_min_ps(_mm256_max_ps(x0, set1(-87.3f)), set1(88.f));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    V p = set1(1.9875691500e-4f);
    p = fma(p, r, set1(1.3981999507e-3f));
    p = fma(p, r, set1(8.3334519073e-3f));
    p = fma(p, r, set1(4.1665795894e-2f));
    p = fma(p, r, set1(1.6666665459e-1f));
    p = fma(p, r, set1(5.0000001201e-1f));
    p = fma(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    // Outside the clamp: underflow to 0, overflow to inf, NaN stays NaN (as expf).
    p = _mm256_blendv_ps(p, zero(), _mm256_cmp_ps(x0, set1(-87.3f), _CMP_LT_OQ));
    p = _mm256_blendv_ps(p, set1(__builtin_inff()), _mm256_cmp_ps(x0, set1(88.f), _CMP_GT_OQ));
    return _mm256_blendv_ps(p, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
  }
  // In-place 8 x 8 transpose: afterwards r[c][i] is the old r[i][c].
  static void transpose(V r[8]) {
    V t[8], s[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_permute2f128_ps(s[j], s[j + 4], 0x20);
      r[j + 4] = _mm256_permute2f128_ps(s[j], s[j + 4], 0x31);
    }
  }
};

using T = Avx2;
#include "backends/cpu/cpu_kernels_simd.inc"

}  // namespace

const KernelTable* table_avx2() { return &kTable; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
const KernelTable* table_avx2() { return nullptr; }
}  // namespace mb::cpu

#endif
