// The fused dequantize-dot of the f32-activation path (cpu::vec_dot, cpu_kernels.h): Σ w·x for a
// row left in its storage format. Each block's integers are widened to int8 lanes, multiplied by
// x in f32 and the block's scale applied once per (sub-)block; mins contribute scale·Σx. Same
// products as vec_dot_ref (core/quant.h), summed in a different order.
// The AVX2 code is compiled per function (target attribute), not per file like the kernel tables:
// it calls core's inline block helpers, and a file built with -mavx2 would emit AVX2 copies of
// them that the linker could pick for every caller. Which path runs is the active kernel table's
// choice (cpu_kernels.cpp's one CPU check and MARKBASE_CPU_ISA), never a check of its own.
#include <cstring>

#include "backends/cpu/cpu_kernels.h"
#include "core/error.h"
#include "core/quant.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MB_HAVE_AVX2_PATH 1
#define MB_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace mb::cpu {

#ifdef MB_HAVE_AVX2_PATH

namespace {

using namespace blocks;

MB_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

MB_AVX2 inline __m256 i8x8_to_f32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// Lane-wise partial sums of Σ q[i]·x[i] over 16 / 32 int8 values.
MB_AVX2 inline __m256 dot16(__m128i q, const float* x) {
  __m256 acc = _mm256_mul_ps(i8x8_to_f32(q), _mm256_loadu_ps(x));
  return _mm256_fmadd_ps(i8x8_to_f32(_mm_srli_si128(q, 8)), _mm256_loadu_ps(x + 8), acc);
}
MB_AVX2 inline __m256 dot32(__m256i q, const float* x) {
  return _mm256_add_ps(dot16(_mm256_castsi256_si128(q), x), dot16(_mm256_extracti128_si256(q, 1), x + 16));
}
MB_AVX2 inline __m256 sum32(const float* x) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                       _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
}

// 16 bytes of nibble pairs -> 32 values: the low nibbles, then the high nibbles.
MB_AVX2 inline __m256i nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// Bit i of 4 little-endian bytes -> byte i = 0x10 or 0 (the fifth bit of Q5_0 / Q5_1 values).
MB_AVX2 inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));  // all bits but byte i's bit i % 8
  v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

MB_AVX2 inline __m256 bcast_h(uint16_t h) { return _mm256_set1_ps(_cvtsh_ss(h)); }

MB_AVX2 float dot_q8_0(const Q8_0* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs));
    acc = _mm256_fmadd_ps(bcast_h(w[b].d), dot32(q, x), acc);
  }
  return hsum(acc);
}

MB_AVX2 float dot_q4_0(const Q4_0* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const __m256i q = _mm256_sub_epi8(nibbles16(w[b].qs), _mm256_set1_epi8(8));
    acc = _mm256_fmadd_ps(bcast_h(w[b].d), dot32(q, x), acc);
  }
  return hsum(acc);
}

MB_AVX2 float dot_q4_1(const Q4_1* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    acc = _mm256_fmadd_ps(bcast_h(w[b].d), dot32(nibbles16(w[b].qs), x), acc);
    acc_min = _mm256_fmadd_ps(bcast_h(w[b].m), sum32(x), acc_min);
  }
  return hsum(_mm256_add_ps(acc, acc_min));
}

MB_AVX2 float dot_q5_0(const Q5_0* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    __m256i q = _mm256_or_si256(nibbles16(w[b].qs), fifth_bits(w[b].qh));
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    acc = _mm256_fmadd_ps(bcast_h(w[b].d), dot32(q, x), acc);
  }
  return hsum(acc);
}

MB_AVX2 float dot_q5_1(const Q5_1* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const __m256i q = _mm256_or_si256(nibbles16(w[b].qs), fifth_bits(w[b].qh));
    acc = _mm256_fmadd_ps(bcast_h(w[b].d), dot32(q, x), acc);
    acc_min = _mm256_fmadd_ps(bcast_h(w[b].m), sum32(x), acc_min);
  }
  return hsum(_mm256_add_ps(acc, acc_min));
}

// Q4_K / Q5_K: 64-element groups g, low nibbles with sub-block 2g, high nibbles with 2g + 1. The
// min terms go to their own accumulator so the two FMA chains overlap.
template <bool kFifthBit, class Block>
MB_AVX2 float dot_q45_k(const Block* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const float d = _cvtsh_ss(w[b].d), dmin = _cvtsh_ss(w[b].dmin);
    float scale[8], min[8];
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k_scale_min(j, w[b].scales, sc, m);
      scale[j] = d * float(sc);
      min[j] = dmin * float(m);
    }
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qh));
    for (int g = 0; g < 4; ++g, x += 64) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs + 32 * g));
      __m256i q1 = _mm256_and_si256(bytes, lo4), q2 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), lo4);
      if constexpr (kFifthBit) {
        // After the mask only bit 0 of each byte survives, so the 16-bit shifts do not leak.
        q1 = _mm256_or_si256(q1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
        q2 = _mm256_or_si256(q2, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
      }
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[2 * g]), dot32(q1, x), acc);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale[2 * g + 1]), dot32(q2, x + 32), acc);
      acc_min = _mm256_fmadd_ps(_mm256_set1_ps(min[2 * g]), sum32(x), acc_min);
      acc_min = _mm256_fmadd_ps(_mm256_set1_ps(min[2 * g + 1]), sum32(x + 32), acc_min);
    }
  }
  return hsum(_mm256_sub_ps(acc, acc_min));
}

// Bits 4-5 of the Q6_K values whose pair sits at `shift` in qh.
MB_AVX2 inline __m256i q6_high(__m256i qh, int shift, __m256i three) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, shift), three), 4);
}

MB_AVX2 float dot_q6_k(const Q6_K* w, const float* x, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < nb; ++b) {
    const float d = _cvtsh_ss(w[b].d);
    for (int h = 0; h < 2; ++h, x += 128) {
      const uint8_t* ql = w[b].ql + 64 * h;
      const int8_t* sc = w[b].scales + 8 * h;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qh + 32 * h));
      const __m256i q[4] = {
          _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, lo4), q6_high(qh, 0, three)), off),
          _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, lo4), q6_high(qh, 2, three)), off),
          _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4), q6_high(qh, 4, three)), off),
          _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4), q6_high(qh, 6, three)), off),
      };
      for (int k = 0; k < 4; ++k) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * float(sc[2 * k])), dot16(_mm256_castsi256_si128(q[k]), x + 32 * k),
                              acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * float(sc[2 * k + 1])),
                              dot16(_mm256_extracti128_si256(q[k], 1), x + 32 * k + 16), acc);
      }
    }
  }
  return hsum(acc);
}

MB_AVX2 float dot_plain(DType t, const void* row, const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  float tail = 0.f;
  int64_t i = 0;
  if (t == DType::F32) {
    const float* w = static_cast<const float*>(row);
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
    for (; i < n; ++i) tail += w[i] * x[i];
  } else {
    const uint16_t* w = static_cast<const uint16_t*>(row);
    const bool f16 = t == DType::F16;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
      const __m256 wf = f16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      acc = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + i), acc);
    }
    for (; i < n; ++i) tail += (f16 ? _cvtsh_ss(w[i]) : bf16_to_f32(w[i])) * x[i];
  }
  return hsum(acc) + tail;
}

MB_AVX2 float vec_dot_avx2(DType t, const void* row, const float* x, int64_t n) {
  const int64_t nb = n / dtype_block_size(t);
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16: return dot_plain(t, row, x, n);
    case DType::Q8_0: return dot_q8_0(static_cast<const Q8_0*>(row), x, nb);
    case DType::Q4_0: return dot_q4_0(static_cast<const Q4_0*>(row), x, nb);
    case DType::Q4_1: return dot_q4_1(static_cast<const Q4_1*>(row), x, nb);
    case DType::Q5_0: return dot_q5_0(static_cast<const Q5_0*>(row), x, nb);
    case DType::Q5_1: return dot_q5_1(static_cast<const Q5_1*>(row), x, nb);
    case DType::Q4_K: return dot_q45_k<false>(static_cast<const Q4_K*>(row), x, nb);
    case DType::Q5_K: return dot_q45_k<true>(static_cast<const Q5_K*>(row), x, nb);
    case DType::Q6_K: return dot_q6_k(static_cast<const Q6_K*>(row), x, nb);
    default: fail("vec_dot: unsupported dtype {}", dtype_name(t));
  }
}

}  // namespace

// The AVX-512 table implies AVX2 (cpu_kernels.cpp grants it only with AVX2, FMA and F16C), and
// this dot has no wider version: both SIMD tables take the AVX2 one.
float vec_dot(DType t, const void* row, const float* x, int64_t n) {
  dtype_row_bytes(t, n);
  return kernels().isa == Isa::Scalar ? vec_dot_ref(t, row, x, n) : vec_dot_avx2(t, row, x, n);
}

#else

float vec_dot(DType t, const void* row, const float* x, int64_t n) { return vec_dot_ref(t, row, x, n); }

#endif

}  // namespace mb::cpu
