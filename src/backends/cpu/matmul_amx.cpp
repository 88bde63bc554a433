// AMX-BF16 kernels (bf16_gemm.h), exact and rounded. This file alone is built with the AMX flags;
// cpu::matmul calls it only after checking the CPU and the OS (cpu_amx_bf16_ready). Only
// intrinsics and plain loops: no standard-library templates, whose out-of-line copies could be
// shared with (and picked for) code that runs on any CPU.
#include "backends/cpu/bf16_gemm.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "backends/cpu/bf16_bits_avx512.h"

namespace mb::cpu {
namespace {

constexpr int kTile = 16;            // weight rows of an A tile, tokens of a B tile, both of a C tile
constexpr int64_t kKBlock = 32;      // k per tile product: 32 bf16 = one 64-byte tile row
constexpr int64_t kTileElems = 512;  // bf16 in one 1 KB tile
// The kernels are templates on P, the bf16 parts each activation is split into (split_bf16;
// bf16_gemm.h says why): 3 for exact products, 1 for rounded ones.
// bf16 of one token tile and k block in the packed activations: a B tile per part.
template <int P> constexpr int64_t kXStep = P * kTileElems;

inline int64_t k_blocks(int64_t k) { return (k + kKBlock - 1) / kKBlock; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline __mmask16 low_bits16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }
inline __mmask32 low_bits32(int64_t n) { return n >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1u); }

// Every tile 16 rows of 64 bytes. Registers: C[i][j] = 2i + j (weight row tile i, token tile j);
// weight tiles 4 and 5; activation tiles 6 and 7.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes.
inline void load_tile_config() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = kTile;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Rows of an 8 x 8 matrix of 64-bit lanes become its columns.
inline void transpose8(__m512i (&r)[8]) {
  // t[2i + e], 128-bit lane l: column 2l + e of rows 2i, 2i + 1.
  __m512i t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]);
  }
  for (int e = 0; e < 2; ++e) {
    const __m512i u01 = _mm512_shuffle_i64x2(t[e], t[2 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i u23 = _mm512_shuffle_i64x2(t[e], t[2 + e], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i v01 = _mm512_shuffle_i64x2(t[4 + e], t[6 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v23 = _mm512_shuffle_i64x2(t[4 + e], t[6 + e], _MM_SHUFFLE(3, 2, 3, 2));
    r[e] = _mm512_shuffle_i64x2(u01, v01, _MM_SHUFFLE(2, 0, 2, 0));
    r[2 + e] = _mm512_shuffle_i64x2(u01, v01, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + e] = _mm512_shuffle_i64x2(u23, v23, _MM_SHUFFLE(2, 0, 2, 0));
    r[6 + e] = _mm512_shuffle_i64x2(u23, v23, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

template <int P> size_t k_xp_bytes(int64_t n, int64_t k) {
  return size_t((n + kTile - 1) / kTile) * size_t(k_blocks(k)) * size_t(kXStep<P>) * 2;
}

// Per token tile and k block, one 1 KB B tile per part of the split. B tile row p holds k pair p
// of the 16 tokens: (x[t][2p], x[t][2p + 1]) for t = 0..15. The f32 pairs are transposed first
// (8 x 8 blocks of 64-bit lanes: tokens to pair rows), then split, which works lane by lane, and
// each part's high halves gathered into the row. Tokens past n and k past the end are zeros.
template <int P> void k_pack_x(const MatArgs& a, uint16_t* xp, int64_t tile0, int64_t tile1) {
  const int64_t nkb = k_blocks(a.k);
  // Words 1, 3, .., 31 of the first vector, then of the second: the bf16 high halves in order.
  alignas(64) int16_t odd[32];
  for (int i = 0; i < 32; ++i) odd[i] = int16_t(2 * i + 1);
  const __m512i high_halves = _mm512_load_si512(odd);
  const __m512 x_lo = _mm512_set1_ps(a.x_lo), x_hi = _mm512_set1_ps(a.x_hi);
  for (int64_t tile = tile0; tile < tile1; ++tile)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t k0 = kb * kKBlock;
      uint16_t* dst = xp + (tile * nkb + kb) * kXStep<P>;
      for (int half = 0; half < 2; ++half) {  // k pairs 8 half .. 8 half + 7
        const int64_t kh = k0 + 16 * half;
        const __mmask16 mask = low_bits16(a.k - kh > 0 ? a.k - kh : 0);
        __m512i pairs[2][8];  // [token group of 8][pair]
        for (int g = 0; g < 2; ++g) {
          for (int i = 0; i < 8; ++i) {
            const int64_t token = tile * kTile + 8 * g + i;
            // Clamped (max then min: a NaN stays NaN, as std::min(std::max(x, lo), hi) keeps
            // it); ±inf bounds leave x as it is.
            pairs[g][i] = token < a.n ? _mm512_castps_si512(_mm512_min_ps(
                                            x_hi, _mm512_max_ps(x_lo, _mm512_maskz_loadu_ps(mask, a.x + token * a.ldx + kh))))
                                      : _mm512_setzero_si512();
          }
          transpose8(pairs[g]);
        }
        for (int j = 0; j < 8; ++j) {
          __m512i lo[P], hi[P];  // tokens 0-7, 8-15
          split_bf16(_mm512_castsi512_ps(pairs[0][j]), lo);
          split_bf16(_mm512_castsi512_ps(pairs[1][j]), hi);
          for (int p = 0; p < P; ++p)
            _mm512_store_si512(dst + p * kTileElems + (8 * half + j) * 32,
                               _mm512_permutex2var_epi16(lo[p], high_halves, hi[p]));
        }
      }
    }
}

// Where a weight tile's k blocks come from. The first pass over a chunk's slice (its first token
// tiles) reads full tiles straight from the weight rows, `stride` bytes apart, and, when later
// passes will need them, stores each tile into the packed panel as it goes; later passes, tiles
// with fewer than 16 rows and the block holding k's end read the panel, zero padded. So the
// weights are read from memory once, overlapped with the tile products, and every later read is
// a 1 KB piece of the panel in L2 (a tile from rows a multiple of 4 KB apart would put all 16
// lines in one L1 set).
struct WeightTile {
  const uint8_t* rows;  // k block 0 of the first row; null: every block from the panel
  size_t stride;
  int64_t direct;       // blocks read from `rows`; the rest from the panel
  uint16_t* panel;      // the tile's k block 0 in the packed panel
  bool keep;            // store the blocks read from `rows` into the panel

  const void* at(int64_t kb, size_t& row_bytes) const {
    if (kb < direct) {
      row_bytes = stride;
      return rows + kb * kKBlock * 2;
    }
    row_bytes = 64;
    return panel + kb * kTileElems;
  }
};

// One k block: the weight tiles, then per part of the activations its tiles and 4 products.
template <int P, int RT, int TT>
inline void tile_step(const WeightTile& w0, const WeightTile& w1, int64_t kb, const uint16_t* x0, const uint16_t* x1) {
  size_t s0, s1;
  _tile_loadd(4, w0.at(kb, s0), s0);
  if (w0.keep && kb < w0.direct) _tile_stored(4, w0.panel + kb * kTileElems, 64);
  if constexpr (RT == 2) {
    _tile_loadd(5, w1.at(kb, s1), s1);
    if (w1.keep && kb < w1.direct) _tile_stored(5, w1.panel + kb * kTileElems, 64);
  }
  for (int p = 0; p < P; ++p) {
    _tile_loadd(6, x0 + p * kTileElems, 64);
    if constexpr (TT == 2) _tile_loadd(7, x1 + p * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT == 2 && TT == 2) _tile_dpbf16ps(3, 5, 7);
  }
}

// Where a block of C tiles starts from and goes: tile (i, j) at base + i * row_stride + j * 256
// floats; a null `in` starts from zero.
struct CTiles {
  const float* in;
  int64_t in_stride;
  float* out;
  int64_t out_stride;
};

// C[i][j] += RT weight tiles times TT token tiles over nkb k blocks.
template <int P, int RT, int TT>
void tile_block(const WeightTile& w0, const WeightTile& w1, const uint16_t* x0, const uint16_t* x1, int64_t nkb,
                const CTiles& c) {
  if (c.in) {
    _tile_loadd(0, c.in, 64);
    if constexpr (TT == 2) _tile_loadd(1, c.in + 256, 64);
    if constexpr (RT == 2) _tile_loadd(2, c.in + c.in_stride, 64);
    if constexpr (RT == 2 && TT == 2) _tile_loadd(3, c.in + c.in_stride + 256, 64);
  } else {
    _tile_zero(0);
    if constexpr (TT == 2) _tile_zero(1);
    if constexpr (RT == 2) _tile_zero(2);
    if constexpr (RT == 2 && TT == 2) _tile_zero(3);
  }
  for (int64_t kb = 0; kb < nkb; ++kb) tile_step<P, RT, TT>(w0, w1, kb, x0 + kb * kXStep<P>, x1 + kb * kXStep<P>);
  _tile_stored(0, c.out, 64);
  if constexpr (TT == 2) _tile_stored(1, c.out + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c.out + c.out_stride, 64);
  if constexpr (RT == 2 && TT == 2) _tile_stored(3, c.out + c.out_stride + 256, 64);
}

// A C tile (16 weight rows x 16 tokens, f32) into y[token][row] for the valid rows and tokens,
// clamped to [a.y_lo, a.y_hi] as pack_x clamps x.
void store_transposed(const MatArgs& a, const float* c, float* y, int64_t rows, int64_t tokens) {
  __m512i v[kTile];
  for (int i = 0; i < kTile; ++i) v[i] = _mm512_load_si512(c + 16 * i);
  transpose16(v);
  const __mmask16 mask = low_bits16(rows);
  const __m512 lo = _mm512_set1_ps(a.y_lo), hi = _mm512_set1_ps(a.y_hi);
  for (int64_t t = 0; t < tokens; ++t)
    _mm512_mask_storeu_ps(y + t * a.ldy, mask, _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_castsi512_ps(v[t]))));
}

// How a task walks its weights: chunks of `rows` rows, each in slices of `kbs` k blocks. A packed
// slice (the panel, about kPanelBytes) stays in L2 while every token tile runs against it; partial
// sums of C wait in scratch between slices. Each chunk streams every token's packed activations
// for the slice once (2 bytes per token and k a part), so chunks are as tall
// as the panel allows; slices keep the panel within L2 for long rows.
constexpr int64_t kPanelBytes = int64_t(768) << 10;
constexpr int64_t kMaxSliceBlocks = 48;  // 1536 k
constexpr int64_t kMaxChunkRows = 512;

struct Walk {
  int64_t nkb, slices, kbs, rows;
};
Walk walk(int64_t k) {
  Walk w;
  w.nkb = k_blocks(k);
  w.slices = (w.nkb + kMaxSliceBlocks - 1) / kMaxSliceBlocks;
  w.kbs = (w.nkb + w.slices - 1) / w.slices;
  const int64_t rows = kPanelBytes / (w.kbs * kKBlock * 2) / 32 * 32;
  w.rows = rows < 32 ? 32 : rows > kMaxChunkRows ? kMaxChunkRows : rows;
  return w;
}

// Rows [r, r + rows) and k blocks [kb0, kb1) of the weights into one row tile of the panel
// (block kb at dst + (kb - kb0) * 512), zero past the valid rows and past k.
void pack_tile(const MatArgs& a, int64_t r, int64_t rows, int64_t kb0, int64_t kb1, uint16_t* dst) {
  const uint8_t* wb = static_cast<const uint8_t*>(a.w);
  for (int i = 0; i < kTile; ++i) {
    const uint8_t* src = wb + size_t(i < rows ? r + i : r) * a.w_stride;
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const __mmask32 mask = i < rows ? low_bits32(a.k - kb * kKBlock) : __mmask32(0);
      _mm512_store_si512(dst + (kb - kb0) * kTileElems + i * kKBlock,
                         _mm512_maskz_loadu_epi16(mask, src + kb * kKBlock * 2));
    }
  }
}

size_t k_scratch_bytes(int64_t n, int64_t k) {
  const Walk w = walk(k);
  const size_t ntt = size_t((n + kTile - 1) / kTile), nrt = size_t(w.rows / kTile);
  // The panel, partial sums when there are several slices, one block of C tiles.
  return nrt * size_t(w.kbs) * kTileElems * 2 + (w.slices > 1 ? nrt * ntt * 256 * 4 : 0) + 4 * 256 * 4;
}

template <int P> void k_gemm(const MatArgs& a, const uint16_t* xp, int64_t r0, int64_t r1, void* scratch) {
  load_tile_config();
  const Walk wk = walk(a.k);
  const int64_t ntt = (a.n + kTile - 1) / kTile, nfull = a.k / kKBlock;
  uint16_t* panel = static_cast<uint16_t*>(scratch);
  float* c = reinterpret_cast<float*>(panel + (wk.rows / kTile) * wk.kbs * kTileElems);
  float* partial = c + 4 * 256;
  const uint8_t* wb = static_cast<const uint8_t*>(a.w);
  for (int64_t c0 = r0; c0 < r1; c0 += wk.rows) {
    const int64_t c1 = min64(r1, c0 + wk.rows), nrt = (c1 - c0 + kTile - 1) / kTile;
    for (int64_t s = 0; s < wk.slices; ++s) {
      const int64_t kb0 = s * wk.kbs, kb1 = min64(wk.nkb, kb0 + wk.kbs), nkb = kb1 - kb0;
      const int64_t direct = min64(kb1, nfull) - kb0;  // full blocks, readable in place
      const bool first_slice = s == 0, last_slice = s + 1 == wk.slices;
      // Tiles that cannot be read in place go into the panel first.
      for (int64_t i = 0; i < nrt; ++i) {
        uint16_t* tile = panel + i * nkb * kTileElems;
        const int64_t r = c0 + i * kTile, rows = min64(kTile, c1 - r);
        if (rows < kTile) pack_tile(a, r, rows, kb0, kb1, tile);
        else if (direct < nkb) pack_tile(a, r, rows, kb0 + direct, kb1, tile + direct * kTileElems);
      }
      for (int64_t tt = 0; tt < ntt; tt += 2) {
        const bool two_tokens = tt + 1 < ntt, first_pass = tt == 0;
        const uint16_t* x0 = xp + (tt * wk.nkb + kb0) * kXStep<P>;
        const uint16_t* x1 = two_tokens ? x0 + wk.nkb * kXStep<P> : x0;
        for (int64_t i = 0; i < nrt; i += 2) {
          const bool two_rows = i + 1 < nrt;
          WeightTile w[2];
          for (int64_t j = 0; j < (two_rows ? 2 : 1); ++j) {
            const int64_t r = c0 + (i + j) * kTile;
            const bool in_place = first_pass && c1 - r >= kTile;
            w[j] = {in_place ? wb + size_t(r) * a.w_stride + size_t(kb0) * kKBlock * 2 : nullptr, a.w_stride,
                    in_place ? direct : 0, panel + (i + j) * nkb * kTileElems, ntt > 2};
          }
          float* sums = partial + (i * ntt + tt) * 256;
          const CTiles ct{first_slice ? nullptr : sums, ntt * 256, last_slice ? c : sums,
                          last_slice ? 512 : ntt * 256};
          if (two_rows && two_tokens) tile_block<P, 2, 2>(w[0], w[1], x0, x1, nkb, ct);
          else if (two_rows) tile_block<P, 2, 1>(w[0], w[1], x0, x1, nkb, ct);
          else if (two_tokens) tile_block<P, 1, 2>(w[0], w[0], x0, x1, nkb, ct);
          else tile_block<P, 1, 1>(w[0], w[0], x0, x1, nkb, ct);
          if (!last_slice) continue;
          for (int64_t ri = 0; ri < (two_rows ? 2 : 1); ++ri)
            for (int64_t ti = 0; ti < (two_tokens ? 2 : 1); ++ti) {
              const int64_t t0 = (tt + ti) * kTile, r = c0 + (i + ri) * kTile;
              store_transposed(a, c + (2 * ri + ti) * 256, a.y + t0 * a.ldy + r, min64(kTile, c1 - r),
                               min64(kTile, a.n - t0));
            }
        }
        // The token pair's outputs of the chunk are done and still in cache: the epilogue runs on
        // them a token at a time (runs of up to 512 outputs, not a call per 16).
        if (last_slice && a.epilogue)
          for (int64_t t = tt * kTile, t1 = min64(a.n, (tt + 2) * kTile); t < t1; ++t)
            a.epilogue(a.y + t * a.ldy + c0, a.times ? a.times + t * a.ldy + c0 : nullptr, c1 - c0);
      }
    }
  }
  _tile_release();
}

int64_t k_task_rows(int64_t k) { return walk(k).rows; }

// ---------------------------------------------------------------- whole attention, rounded
// bf16_gemm.h's RoundedAttentionKernels. Here the queries are the A operand (row-major bf16, as
// A tiles read them), so score tiles land in S as [query][key] rows with no transpose, and the
// probabilities, rounded to bf16 in place over their scores' rows, are the A operand of P·V as
// they lie. A KV head's keys are packed once as B tiles of 16 keys (k = head dims), its values as
// B tiles of 16 head dims (k = keys). Head dims pad to 32 and keys to 32 with zeros.

constexpr int64_t kAttnQueries = 32;  // queries a block call takes: two A tiles

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline __mmask16 lanes16(int64_t n) { return n <= 0 ? __mmask16(0) : low_bits16(n); }

// 32 floats from p (fewer, zeros after, where `valid` < 32) as bf16 (nearest even) in order.
inline __m512i bf16x32(const float* p, int64_t valid) {
  const __m512 lo = _mm512_maskz_loadu_ps(lanes16(valid), p);
  const __m512 hi = _mm512_maskz_loadu_ps(lanes16(valid - 16), p + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

size_t k_attn_kv_bytes(int64_t keys, int64_t hd) { return size_t(2 * round_up(keys, 32) * round_up(hd, 32)) * 2; }

size_t k_attn_scratch_bytes(int64_t keys, int64_t hd) {
  return size_t(kAttnQueries * round_up(keys, 32)) * 4 + size_t(kAttnQueries * round_up(hd, 32)) * 2 + 4 * 256 * 4;
}

// Keys [32 b0, 32 b1) of one KV head (rows `ld` floats apart, `keys` of them) into kv: key tile t,
// dim block kb at kv + (t * nkb + kb) * 512, row p = dims (2p, 2p + 1) of its 16 keys; value dim
// tile dt, key block b at vp + (dt * nvb + b) * 512, row p = keys (2p, 2p + 1) of its 16 dims.
void k_attn_pack_kv(const float* k, const float* v, int64_t ld, int64_t keys, int64_t hd, int64_t b0, int64_t b1,
                    uint16_t* kv) {
  const int64_t hd32 = round_up(hd, 32), nkb = hd32 / kKBlock, keys32 = round_up(keys, 32), nvb = keys32 / 32;
  uint16_t* vp = kv + keys32 * hd32;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t t = 2 * b; t < 2 * b + 2; ++t)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        __m512i r[kTile];
        for (int i = 0; i < kTile; ++i) {
          const int64_t key = t * kTile + i;
          r[i] = key < keys ? bf16x32(k + key * ld + kb * kKBlock, hd - kb * kKBlock) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int p = 0; p < kTile; ++p) _mm512_store_si512(kv + (t * nkb + kb) * kTileElems + p * 32, r[p]);
      }
    for (int64_t dt = 0; dt < hd32 / kTile; ++dt) {
      const __mmask16 dims = lanes16(hd - dt * kTile);
      for (int p = 0; p < kTile; ++p) {
        const int64_t key = 32 * b + 2 * p;
        const __m512 v0 = key < keys ? _mm512_maskz_loadu_ps(dims, v + key * ld + dt * kTile) : _mm512_setzero_ps();
        const __m512 v1 =
            key + 1 < keys ? _mm512_maskz_loadu_ps(dims, v + (key + 1) * ld + dt * kTile) : _mm512_setzero_ps();
        const __m512i e0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v0));
        const __m512i e1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v1));
        _mm512_store_si512(vp + (dt * nvb + b) * kTileElems + p * 32, _mm512_or_si512(e0, _mm512_slli_epi32(e1, 16)));
      }
    }
  }
}

// 2^t for t <= ~0 (scores less their row's maximum): t = n + f, |f| <= 1/2, a degree-5 fit of 2^f
// (relative error 1.5e-7), scaled by 2^n; below -150 it is 0. Not the table's exp: the result
// is rounded to bf16 (2^-9) next, and this is the softmax's dominant cost.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3266970636e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754599362e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507425219e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192f));
  return _mm512_scalef_ps(p, n);
}

// Row i of S (keys32 floats) becomes its probabilities' numerators e = exp(scale (s - max)) as
// bf16, written over the row's first half (each store lands on scores already read), zeros past
// `keys`; returns 1 / Σ e over the f32 e.
float softmax_row_to_bf16(float* row, int64_t keys, int64_t keys32, float scale) {
  const int64_t full = keys / kTile * kTile;
  // Four chains of maxima (one would serialise the pass on vmaxps' latency: 12% of the kernel's
  // time with a single chain); the maximum is the same whatever the order.
  __m512 mx = _mm512_set1_ps(-__builtin_inff()), mx1 = mx, mx2 = mx, mx3 = mx;
  int64_t i = 0;
  for (; i + 4 * kTile <= full; i += 4 * kTile) {
    mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + i));
    mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(row + i + kTile));
    mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(row + i + 2 * kTile));
    mx3 = _mm512_max_ps(mx3, _mm512_loadu_ps(row + i + 3 * kTile));
  }
  mx = _mm512_max_ps(_mm512_max_ps(mx, mx1), _mm512_max_ps(mx2, mx3));
  for (; i < full; i += kTile) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + i));
  if (full < keys) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lanes16(keys - full), row + full));
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c), off = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c);
  // Two chains of 16 a step: one sum would serialise the loop on its adds.
  __m512 sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  uint16_t* p = reinterpret_cast<uint16_t*>(row);
  int64_t j = 0;
  for (; j + 2 * kTile <= full; j += 2 * kTile) {
    const __m512 e0 = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vc, off));
    const __m512 e1 = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + j + kTile), vc, off));
    sum = _mm512_add_ps(sum, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  sum = _mm512_add_ps(sum, sum1);
  for (; j < full; j += kTile) {
    const __m512 e = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vc, off));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (; j < keys32; j += kTile) {
    const __mmask16 m = lanes16(keys - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp2_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, row + j), vc, off)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// C tiles 0..3 = (a0, b0), (a0, b1), (a1, b0), (a1, b1) summed over nk steps from zero: A tiles
// at a + step * a_step (rows a_stride bytes apart), B tiles at b + step * b_step (packed, 64).
inline void tiles_2x2(const uint16_t* a0, const uint16_t* a1, size_t a_stride, int64_t a_step, const uint16_t* b0,
                      const uint16_t* b1, int64_t b_step, int64_t nk) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < nk; ++i) {
    _tile_loadd(4, a0 + i * a_step, a_stride);
    _tile_loadd(5, a1 + i * a_step, a_stride);
    _tile_loadd(6, b0 + i * b_step, 64);
    _tile_loadd(7, b1 + i * b_step, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

void k_attn_block(const float* q, int64_t ldq, int64_t n, int64_t keys, int64_t hd, float scale, const uint16_t* kv,
                  float* out, int64_t ldo, void* scratch) {
  const int64_t hd32 = round_up(hd, 32), nkb = hd32 / kKBlock, keys32 = round_up(keys, 32);
  const int64_t nkt = keys32 / kTile, nvb = keys32 / 32, ndt = hd32 / kTile;
  const uint16_t *kp = kv, *vp = kv + keys32 * hd32;
  float* s = static_cast<float*>(scratch);  // [32][keys32]: scores, then bf16 numerators over them
  uint16_t* qp = reinterpret_cast<uint16_t*>(s + kAttnQueries * keys32);  // [32][hd32]
  float* c = reinterpret_cast<float*>(qp + kAttnQueries * hd32);          // four C tiles
  for (int64_t i = 0; i < kAttnQueries; ++i)
    for (int64_t kb = 0; kb < nkb; ++kb)
      _mm512_store_si512(qp + i * hd32 + kb * kKBlock,
                         i < n ? bf16x32(q + i * ldq + kb * kKBlock, hd - kb * kKBlock) : _mm512_setzero_si512());
  load_tile_config();
  // S = Q·Kᵀ: C tiles (query tile, key tile) 0 (0, t), 1 (0, t + 1), 2 (1, t), 3 (1, t + 1).
  const size_t s_bytes = size_t(keys32) * 4, q_bytes = size_t(hd32) * 2;
  for (int64_t t = 0; t < nkt; t += 2) {
    tiles_2x2(qp, qp + kTile * hd32, q_bytes, kKBlock, kp + t * nkb * kTileElems, kp + (t + 1) * nkb * kTileElems,
              kTileElems, nkb);
    _tile_stored(0, s + t * kTile, s_bytes);
    _tile_stored(1, s + (t + 1) * kTile, s_bytes);
    _tile_stored(2, s + kTile * keys32 + t * kTile, s_bytes);
    _tile_stored(3, s + kTile * keys32 + (t + 1) * kTile, s_bytes);
  }
  // Rows past n hold zero scores from zero queries: their bf16 view is zeros, and their outputs
  // are not stored.
  float inv[kAttnQueries];
  for (int64_t i = 0; i < n; ++i) inv[i] = softmax_row_to_bf16(s + i * keys32, keys, keys32, scale);
  // O = P·V: C tiles (query tile, dim tile) 0 (0, d), 1 (0, d + 1), 2 (1, d), 3 (1, d + 1).
  const uint16_t* p = reinterpret_cast<const uint16_t*>(s);
  for (int64_t d = 0; d < ndt; d += 2) {
    tiles_2x2(p, p + 2 * kTile * keys32, s_bytes, 32, vp + d * nvb * kTileElems, vp + (d + 1) * nvb * kTileElems,
              kTileElems, nvb);
    _tile_stored(0, c, 64);  // tile numbers are immediates
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t u = 0; u < 2; ++u) {
        const int64_t d0 = (d + u) * kTile;
        const __m512 o = _mm512_mul_ps(_mm512_load_ps(c + ((i / kTile) * 2 + u) * 256 + (i % kTile) * kTile),
                                       _mm512_set1_ps(inv[i]));
        _mm512_mask_storeu_ps(out + i * ldo + d0, lanes16(hd - d0), o);
      }
  }
  _tile_release();
}

const RoundedAttentionKernels kRoundedAttention = {kAttnQueries, k_attn_kv_bytes, k_attn_pack_kv,
                                                   k_attn_scratch_bytes, k_attn_block};

const Bf16GemmKernels kExact = {kTile,           2 * kTile,   k_task_rows, k_xp_bytes<3>,
                                k_scratch_bytes, k_pack_x<3>, k_gemm<3>,  true};
const Bf16GemmKernels kRounded = {kTile,           2 * kTile,   k_task_rows, k_xp_bytes<1>,
                                  k_scratch_bytes, k_pack_x<1>, k_gemm<1>,  true};

}  // namespace

const Bf16GemmKernels* amx_bf16_kernels() { return &kExact; }
const Bf16GemmKernels* amx_bf16_rounded_kernels() { return &kRounded; }
const RoundedAttentionKernels* amx_rounded_attention_kernels() { return &kRoundedAttention; }

}  // namespace mb::cpu

#else

namespace mb::cpu {
const Bf16GemmKernels* amx_bf16_kernels() { return nullptr; }
const Bf16GemmKernels* amx_bf16_rounded_kernels() { return nullptr; }
const RoundedAttentionKernels* amx_rounded_attention_kernels() { return nullptr; }
}  // namespace mb::cpu

#endif
