// AVX2 kernel of the integer matmul (qmatmul.h), for CPUs without AVX-512 VNNI (AMD Zen 2/3,
// Intel before Ice Lake). This file alone is built with AVX2/FMA/F16C; qmatmul_kernel() calls it
// only after checking the CPU. Hand-written because no library has kernels for GGUF's blocks.
//
// Same packed layout as the AVX-512 kernel: a 64-byte code vector holds 4 consecutive k of the
// group's 16 rows; its first 32 bytes are rows 0-7, the last 32 rows 8-15, so this kernel runs
// each group as two halves of 8 rows (lanes are rows, as in the VNNI kernel). VPDPBUSD becomes
// VPMADDUBSW (u8 x s8 -> i16 pairs) + VPMADDWD (-> i32), as llama.cpp does on AVX2. The i16 sums
// of several quads are added before widening, never more than fit (|q| <= 127):
//   4-bit codes 2·15·127 = 3810 per quad, 8 fit (all 8 of a block are used);  5-bit 7874, 4;
//   6-bit 16002, 2.
// 8-bit codes (Q8_0, c = w + 128) would overflow: their dots run on the signed weights
// (|w|·sign(q, w), at most 2·128·127 per pair), which is the signed dot the scalar twin scales.
// Everything after the integer dot is the twin's float operations in its order, so results
// equal qmatmul_ref bit for bit.
#include "backends/cpu/qmatmul.h"
#include "backends/cpu/cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace mb::cpu {
namespace {

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// v shifted by s bits (left for s > 0) in 16-bit lanes: the bits of interest of each byte land
// on bits 4-5 and those crossing into the neighbouring byte fall outside them (the caller masks).
inline __m256i shift16(__m256i v, int s) {
  return s > 0 ? _mm256_slli_epi16(v, s) : s < 0 ? _mm256_srli_epi16(v, -s) : v;
}

// Codes of quad q (k = 4q..4q+3) of the 8 rows of half h of one 32-k block; Wide: the block was
// widened to 8 bits per code already (widen_groups), as Q8_0's packed codes are.
template <DType T, bool Wide> inline __m256i codes(const uint8_t* cb, int h, int q) {
  if constexpr (T == DType::Q8_0 || Wide) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * q + 32 * h));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * (q / 2) + 32 * h));
    const __m256i lo = _mm256_set1_epi8(0x0F);
    __m256i c = _mm256_and_si256(q & 1 ? _mm256_srli_epi16(v, 4) : v, lo);
    if constexpr (T == DType::Q5_0) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 32 * h));
      c = _mm256_or_si256(c, _mm256_and_si256(shift16(hb, 4 - q), _mm256_set1_epi8(0x10)));
    }
    if constexpr (T == DType::Q6_K) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 64 * (q / 4) + 32 * h));
      c = _mm256_or_si256(c, _mm256_and_si256(shift16(hb, 4 - 2 * (q % 4)), _mm256_set1_epi8(0x30)));
    }
    return c;
  }
}

// Codes of groups [g0, g1) widened to 8 bits (512 bytes per 32-k block, a group's blocks
// contiguous) into out: prefill reads each group once per tile of 4 tokens, so unpacking once
// per stretch (not once per tile) takes the nibble and high-bit work out of the inner loop.
template <DType T> void widen_groups(const QPacked& w, int64_t g0, int64_t g1, uint8_t* out) {
  constexpr QLayout Lay = qlayout(T);
  const int64_t nb = w.k / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* cb = w.codes(g, 0);
    for (int64_t bi = 0; bi < nb; ++bi, cb += Lay.block_codes, out += 512)
      for (int q = 0; q < 8; ++q)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * q + 32 * h), codes<T, false>(cb, h, q));
  }
}

// 4-bit codes (Q4_0, Q4_K) run their tiles of several tokens over both 8-row halves at once, so
// that each activation broadcast feeds two products. On Zen 3 a VPBROADCASTD from memory takes
// an FP pipe like the arithmetic does, and loads into vector registers issue two a cycle; the
// one-half tile spent most of both on broadcasts. Their 8 quads are then summed in i16 before
// widening (no i32 partials to hold: the two halves' partials no longer fit the 16 registers).
// llvm-mca (znver3) schedules Q4_0's 4-token tile in fewer cycles per VPMADDUBSW this way than
// one half at a time; the other types stay faster one half at a time.
template <DType T> constexpr bool kBothHalves = T == DType::Q4_0 || T == DType::Q4_K;
// Quads whose i16 products are summed before widening (at most what fits, see the file comment;
// one half or one token at a time, 4 of the 8 a 4-bit block allows measured faster than 8: a
// shorter chain of dependent adds), and quads per scale (Q6_K's scales change every 16 k).
template <DType T, int NT> constexpr int kQuadsPerWiden = T == DType::Q8_0 ? 1 : T == DType::Q6_K ? 2 : kBothHalves<T> && NT > 1 ? 8 : 4;
template <DType T> constexpr int kQuadsPerScale = T == DType::Q6_K ? 4 : 8;

inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Weight scale a and offset b of the 8 rows of half h for block blk of a unit (sub-block s of it
// for Q6_K), in the scalar twin's order of operations.
struct BlockScales {
  __m256 a, b;
};
template <DType T> inline BlockScales block_scales(const uint8_t* su, int h, int blk, int s) {
  const int r0 = 8 * h;
  if constexpr (T == DType::Q6_K) {
    const __m256 a = _mm256_mul_ps(f16x8(su + 2 * r0), i8x8(su + 32 + 16 * (2 * blk + s) + r0));
    return {a, _mm256_mul_ps(a, _mm256_set1_ps(-32.f))};
  } else if constexpr (T == DType::Q4_K) {
    const __m256 a = _mm256_mul_ps(f16x8(su + 2 * r0), u8x8(su + 64 + 16 * blk + r0));
    const __m256 m = _mm256_mul_ps(f16x8(su + 32 + 2 * r0), u8x8(su + 192 + 16 * blk + r0));
    return {a, _mm256_xor_ps(m, _mm256_set1_ps(-0.f))};
  } else if constexpr (T == DType::Q8_0) {
    return {f16x8(su + 2 * r0), _mm256_setzero_ps()};  // b unused: the dot is signed
  } else {
    const __m256 a = f16x8(su + 2 * r0);
    return {a, _mm256_mul_ps(a, _mm256_set1_ps(T == DType::Q5_0 ? -16.f : -8.f))};
  }
}

// An empty asm the value passes through: GCC otherwise reassociates Q8_0's integer sums of a
// block into a tree over every quad's products, holding them all at once and spilling them to
// the stack, so the loop runs on stores and reloads. The 4-bit types' sums measured no faster
// with it.
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// Bytes ahead of the codes being read that each block prefetches (in the pass over the first
// half: the second half's bytes share those cache lines).
constexpr size_t kPrefetch = 2048;

// y rows [8·h0, 8·h0 + 8·NH) of group g (rows past `rows` not written) for tokens [tb, tb + NT):
// NH halves of 8 rows in one pass over the codes (decode: two independent accumulator chains
// and one read of each cache line; 4-bit tiles: see kBothHalves) or one half per call (the other
// types' tiles of several tokens, whose accumulators and sums fill the 16 registers). Codes from
// cb: the group's packed codes, or (Wide) its codes widened to 8 bits.
// Not inlined: each tile shape is its own symbol in a profile, and its registers are allocated
// for it alone, not for the driver loops around it.
template <DType T, int NT, int NH, bool Wide>
__attribute__((noinline)) void rows_tokens(const QPacked& w, const QActs& x, const uint8_t* cb, int64_t g, int h0, int64_t tb, float* y,
                 int64_t ldy, int rows) {
  constexpr QLayout Lay = qlayout(T);
  constexpr size_t kBlockCodes = Wide ? 512 : Lay.block_codes;
  constexpr int kW = kQuadsPerWiden<T, NT>, kS = kQuadsPerScale<T>;
  const int64_t nb = w.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NH][NT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_setzero_ps();
  // Token t's activations and per-block sums sit a fixed stride after token 0's: one base
  // pointer per array keeps every address in registers (arrays of NT pointers spilled them).
  const int8_t* xq = x.qrow(tb);
  const float* dx = x.dx.data() + tb * nb;
  const float* ds = T == DType::Q6_K ? x.dsum16.data() + 2 * tb * nb : x.dsum32.data() + tb * nb;
  const int64_t ds_stride = T == DType::Q6_K ? 2 * nb : nb;
  const uint8_t* su = w.scales(g, 0);
  for (int64_t bi = 0; bi < nb; ++bi, cb += kBlockCodes) {
    const int blk = int(bi % Lay.blocks_per_unit);
    if (blk == 0 && bi > 0) su += Lay.unit_scales;
    if (h0 == 0 && !Wide)
      for (size_t off = 0; off < Lay.block_codes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(cb + kPrefetch + off), _MM_HINT_T0);
    const int8_t* xb = xq + 32 * bi;
#pragma GCC unroll 2
    for (int s = 0; s < 8 / kS; ++s) {
      __m256i dot[NH][NT];
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < NT; ++t) dot[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int q0 = s * kS; q0 < (s + 1) * kS; q0 += kW) {
        __m256i part[NH][NT];
        for (int h = 0; h < NH; ++h)
          for (int t = 0; t < NT; ++t) part[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = q0; q < q0 + kW; ++q)
#pragma GCC unroll 2
          for (int h = 0; h < NH; ++h) {
            const __m256i c = codes<T, Wide>(cb, h0 + h, q);
            if constexpr (T == DType::Q8_0) {
              const __m256i wq = _mm256_xor_si256(c, _mm256_set1_epi8(int8_t(0x80)));  // the signed weights
              const __m256i mag = _mm256_abs_epi8(wq);
              for (int t = 0; t < NT; ++t)
                part[h][t] = _mm256_add_epi16(part[h][t], _mm256_maddubs_epi16(mag, _mm256_sign_epi8(bcast4(xb + t * w.k + 4 * q), wq)));
            } else {
              for (int t = 0; t < NT; ++t) {
                part[h][t] = _mm256_add_epi16(part[h][t], _mm256_maddubs_epi16(c, bcast4(xb + t * w.k + 4 * q)));
                // Without it GCC sums the 8 quads as a tree, holding every product at once, and
                // a two-half tile spills (the same reassociation Q8_0's dot is kept from).
                if constexpr (kBothHalves<T> && NT > 1) keep_in_register(part[h][t]);
              }
            }
          }
        for (int h = 0; h < NH; ++h)
          for (int t = 0; t < NT; ++t) {
            dot[h][t] = _mm256_add_epi32(dot[h][t], _mm256_madd_epi16(part[h][t], ones));
            if constexpr (T == DType::Q8_0) keep_in_register(dot[h][t]);
          }
      }
      for (int h = 0; h < NH; ++h) {
        const BlockScales sc = block_scales<T>(su, h0 + h, blk, s);
        for (int t = 0; t < NT; ++t) {
          acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][t]), _mm256_mul_ps(sc.a, _mm256_set1_ps(dx[t * nb + bi])), acc[h][t]);
          if constexpr (T != DType::Q8_0)  // Q8_0's dot is signed already
            acc[h][t] = _mm256_fmadd_ps(sc.b, _mm256_set1_ps(ds[t * ds_stride + (T == DType::Q6_K ? 2 * bi + s : bi)]), acc[h][t]);
        }
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const int valid = std::min(8, rows - 8 * (h0 + h));
    if (valid <= 0) break;
    float* out = y + tb * ldy + g * kQRows + 8 * (h0 + h);
    if (valid == 8) {
      for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * ldy, acc[h][t]);
    } else {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int t = 0; t < NT; ++t) _mm256_maskstore_ps(out + t * ldy, mask, acc[h][t]);
    }
  }
}

template <DType T, int NT, bool Wide>
void group_tokens(const QPacked& w, const QActs& x, const uint8_t* cb, int64_t g, int64_t tb, float* y, int64_t ldy) {
  const int rows = int(std::min<int64_t>(kQRows, w.m - g * kQRows));
  if constexpr (NT == 1 || kBothHalves<T>) {
    rows_tokens<T, NT, 2, Wide>(w, x, cb, g, 0, tb, y, ldy, rows);
  } else {
    for (int h = 0; h < 2 && 8 * h < rows; ++h) rows_tokens<T, NT, 1, Wide>(w, x, cb, g, h, tb, y, ldy, rows);
  }
}

// Tokens [t0, t1) of groups [g0, g1); codes(g) gives group g's codes in the Wide or packed form.
template <DType T, bool Wide, class Codes>
void tokens_of_groups(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0,
                      int64_t t1, Codes&& codes_of) {
  int64_t t = t0;
  // Tiles of 4 tokens share each code vector (4 sums, 4 accumulators and the codes fit 16 ymm).
  for (; t + 4 <= t1; t += 4)
    for (int64_t g = g0; g < g1; ++g) group_tokens<T, 4, Wide>(w, x, codes_of(g), g, t, y, ldy);
  for (int64_t g = g0; g < g1; ++g) switch (t1 - t) {
      case 3: group_tokens<T, 3, Wide>(w, x, codes_of(g), g, t, y, ldy); break;
      case 2: group_tokens<T, 2, Wide>(w, x, codes_of(g), g, t, y, ldy); break;
      case 1: group_tokens<T, 1, Wide>(w, x, codes_of(g), g, t, y, ldy); break;
      default: break;
    }
}

// From this many tokens, codes other than Q8_0's are widened once per stretch of groups. The
// widening pass streams the weights before any product starts, so it pays only once it saves
// the unpacking of several tiles: batch-8 decode (2 tiles) measured faster unpacking on the fly.
constexpr int64_t kWideMinTokens = 16;

template <DType T>
void kernel_t(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  const bool wide = T != DType::Q8_0 && t1 - t0 >= kWideMinTokens;
  // Stretches of groups whose (widened) codes, ~128 KB, stay in L2 while every tile of 4 tokens
  // reads them.
  const size_t wide_group = size_t(w.k / 32) * 512;
  const int64_t stretch = std::max<int64_t>(1, int64_t((size_t(128) << 10) / (wide ? wide_group : w.group_bytes)));
  thread_local Scratch wide_buf;
  uint8_t* buf = wide ? static_cast<uint8_t*>(wide_buf.bytes(size_t(std::min(stretch, g1 - g0)) * wide_group)) : nullptr;
  if (g0 < g1) w.prefetch_start(g0, kPrefetch);
  for (int64_t gs = g0; gs < g1; gs += stretch) {
    const int64_t ge = std::min(g1, gs + stretch);
    if (wide) {
      widen_groups<T>(w, gs, ge, buf);
      tokens_of_groups<T, true>(w, x, y, ldy, gs, ge, t0, t1, [&](int64_t g) { return buf + size_t(g - gs) * wide_group; });
    } else {
      tokens_of_groups<T, false>(w, x, y, ldy, gs, ge, t0, t1, [&](int64_t g) { return w.codes(g, 0); });
    }
  }
}

void kernel(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  if (!with_packed_type(w.type, [&](auto t) { kernel_t<decltype(t)::value>(w, x, y, ldy, g0, g1, t0, t1); }))
    qmatmul_ref(w, x, y, ldy, g0, g1, t0, t1);
}

// quantize_acts_ref 8 values per step: amax, d = amax / 127, q = round-to-even(x·(1/d)) in the
// same float operations, so the bytes and scales are identical.
void quantize_rows(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t b0, int64_t b1, QActs& a) {
  const int64_t k = a.k, nb = k / 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + t * ldx + 32 * b;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax >= 1e-30f ? amax / 127.f : 0.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
      // i32 -> i8 (values within [-127, 127]): the packs interleave 128-bit lanes; the permute
      // puts them back in order.
      const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      const __m256i p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + t * k + 32 * b), p8);
      int s[2];
      for (int hf = 0; hf < 2; ++hf) {
        __m256i sum = _mm256_add_epi32(q[2 * hf], q[2 * hf + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        s[hf] = _mm_cvtsi128_si32(s4);
      }
      const size_t bi = size_t(t * nb + b);
      a.dx[bi] = d;
      a.qsum[bi] = s[0] + s[1];
      a.dsum32[bi] = d * float(s[0] + s[1]);
      a.dsum16[2 * bi] = d * float(s[0]);
      a.dsum16[2 * bi + 1] = d * float(s[1]);
    }
}

}  // namespace

QMatmulFn qmatmul_avx2() { return kernel; }
QuantizeActsFn quantize_acts_avx2() { return quantize_rows; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
QMatmulFn qmatmul_avx2() { return nullptr; }
QuantizeActsFn quantize_acts_avx2() { return nullptr; }
}  // namespace mb::cpu

#endif
