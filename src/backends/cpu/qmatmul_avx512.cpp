// AVX-512 VNNI kernel of the integer matmul (qmatmul.h). This file alone is built with those flags;
// qmatmul_kernel() calls it only after checking the CPU. Hand-written because no library has
// kernels for GGUF's block formats.
#include "backends/cpu/qmatmul.h"
#include "backends/cpu/cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace mb::cpu {
namespace {

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// v shifted so that bits s..s+1 of each byte land on bits 4-5 (S = 4 - s, a constant), the bits
// that cross into a neighbouring byte falling outside 4-5; the caller masks.
template <int S> inline __m512i shift_to_bit4(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
  else return v;
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
    if constexpr (T == DType::Q5_0) {
      const __m512i h = _mm512_loadu_si512(cb + 256), b4 = _mm512_set1_epi8(0x10);
      c[0] = _mm512_or_si512(c[0], _mm512_and_si512(shift_to_bit4<4>(h), b4));
      c[1] = _mm512_or_si512(c[1], _mm512_and_si512(shift_to_bit4<3>(h), b4));
      c[2] = _mm512_or_si512(c[2], _mm512_and_si512(shift_to_bit4<2>(h), b4));
      c[3] = _mm512_or_si512(c[3], _mm512_and_si512(shift_to_bit4<1>(h), b4));
      c[4] = _mm512_or_si512(c[4], _mm512_and_si512(shift_to_bit4<0>(h), b4));
      c[5] = _mm512_or_si512(c[5], _mm512_and_si512(shift_to_bit4<-1>(h), b4));
      c[6] = _mm512_or_si512(c[6], _mm512_and_si512(shift_to_bit4<-2>(h), b4));
      c[7] = _mm512_or_si512(c[7], _mm512_and_si512(shift_to_bit4<-3>(h), b4));
    }
    if constexpr (T == DType::Q6_K) {
      const __m512i b45 = _mm512_set1_epi8(0x30);
      for (int j = 0; j < 2; ++j) {
        const __m512i h = _mm512_loadu_si512(cb + 256 + 64 * j);
        c[4 * j] = _mm512_or_si512(c[4 * j], _mm512_and_si512(shift_to_bit4<4>(h), b45));
        c[4 * j + 1] = _mm512_or_si512(c[4 * j + 1], _mm512_and_si512(shift_to_bit4<2>(h), b45));
        c[4 * j + 2] = _mm512_or_si512(c[4 * j + 2], _mm512_and_si512(h, b45));
        c[4 * j + 3] = _mm512_or_si512(c[4 * j + 3], _mm512_and_si512(shift_to_bit4<-2>(h), b45));
      }
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

// acc = fma(float(dot), a·dx, acc); acc = fma(b, dsum, acc): the scalar twin's order. Q8_0 takes
// the signed dot, Σ c·q - 128·Σq (dsum is then 128·Σq as a float: both are integers below 2^24,
// so the float subtraction is exact), and no b term.
template <DType T> inline __m512 accumulate(__m512 acc, __m512i dot, __m512 a, __m512 b, float dx, float dsum) {
  if constexpr (T == DType::Q8_0)
    return _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(dsum)),
                           _mm512_mul_ps(a, _mm512_set1_ps(dx)), acc);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(b, _mm512_set1_ps(dsum), acc);
}
// The dsum accumulate<T> wants for block bi of token t (rows of per-block sums from ds).
template <DType T> inline float block_dsum(const QActs& x, int64_t t, int64_t si) {
  const int64_t nb = x.k / 32;
  if constexpr (T == DType::Q8_0) return float(128 * x.qsum[size_t(t * nb + si)]);
  if constexpr (T == DType::Q6_K) return x.dsum16[size_t(t * 2 * nb + si)];
  return x.dsum32[size_t(t * nb + si)];
}

// Each block prefetches the codes kFarAhead bytes past it into L2 and kNearAhead bytes past it
// into L1. To stream at DRAM speed a core must keep many lines in flight, and L2 tracks more
// outstanding misses than L1 does: with a single distance into L1, one thread read the weights
// well below what the read-bandwidth probe reached. The far prefetch keeps enough lines in flight;
// the near one brings each line into L1 just before the loop reads it. The two distances were
// chosen by alternating decode runs against single distances into L1 or L2 (measured: see
// docs/benchmarks.md). A task starts by prefetching its first kFarAhead bytes, which the in-loop
// prefetches never cover, all into L1: it reads them within microseconds (the same two levels
// there were no faster on large matrices and slower on small ones, where the start is a larger
// part of each task).
constexpr size_t kFarAhead = 16384, kNearAhead = 2048;

// The per-unit f16 scales of the K types (d, and dmin for Q4_K), loaded once per 8 blocks.
template <DType T> inline void unit_scales(const uint8_t* su, __m512& d, __m512& dmin) {
  if constexpr (T == DType::Q4_K) {
    d = f16x16(su);
    dmin = f16x16(su + 32);
  } else if constexpr (T == DType::Q6_K) {
    d = f16x16(su);
  }
}

// Weight scale a and offset b of the 16 rows for block blk of a unit (half h of it for Q6_K), in
// the scalar twin's order of operations.
struct BlockScales {
  __m512 a, b;
};
template <DType T> inline BlockScales block_scales(const uint8_t* su, int blk, int h, __m512 d, __m512 dmin) {
  if constexpr (T == DType::Q6_K) {
    const __m512 a = _mm512_mul_ps(d, i8x16(su + 32 + 16 * (2 * blk + h)));
    return {a, _mm512_mul_ps(a, _mm512_set1_ps(-32.f))};
  } else if constexpr (T == DType::Q4_K) {
    const __m512 a = _mm512_mul_ps(d, u8x16(su + 64 + 16 * blk));
    const __m512 b = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(dmin, u8x16(su + 192 + 16 * blk))), _mm512_set1_epi32(int32_t(0x80000000u))));
    return {a, b};
  } else if constexpr (T == DType::Q8_0) {
    return {f16x16(su), _mm512_setzero_ps()};  // b unused: accumulate<Q8_0> scales the signed dot
  } else {
    const __m512 a = f16x16(su);
    return {a, _mm512_mul_ps(a, _mm512_set1_ps(T == DType::Q5_0 ? -16.f : -8.f))};
  }
}

template <DType T, int NT>
void group_tokens(const QPacked& w, const QActs& x, int64_t g, int64_t tb, float* y, int64_t ldy, __mmask16 rows) {
  constexpr QLayout Lay = qlayout(T);
  const int64_t nb = w.k / 32;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int8_t* xr[NT];
  const float* dx[NT];
  for (int t = 0; t < NT; ++t) {
    xr[t] = x.qrow(tb + t);
    dx[t] = x.dx.data() + (tb + t) * nb;
  }
  const uint8_t* cb = w.codes(g, 0);
  const uint8_t* su = w.scales(g, 0);
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  for (int64_t bi = 0; bi < nb; ++bi, cb += Lay.block_codes) {
    const int blk = int(bi % Lay.blocks_per_unit);
    if (blk == 0 && bi > 0) su += Lay.unit_scales;
    if (blk == 0) unit_scales<T>(su, d, dmin);
    for (size_t off = 0; off < Lay.block_codes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(cb + kFarAhead + off), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(cb + kNearAhead + off), _MM_HINT_T0);
    }
    __m512i c[8];
    unpack<T>(cb, c);
    const int64_t kb = 32 * bi;
    if constexpr (T == DType::Q6_K) {
      for (int h = 0; h < 2; ++h) {
        const BlockScales s = block_scales<T>(su, blk, h, d, dmin);
        for (int t = 0; t < NT; ++t) {
          const __m512i dt = h == 0 ? dot<0, 4>(c, xr[t] + kb) : dot<4, 8>(c, xr[t] + kb);
          acc[t] = accumulate<T>(acc[t], dt, s.a, s.b, dx[t][bi], block_dsum<T>(x, tb + t, 2 * bi + h));
        }
      }
    } else {
      const BlockScales s = block_scales<T>(su, blk, 0, d, dmin);
      for (int t = 0; t < NT; ++t)
        acc[t] = accumulate<T>(acc[t], dot<0, 8>(c, xr[t] + kb), s.a, s.b, dx[t][bi], block_dsum<T>(x, tb + t, bi));
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (tb + t) * ldy + g * kQRows, rows, acc[t]);
}

template <DType T>
void kernel_t(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  if (g0 < g1) w.prefetch_start(g0, kFarAhead);
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
  if (!with_packed_type(w.type, [&](auto t) { kernel_t<decltype(t)::value>(w, x, y, ldy, g0, g1, t0, t1); }))
    qmatmul_ref(w, x, y, ldy, g0, g1, t0, t1);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// AMX: one TDPBSUD multiplies 16 tokens x 32 activation bytes (signed) by one 32-k block of a
// group's codes (unsigned), which the packed layout already stores the way a B tile wants them
// (4 consecutive k of each of the 16 rows per 64-byte row): 16 x 16 int32 dots in one instruction,
// where the VNNI kernel needs 128. Every block (half-block for Q6_K) has its own scale, so tiles
// never span blocks; the scaling runs in AVX-512 on the stored tile in the scalar twin's order,
// which keeps the result equal to qmatmul_ref bit for bit.
namespace amx {

// Tile registers as used below (the _tile_* macros need them as literals): 0, 5, 6, 7 hold the dots
// of up to 4 sub-blocks in flight, 1/3 activations and 2/4 codes, alternating so that consecutive
// loads do not wait on the previous product. A sub-block is 32 k, or 16 k for Q6_K (its scales
// change every 16): the two shapes are two configurations.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config(int sub_k) {
  TileConfig t;
  for (int i : {0, 5, 6, 7}) t.rows[i] = 16, t.colsb[i] = 64;          // 16 tokens x 16 int32
  for (int i : {1, 3}) t.rows[i] = 16, t.colsb[i] = uint16_t(sub_k);  // 16 tokens x sub_k bytes
  for (int i : {2, 4}) t.rows[i] = uint8_t(sub_k / 4), t.colsb[i] = 64;  // sub_k / 4 quads x 16 rows
  return t;
}
const TileConfig& config(int sub_k) {
  static const TileConfig c32 = make_config(32), c16 = make_config(16);
  return sub_k == 16 ? c16 : c32;
}

// One sub-block's product into dot tile C from activation tile A and code tile B (literals).
#define MB_TILE_DOT(C, A, B, xa, cb, ldx) \
  do {                                     \
    _tile_zero(C);                         \
    _tile_loadd(A, xa, ldx);               \
    _tile_loadd(B, cb, 64);                \
    _tile_dpbsud(C, A, B);                 \
  } while (0)

// Dots of cnt (1..4) sub-blocks: tokens' bytes at xa[j] (rows ldx apart), codes at cb[j], into
// dots[j] (16 tokens x 16 rows). All products are issued before the first store.
inline void tile_dots(const int8_t* const (&xa)[4], const uint8_t* const (&cb)[4], int cnt, int64_t ldx,
                      int32_t (*dots)[256]) {
  MB_TILE_DOT(0, 1, 2, xa[0], cb[0], ldx);
  if (cnt > 1) MB_TILE_DOT(5, 3, 4, xa[1], cb[1], ldx);
  if (cnt > 2) MB_TILE_DOT(6, 1, 2, xa[2], cb[2], ldx);
  if (cnt > 3) MB_TILE_DOT(7, 3, 4, xa[3], cb[3], ldx);
  _tile_stored(0, dots[0], 64);
  if (cnt > 1) _tile_stored(5, dots[1], 64);
  if (cnt > 2) _tile_stored(6, dots[2], 64);
  if (cnt > 3) _tile_stored(7, dots[3], 64);
}
#undef MB_TILE_DOT


// Codes of groups [g0, g1) with every block widened to 8 bits (512 bytes per 32-k block, a group's
// blocks contiguous) into out; Q8_0's packed codes are that already and are not copied.
template <DType T> void widen_groups(const QPacked& w, int64_t g0, int64_t g1, uint8_t* out) {
  constexpr QLayout Lay = qlayout(T);
  const int64_t nb = w.k / 32;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* cb = w.codes(g, 0);
    for (int64_t bi = 0; bi < nb; ++bi, cb += Lay.block_codes, out += 512) {
      __m512i c[8];
      unpack<T>(cb, c);
      for (int q = 0; q < 8; ++q) _mm512_store_si512(out + 64 * q, c[q]);
    }
  }
}

// The activation scales of one tile of 16 tokens, sub-block major (dx[bi][t], dsum[s][t]), so the
// scaling loop reads them at fixed offsets from two pointers.
template <DType T> void tile_scales(const QActs& x, int64_t tb, float* dx, float* dsum) {
  const int64_t nb = x.k / 32, ns = T == DType::Q6_K ? 2 * nb : nb;
  for (int t = 0; t < 16; ++t) {
    for (int64_t bi = 0; bi < nb; ++bi) dx[bi * 16 + t] = x.dx[size_t((tb + t) * nb + bi)];
    for (int64_t si = 0; si < ns; ++si) dsum[si * 16 + t] = block_dsum<T>(x, tb + t, si);
  }
}

// acc[t] += the scaled dots of one stored 16x16 tile (token t's row at dots + 16t).
template <DType T>
inline void accumulate_tile(__m512 (&acc)[16], const int32_t* dots, const BlockScales& s, const float* dx,
                            const float* dsum) {
  for (int t = 0; t < 16; ++t)
    acc[t] = accumulate<T>(acc[t], _mm512_load_si512(dots + 16 * t), s.a, s.b, dx[t], dsum[t]);
}

// Tokens [tb, tb + 16) of group g: codes widened, dx/dsum from tile_scales.
template <DType T>
void group_tile(const QPacked& w, const QActs& x, const uint8_t* codes, const float* dx, const float* dsum,
                int64_t g, int64_t tb, float* y, int64_t ldy, __mmask16 rows) {
  constexpr QLayout Lay = qlayout(T);
  constexpr int sub = T == DType::Q6_K ? 16 : 32;  // k per sub-block
  constexpr int per_block = 32 / sub;
  // Two buffers of 4 sub-blocks' dots: the tile unit computes the next 4 while the vector unit
  // scales the last 4.
  alignas(64) int32_t dots[2][4][256];
  const int64_t ns = w.k / sub, ldx = x.k;
  const int8_t* xq = x.qrow(tb);
  auto issue = [&](int64_t s0) {
    const int8_t* xa[4];
    const uint8_t* cb[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t sj = std::min(s0 + j, ns - 1);
      xa[j] = xq + sub * sj;
      cb[j] = codes + 16 * sub * sj;
    }
    tile_dots(xa, cb, int(std::min<int64_t>(4, ns - s0)), ldx, dots[(s0 / 4) & 1]);
  };
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  issue(0);
  for (int64_t s0 = 0; s0 < ns; s0 += 4) {
    if (s0 + 4 < ns) issue(s0 + 4);
    const int cnt = int(std::min<int64_t>(4, ns - s0));
    for (int j = 0; j < cnt; ++j) {
      const int64_t sj = s0 + j, bi = sj / per_block;
      const int blk = int(bi % Lay.blocks_per_unit), h = int(sj % per_block);
      const uint8_t* su = w.scales(g, bi / Lay.blocks_per_unit);
      if (blk == 0 && h == 0) unit_scales<T>(su, d, dmin);
      accumulate_tile<T>(acc, dots[(s0 / 4) & 1][j], block_scales<T>(su, blk, h, d, dmin), dx + 16 * bi, dsum + 16 * sj);
    }
  }
  for (int t = 0; t < 16; ++t) _mm512_mask_storeu_ps(y + (tb + t) * ldy + g * kQRows, rows, acc[t]);
}

template <DType T>
void kernel_t(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  const int64_t full = t0 + (t1 - t0) / 16 * 16;  // whole tiles of 16 tokens; the rest takes VNNI
  if (full > t0) {
    thread_local Scratch code_buf, scale_buf;
    const int64_t nb = w.k / 32, ns = T == DType::Q6_K ? 2 * nb : nb;
    float* dx = scale_buf.floats(size_t(16 * (nb + ns)));
    float* dsum = dx + 16 * nb;
    // Stretches of groups whose widened codes (~256 KB) stay in L2 while every token tile of
    // the stretch reads them; each tile's activations stay in L1 across the stretch's groups.
    const int64_t stretch = std::max<int64_t>(1, (int64_t(256) << 10) / (16 * w.k));
    _tile_loadconfig(&config(T == DType::Q6_K ? 16 : 32));
    for (int64_t gs = g0; gs < g1; gs += stretch) {
      const int64_t ge = std::min(g1, gs + stretch);
      uint8_t* wide = nullptr;
      if constexpr (T != DType::Q8_0) {
        wide = static_cast<uint8_t*>(code_buf.bytes(size_t(ge - gs) * size_t(nb) * 512));
        widen_groups<T>(w, gs, ge, wide);
      }
      for (int64_t tb = t0; tb < full; tb += 16) {
        tile_scales<T>(x, tb, dx, dsum);
        for (int64_t g = gs; g < ge; ++g) {
          const int64_t valid = std::min<int64_t>(kQRows, w.m - g * kQRows);
          const uint8_t* codes = T == DType::Q8_0 ? w.codes(g, 0) : wide + size_t(g - gs) * size_t(nb) * 512;
          group_tile<T>(w, x, codes, dx, dsum, g, tb, y, ldy, __mmask16((1u << valid) - 1u));
        }
      }
    }
    _tile_release();
  }
  if (full < t1) mb::cpu::kernel_t<T>(w, x, y, ldy, g0, g1, full, t1);
}

void kernel(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
  if (!with_packed_type(w.type, [&](auto t) { kernel_t<decltype(t)::value>(w, x, y, ldy, g0, g1, t0, t1); }))
    qmatmul_ref(w, x, y, ldy, g0, g1, t0, t1);
}

}  // namespace amx
#endif

// quantize_acts_ref with 32 values per step: amax, d = amax / 127, q = round-to-even(x / d·...)
// in the same float operations, so the bytes and scales are identical.
void quantize_rows(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t b0, int64_t b1, QActs& a) {
  const int64_t k = a.k, nb = k / 32;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = b0; b < b1; ++b) {
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
      a.qsum[bi] = s0 + s1;
      a.dsum32[bi] = d * float(s0 + s1);
      a.dsum16[2 * bi] = d * float(s0);
      a.dsum16[2 * bi + 1] = d * float(s1);
    }
}

}  // namespace

QMatmulFn qmatmul_avx512() { return kernel; }
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
QMatmulFn qmatmul_amx() { return amx::kernel; }
#else
QMatmulFn qmatmul_amx() { return nullptr; }
#endif
QuantizeActsFn quantize_acts_avx512() { return quantize_rows; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
QMatmulFn qmatmul_avx512() { return nullptr; }
QMatmulFn qmatmul_amx() { return nullptr; }
QuantizeActsFn quantize_acts_avx512() { return nullptr; }
}  // namespace mb::cpu

#endif
