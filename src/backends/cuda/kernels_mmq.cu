// Products of block-quantized weights (Q8_0, Q4_0) with more activation rows than a GEMV serves -
// batched decode, MoE experts - on the tensor cores: int8 mma.sync straight from the weights as
// they are stored, the activations quantized to int8 blocks of 32 as the GEMV takes them, each
// block's exact int32 sum scaled by its two block scales.
//
// Hand-written because no library does it: cuBLAS(Lt) has no block-quantized types, so its path
// needs a bf16 copy of every weight and streams 3.5x (Q4_0) the bytes per step; and MoE experts
// need a grouped product whose groups (tokens per expert) exist only on the device.
//
// Shapes. The activations are tiled for the mma's B operand (tile_x): rows in groups of 8, and per
// (group, block of 32) 256 bytes in fragment order - lane l holds row l/4's elements 4(l%4)..+3 in
// its first word and 16+4(l%4)..+3 in its second - so that a chunk of blocks is one contiguous
// run per group to stage in shared memory and a fragment one 8-byte load from there; the block
// scales d as [group][block][8 rows]. A CUDA block computes 64
// weight rows (16 a warp: one m16n8k32 A fragment) against NJ groups of 8 activation rows.
#include <algorithm>
#include <type_traits>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_kernels.h"

namespace mb::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kTileXThreads = 256;  // k_tile_x: a warp a block of 32, so 8 blocks of a row a CUDA block
constexpr int kTileRows = 16 * kWarps;  // weight rows a block computes
constexpr int kMaxGroups = 8;           // activation groups of 8 a block computes (NJ)
// Blocks of 32 whose weights a warp loads before its products (8 for one or two groups was
// slower: E4B Q4_0 at 8 streams 811 against 970 tok/s), and blocks of 32 of activations per
// shared-memory stage: two such batches.
constexpr int kUnroll = 4;
constexpr int kChunk = 2 * kUnroll;

// x row src[r] / div (src null: r when r < n) quantized by quantize_lane, into row r of the
// tiled layout; rows without a source are zeros (their products are 0 and never written out).
__global__ void k_tile_x(const float* x, int64_t k, int64_t n, const int32_t* src, int div, int8_t* q, float* d) {
  pdl_begin();
  const int64_t nkb = k / 32, r = blockIdx.x, g = r / 8;
  const int t = int(r % 8), lane = threadIdx.x % 32;
  int64_t sr = r < n ? r : -1;
  if (src) sr = src[r] < 0 ? -1 : src[r] / div;
  const int slot = t * 4 + (lane % 16) / 4, word = lane / 16;
  // A warp a block of 32 (grid y: the row's blocks in runs of a CUDA block's warps): a warp that
  // looped over a row's blocks waited a memory round trip per block (an E4B row: 10-40 in turn).
  const int64_t kb = int64_t(blockIdx.y) * (blockDim.x / 32) + threadIdx.x / 32;
  if (kb >= nkb) return;
  const float v = sr >= 0 ? x[sr * k + kb * 32 + lane] : 0.f;
  float dd;
  q[((g * nkb + kb) * 32 + slot) * 8 + word * 4 + lane % 4] = int8_t(quantize_lane(v, dd));
  if (lane == 0) d[(g * nkb + kb) * 8 + t] = dd;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], int2 b) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// An int32 of magnitude below 2^22 as f32, exactly, in two full-rate operations (its bits added to
// those of 1.5 * 2^23, which is then subtracted): the conversion instruction runs at 16 a clock an SM,
// an eighth of the FP32 rate, and bounded the products' epilogue (4 conversions an mma).
__device__ __forceinline__ float small_int_f32(int v) { return __int_as_float(v + 0x4B400000) - 12582912.f; }

// A word of Q4_0 nibbles (byte j: element j low, j + 16 high, each value v in -8..7 stored as v + 8)
// as two words of int8 mma operands, each byte 16 v: the nibble's top bit flipped is the signed 4-bit
// v, and in a byte's high half that is 16 v - a mask and an xor a word, where a bytewise saturating
// subtract (__vsubss4) is emulated in several. The products come out 16 times too large (at most
// 2^19, within small_int_f32's range) and the weight scales carry the 1/16 (exact in f32).
__device__ __forceinline__ void nibbles_x16(uint32_t v, uint32_t& lo, uint32_t& hi) {
  lo = ((v << 4) & 0xF0F0F0F0u) ^ 0x80808080u;
  hi = (v & 0xF0F0F0F0u) ^ 0x80808080u;
}
template <WType T>
constexpr float kNibbleScale = T == WType::Q4_0 ? 1.f / 16 : 1.f;

// The A fragment of block kb of weight rows ra (fragment rows 0-7) and rb = ra + 8, with their
// scales: a[0]/a[2] elements 4c..4c+3 and 16+4c..+3 of ra (c = lane % 4), a[1]/a[3] those of rb.
template <WType T>
struct Frag {
  uint32_t a[4];
  float sa, sb;
};
template <WType T>
__device__ __forceinline__ Frag<T> load_a(const GpuWeight& w, int64_t ra, int64_t rb, int64_t nb, int64_t kb,
                                          int c) {
  Frag<T> f;
  if constexpr (T == WType::Q4_0) {
    // Byte j of a block holds element j (low nibble) and j + 16 (high): one word gives both halves.
    const uint8_t* qs = static_cast<const uint8_t*>(w.qs);
    const uint32_t va = *reinterpret_cast<const uint32_t*>(qs + (ra * nb + kb) * 16 + 4 * c);
    const uint32_t vb = *reinterpret_cast<const uint32_t*>(qs + (rb * nb + kb) * 16 + 4 * c);
    nibbles_x16(va, f.a[0], f.a[2]);
    nibbles_x16(vb, f.a[1], f.a[3]);
  } else {
    const int8_t* qs = static_cast<const int8_t*>(w.qs);
    const int8_t* pa = qs + (ra * nb + kb) * 32 + 4 * c;
    const int8_t* pb = qs + (rb * nb + kb) * 32 + 4 * c;
    f.a[0] = *reinterpret_cast<const uint32_t*>(pa);
    f.a[2] = *reinterpret_cast<const uint32_t*>(pa + 16);
    f.a[1] = *reinterpret_cast<const uint32_t*>(pb);
    f.a[3] = *reinterpret_cast<const uint32_t*>(pb + 16);
  }
  f.sa = half_f32(w.scale[ra * nb + kb]) * kNibbleScale<T>;
  f.sb = half_f32(w.scale[rb * nb + kb]) * kNibbleScale<T>;
  return f;
}

struct Args {
  GpuWeight w[3];
  int nw = 1;
  int64_t rows = 0;  // dense: the weights' rows end to end; experts: rows of one expert
  const int2* xq = nullptr;
  const float* xd = nullptr;
  const uint16_t* xb = nullptr;  // k_mmq_bf16: the activations as bf16 rows [n, nkb * 32]
  int64_t nkb = 0;
  int64_t n = 0, groups = 0;                 // dense: activation rows, their groups of 8
  const int4* tiles = nullptr;               // experts: (expert, first tiled row, rows) per tile
  const int32_t* n_tiles = nullptr;
  const int32_t* row_out = nullptr;          // experts: tiled row -> output row (-1: padding)
  int64_t kb_per_split = 0;
  float* part = nullptr;  // [splits][n][rows] partial sums (null: write y)
  float* y[3] = {nullptr, nullptr, nullptr};
  // Epilogues without partial sums (one K split, fragment-ordered weights): glu - y[0] =
  // gelu_tanh(gate) * up, a block's warps 0-1 on 32 gate rows and 2-3 on the same up rows; m -
  // y[0] = gelu_tanh(sum) * m. Each the reduce kernel's arithmetic on its one split.
  bool glu = false;
  const float* m = nullptr;
};

__device__ __forceinline__ const GpuWeight& pick_w(const Args& a, int i) {
  return i == 0 ? a.w[0] : i == 1 ? a.w[1] : a.w[2];
}
__device__ __forceinline__ float* pick_y(const Args& a, int i) { return i == 0 ? a.y[0] : i == 1 ? a.y[1] : a.y[2]; }

// A block's sums out: fragment element e of group j is weight row (e < 2 ? ra : rb), activation
// row 8 (g0 + j) + 2c + e % 2; into the experts' rows, the split's partial sums, or y.
template <int NJ>
__device__ __forceinline__ void store_tile(const Args& a, const float (&acc)[NJ][4], int64_t tile_row, int wi,
                                           int64_t g0, int ng, int warp, int lane) {
  const int gr = lane / 4, c = lane % 4;
  const GpuWeight& w = pick_w(a, wi);
  int64_t ra = tile_row + warp * 16 + gr;  // in weight wi's rows
  for (int i = 0; i < wi; ++i) ra -= pick_w(a, i).rows;
  const int64_t lr = tile_row + warp * 16 + gr;  // ra's row in the rows' space
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (j >= ng) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t tr = (g0 + j) * 8 + 2 * c + e % 2;  // tiled activation row
      const int64_t dr = e < 2 ? 0 : 8;
      if (a.tiles) {
        const int32_t o = a.row_out[tr];
        if (o >= 0) a.y[0][int64_t(o) * a.rows + lr + dr] = acc[j][e];
      } else if (tr < a.n) {
        if (a.part)
          a.part[(int64_t(blockIdx.z) * a.n + tr) * a.rows + lr + dr] = acc[j][e];
        else if (a.m)
          a.y[0][tr * w.rows + ra + dr] = gelu_tanh(acc[j][e]) * a.m[tr * w.rows + ra + dr];
        else
          pick_y(a, wi)[tr * w.rows + ra + dr] = acc[j][e];
      }
    }
  }
}

// A fused GLU block's sums out (Args::glu): warps 2-3 leave their up sums in shared memory (the
// staging buffers, free after the last chunk), warps 0-1 write gelu_tanh(gate) * up.
template <int NJ>
__device__ __forceinline__ void store_glu(const Args& a, const float (&acc)[NJ][4], float* up, int64_t g0, int ng,
                                          int warp, int lane) {
  if (warp >= 2) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) up[(((warp - 2) * NJ + j) * 4 + e) * 32 + lane] = acc[j][e];
  }
  __syncthreads();
  if (warp >= 2) return;
  const int64_t rows = a.tiles ? a.rows / 2 : a.w[0].rows, r0 = int64_t(blockIdx.x) * 32 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (j >= ng) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t tr = (g0 + j) * 8 + 2 * (lane % 4) + e % 2;
      const int64_t o = a.tiles ? a.row_out[tr] : tr < a.n ? tr : -1;
      if (o >= 0)
        a.y[0][o * rows + r0 + (e < 2 ? 0 : 8)] = gelu_tanh(acc[j][e]) * up[((warp * NJ + j) * 4 + e) * 32 + lane];
    }
  }
}

// The activations of blocks [kb, min(kb + CH, kb1)) of groups g0 .. g0 + ng - 1 into one buffer of
// a chunk of CH blocks: per group kc * 256 bytes of quants and kc * 32 of scales, each a contiguous
// run in the tiled layout. A group at a time: a flat loop over every group's 16-byte pieces paid two
// divisions by a run-time length a piece, more instructions than the chunk's products.
template <int CH>
__device__ __forceinline__ void stage_x(const Args& a, int2* sq, float* sd, int64_t g0, int ng, int64_t kb,
                                        int64_t kb1) {
  const int kc = int(kb1 - kb < CH ? kb1 - kb : CH);
  const char* q = reinterpret_cast<const char*>(a.xq) + (g0 * a.nkb + kb) * 256;
  const char* d = reinterpret_cast<const char*>(a.xd) + (g0 * a.nkb + kb) * 32;
  for (int j = 0; j < ng; ++j, q += a.nkb * 256, d += a.nkb * 32) {
    for (int r = threadIdx.x; r < kc * 16; r += blockDim.x)
      cp_async16(reinterpret_cast<char*>(&sq[j * CH * 32]) + r * 16, q + r * 16);
    if (int(threadIdx.x) < kc * 2)
      cp_async16(reinterpret_cast<char*>(&sd[j * CH * 8]) + threadIdx.x * 16, d + threadIdx.x * 16);
  }
  cp_async_commit();
}

// Block blk of the staged chunk, every group's, against one A fragment (rows ra, rb with scales
// sa, sb): each block's exact int32 sums scaled by the weight's and the activation's block scales.
// Every one of the NJ groups, staged or not (a group past the tile's holds stale bytes whose sums
// are never stored): a branch between groups made each group's loads, mma and scaling wait on the
// group before it.
template <int NJ, int CH>
__device__ __forceinline__ void mma_groups(float (&acc)[NJ][4], const uint32_t (&af)[4], float sa, float sb,
                                           const int2* sq, const float* sd, int blk, int lane) {
  int2 b[NJ];
  float2 s[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int at = j * CH + blk;
    b[j] = sq[at * 32 + lane];
    s[j] = *reinterpret_cast<const float2*>(&sd[at * 8 + 2 * (lane % 4)]);
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    int p[4] = {0, 0, 0, 0};
    mma_s8(p, af, b[j]);
    acc[j][0] += small_int_f32(p[0]) * (sa * s[j].x);
    acc[j][1] += small_int_f32(p[1]) * (sa * s[j].y);
    acc[j][2] += small_int_f32(p[2]) * (sb * s[j].x);
    acc[j][3] += small_int_f32(p[3]) * (sb * s[j].y);
  }
}

// A dense product's row tile: the weight it lies in (weights' rows are whole tiles) and, in
// wrow, its first row there.
__device__ __forceinline__ int weight_of_rows(const Args& a, int64_t& wrow) {
  int wi = 0;
  if (!a.tiles)
    while (wi + 1 < a.nw && wrow >= pick_w(a, wi).rows) wrow -= pick_w(a, wi++).rows;
  return wi;
}

// The weight wi a warp's rows lie in and, in wrow, the block's first row there (warp w's 16 rows
// from wrow + 16 w). glu: warps 0-1 on 32 rows of gate, 2-3 on the same rows of up (experts: an
// expert's two halves of one weight).
__device__ __forceinline__ int warp_weight(const Args& a, int warp, int64_t& wrow) {
  wrow = int64_t(blockIdx.x) * kTileRows;
  if (!a.glu) return weight_of_rows(a, wrow);
  wrow = int64_t(blockIdx.x) * 32 + (warp / 2) * ((a.tiles ? a.rows / 2 : 0) - 32);
  return a.tiles ? 0 : warp / 2;
}
// A warp's share of a fragment-ordered product: its weight and first row (warp_weight), and the
// blocks of 32 of its block's K split [kb0, kb1) with their pairs' end kp1 (nkp pairs a row).
struct WarpSpan {
  int wi;
  int64_t wrow, nkp, kb0, kb1, kp1;
};
__device__ __forceinline__ WarpSpan warp_span(const Args& a, int warp) {
  WarpSpan sp;
  sp.wi = warp_weight(a, warp, sp.wrow);
  const int64_t nb = pick_w(a, sp.wi).cols / 32;
  sp.nkp = (nb + 1) / 2;
  sp.kb0 = int64_t(blockIdx.z) * a.kb_per_split;
  sp.kb1 = min(nb, sp.kb0 + a.kb_per_split);
  sp.kp1 = (sp.kb1 + 1) / 2;
  return sp;
}

// A dense product's block: the first of its groups of 8 activation rows (those of blockIdx.y) and how many
// there are.
template <int NJ>
__device__ __forceinline__ void dense_groups(const Args& a, int64_t& g0, int& ng) {
  g0 = int64_t(blockIdx.y) * NJ;
  ng = int(a.groups - g0 < NJ ? a.groups - g0 : NJ);
}
// The activation groups of the block (read after the wait: experts' tiles are made on the device):
// experts - its tile's (expert, first row, rows), which also moves wrow into the expert's rows
// (false: no tile for this block); dense - dense_groups.
template <int NJ>
__device__ __forceinline__ bool block_groups(const Args& a, int64_t& wrow, int64_t& g0, int& ng) {
  if (a.tiles) {
    if (int(blockIdx.y) >= *a.n_tiles) return false;
    const int4 t = a.tiles[blockIdx.y];
    wrow += int64_t(t.x) * a.rows;
    g0 = t.y / 8;
    ng = (t.z + 7) / 8;
  } else {
    dense_groups<NJ>(a, g0, ng);
  }
  return true;
}

template <int NJ>
__device__ __forceinline__ void zero_acc(float (&acc)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// grid: (rows / 64, token tiles (dense) or the most tiles the experts can have, K splits). The
// activations of a chunk of blocks are copied to shared memory (cp.async, the next chunk's
// while this one's products run): read from global memory, each block's B fragments were a
// memory round trip per block of 32 that nothing else covered.
template <WType T, int NJ>
__global__ void __launch_bounds__(kWarps * 32) k_mmq(Args a) {
  __shared__ __align__(16) int2 sq[2][NJ * kChunk * 32];
  __shared__ __align__(16) float sd[2][NJ * kChunk * 8];
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gr = lane / 4, c = lane % 4;
  const int64_t tile_row = int64_t(blockIdx.x) * kTileRows;  // in the rows' space
  int64_t wrow = tile_row;  // the tile's first row in weight wi
  const int wi = weight_of_rows(a, wrow);
  int64_t g0;
  int ng;
  if (!block_groups<NJ>(a, wrow, g0, ng)) return;
  const GpuWeight& w = pick_w(a, wi);
  const int64_t nb = w.cols / 32;
  const int64_t ra = wrow + warp * 16 + gr, rb = ra + 8;
  const int64_t kb0 = int64_t(blockIdx.z) * a.kb_per_split, kb1 = min(nb, kb0 + a.kb_per_split);
  float acc[NJ][4];
  zero_acc<NJ>(acc);
  auto stage = [&](int buf, int64_t kb) { stage_x<kChunk>(a, sq[buf], sd[buf], g0, ng, kb, kb1); };
  if (kb0 < kb1) stage(0, kb0);
  int buf = 0;
  for (int64_t kb = kb0; kb < kb1; kb += kChunk, buf ^= 1) {
    const int kc = int(kb1 - kb < kChunk ? kb1 - kb : kChunk);
    Frag<T> f[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (u < kc) f[u] = load_a<T>(w, ra, rb, nb, kb + u, c);
    if (kb + kChunk < kb1) {
      stage(buf ^ 1, kb + kChunk);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    for (int u0 = 0; u0 < kc; u0 += kUnroll) {
      Frag<T> fn[kUnroll];  // the next blocks' weights, in flight while these blocks' products run
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u0 + kUnroll + u < kc) fn[u] = load_a<T>(w, ra, rb, nb, kb + u0 + kUnroll + u, c);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (u0 + u >= kc) break;
        mma_groups<NJ, kChunk>(acc, f[u].a, f[u].sa, f[u].sb, sq[buf], sd[buf], u0 + u, lane);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) f[u] = fn[u];
    }
    __syncthreads();  // the buffer is staged again two chunks on
  }
  store_tile<NJ>(a, acc, tile_row, wi, g0, ng, warp, lane);
}

// ---- Fragment-ordered weights (GpuWeight::frag, made at load by make_frag).
//
// With the weights' planes as stored, a warp's A fragment of one block is 8 scattered 4-byte
// loads (two rows' words per lane group) and their two scales another two: ~1 KB in flight a
// warp, which bounds the kernel at 8-32 rows (the loads, not the mma). In the fragment order a
// tile of 16 rows and a pair of blocks of 32 is one contiguous run of 32 lanes x 16 bytes (Q4_0;
// Q8_0: 32 bytes), each lane's run exactly its A fragments of both blocks, and the pair's scales
// are 8 bytes a lane group ([tile][pair][lane / 4][ra kb, rb kb, ra kb+1, rb kb+1] halves). An
// odd last block pairs with zeros.
//   Q4_0 lane run: {ra kb word c, rb kb word c, ra kb+1 word c, rb kb+1 word c} (word c: bytes
//   4c..4c+3 of a row's block, elements 4c..+3 in the low nibbles and 16+4c..+3 in the high).
//   Q8_0 lane run: per block {ra bytes 4c.., rb bytes 4c.., ra bytes 16+4c.., rb bytes 16+4c..}.
template <WType T>
constexpr int kFragWords = T == WType::Q4_0 ? 4 : 8;  // 32-bit words a lane holds per pair of blocks
// Pairs of blocks a warp's loads run ahead of its products (double-buffered: the next chunk's
// are in flight while this chunk's products run); a chunk is 2 * kFragPairs blocks.
template <WType T>
constexpr int kFragPairs = T == WType::Q4_0 ? 4 : 2;

template <WType T>
struct PairFrag {
  uint4 q[kFragWords<T> / 4];
  uint2 s;
};

template <WType T>
__device__ __forceinline__ PairFrag<T> load_pair(const GpuWeight& w, int64_t tile16, int64_t nkp, int64_t kp, int lane) {
  PairFrag<T> f;
  const int64_t unit = (tile16 * nkp + kp) * 32 + lane;
  const uint4* q = static_cast<const uint4*>(w.frag);
#pragma unroll
  for (int i = 0; i < kFragWords<T> / 4; ++i) f.q[i] = __ldg(q + unit * (kFragWords<T> / 4) + i);
  f.s = __ldg(reinterpret_cast<const uint2*>(w.frag_scale) + (tile16 * nkp + kp) * 8 + lane / 4);
  return f;
}

// Block h (0, 1) of a pair as the mma's A operand and its two rows' scales.
template <WType T>
__device__ __forceinline__ void pair_block(const PairFrag<T>& f, int h, uint32_t (&a)[4], float& sa, float& sb) {
  if constexpr (T == WType::Q4_0) {
    const uint32_t va = h ? f.q[0].z : f.q[0].x, vb = h ? f.q[0].w : f.q[0].y;
    nibbles_x16(va, a[0], a[2]);
    nibbles_x16(vb, a[1], a[3]);
  } else {
    const uint4 v = f.q[h];
    a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
  }
  const uint32_t s = h ? f.s.y : f.s.x;
  sa = half_f32(uint16_t(s & 0xffffu)) * kNibbleScale<T>;
  sb = half_f32(uint16_t(s >> 16)) * kNibbleScale<T>;
}

// block(u, h) for blocks 2u + h < kc of a chunk of kPairs pairs: a whole chunk with no branch between
// its blocks (a branch there made each block's loads and mma wait on the block before), a last,
// partial one with them.
template <int kPairs, class F>
__device__ __forceinline__ void for_chunk_blocks(int kc, F&& block) {
  if (kc == 2 * kPairs) {
#pragma unroll
    for (int u = 0; u < kPairs; ++u) {
      block(u, 0);
      block(u, 1);
    }
  } else {
#pragma unroll
    for (int u = 0; u < kPairs; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (2 * u + h < kc) block(u, h);
  }
}

// k_mmq over fragment-ordered weights: the same grid, staging and sums, the weights' loads one
// 16-byte run a lane per pair of blocks, kept a chunk ahead of the products across chunks (and,
// for a dense product of loaded weights, the first chunk's issued before the wait on the kernel
// before it).
template <WType T, int NJ>
__global__ void __launch_bounds__(kWarps * 32) k_mmq_frag(Args a) {
  constexpr int kPairs = kFragPairs<T>, kCh = 2 * kPairs;
  __shared__ __align__(16) int2 sq[2][NJ * kCh * 32];
  __shared__ __align__(16) float sd[2][NJ * kCh * 8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t tile_row = int64_t(blockIdx.x) * kTileRows;
  const WarpSpan sp = warp_span(a, warp);
  const int wi = sp.wi;
  const GpuWeight& w0 = pick_w(a, wi);
  const int64_t nkp = sp.nkp, kb0 = sp.kb0, kb1 = sp.kb1, kp1 = sp.kp1;
  int64_t wrow = sp.wrow;
  PairFrag<T> cur[kPairs];
  const bool early = !a.tiles && w0.fixed;
  auto load_chunk = [&](PairFrag<T>(&f)[kPairs], int64_t tile16, int64_t kp) {
#pragma unroll
    for (int u = 0; u < kPairs; ++u)
      if (kp + u < kp1) f[u] = load_pair<T>(pick_w(a, wi), tile16, nkp, kp + u, lane);
  };
  if (early) load_chunk(cur, (wrow + warp * 16) / 16, kb0 / 2);
  pdl_begin();
  int64_t g0;
  int ng;
  if (!block_groups<NJ>(a, wrow, g0, ng)) return;
  const int64_t tile16 = (wrow + warp * 16) / 16;
  if (!early) load_chunk(cur, tile16, kb0 / 2);
  float acc[NJ][4];
  zero_acc<NJ>(acc);
  auto stage = [&](int buf, int64_t kb) { stage_x<kCh>(a, sq[buf], sd[buf], g0, ng, kb, kb1); };
  if (kb0 < kb1) stage(0, kb0);
  int buf = 0;
  for (int64_t kb = kb0; kb < kb1; kb += kCh, buf ^= 1) {
    const int kc = int(kb1 - kb < kCh ? kb1 - kb : kCh);
    PairFrag<T> nxt[kPairs];
    load_chunk(nxt, tile16, (kb + kCh) / 2);
    if (kb + kCh < kb1) {
      stage(buf ^ 1, kb + kCh);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    auto block = [&](int u, int h) {
      uint32_t af[4];
      float sa, sb;
      pair_block<T>(cur[u], h, af, sa, sb);
      mma_groups<NJ, kCh>(acc, af, sa, sb, sq[buf], sd[buf], 2 * u + h, lane);
    };
    for_chunk_blocks<kPairs>(kc, block);
#pragma unroll
    for (int u = 0; u < kPairs; ++u) cur[u] = nxt[u];
    __syncthreads();
  }
  if (a.glu)
    store_glu<NJ>(a, acc, reinterpret_cast<float*>(&sq[0][0]), g0, ng, warp, lane);
  else
    store_tile<NJ>(a, acc, tile_row, wi, g0, ng, warp, lane);
}

// ---- bf16 activations against fragment-ordered Q4_0 weights (k_mmq_bf16).
//
// Past 16 rows k_mmq_frag is bound by the instructions around each int8 mma (four conversions,
// four scale products and four adds a block of 32 and group of 8 rows, the activations' block
// scales among them), so that a step's time grows with its rows (E4B Q4_0 on an H100: 4.5 ms at 16
// streams, 7.1 at 32). Here the activations stay bf16 (the rows the norms and the attention already
// write for cuBLAS past 16 rows: no quantization at all) and the weights' nibbles become exact bf16
// values n - 8 in registers, once a warp per block for every group of rows: a block of 32 is two
// bf16 mma.sync (m16n8k16, f32 sums) whose sum is scaled by the weight rows' scales - four fused
// multiply-adds, no conversions. The numbers are those of exact weights against bf16 activations
// (cuBLAS's path rounds the weights to bf16 as well).
//
// K order within a block: an mma's logical k (2c, 2c+1 | 2c+8, 2c+9) of lane group c are the block's
// elements (4c, 4c+1 | 4c+2, 4c+3) for the low nibbles and 16 more for the high ones, so that a
// lane's A registers come out of its fragment-ordered word with one byte permute each, and its B
// registers are one 8-byte load of four consecutive activations.
constexpr int kBfPairs = 4, kBfChunk = 2 * kBfPairs;  // blocks of 32 a chunk: the weights' loads run a chunk ahead
// A staged activation row: the chunk's bf16 and 32 bytes more, so that the 8 rows of a fragment
// load (lane group stride) fall 32 bytes apart in the banks: a half-warp's 16 loads of 8 bytes
// cover all 32 banks once.
constexpr int kBfRowBytes = kBfChunk * 64 + 32;
template <int NJ>
constexpr size_t bf16_smem_bytes() {
  return size_t(2) * NJ * 8 * kBfRowBytes;  // two chunk buffers
}

// A fragment-ordered Q4_0 word (bytes 4c..4c+3 of a row's block: elements 4c..+3 in the low nibbles,
// 16+4c..+3 in the high) as four bf16 pairs n - 8: {4c, 4c+1}, {4c+2, 4c+3}, {16+4c, 16+4c+1},
// {16+4c+2, 16+4c+3}. A nibble n under the bf16 exponent byte 0x43 is 128 + n; 136 off is n - 8, exact.
__device__ __forceinline__ void nibbles_bf16(uint32_t v, uint32_t (&o)[4]) {
  const uint32_t lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
  o[0] = __byte_perm(lo, 0x43434343u, 0x5140);
  o[1] = __byte_perm(lo, 0x43434343u, 0x7362);
  o[2] = __byte_perm(hi, 0x43434343u, 0x5140);
  o[3] = __byte_perm(hi, 0x43434343u, 0x7362);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(o[i]) : "r"(0x3F803F80u), "r"(0xC308C308u));  // x * 1 - 136
}

// A thread's share of staging a chunk: 16-byte piece `piece` of activation rows row0, row0 + 4, ...
// of the block's tile, its addresses made once (worked out per piece and chunk, the staging had
// cost as many instructions as the products: ~40 a piece).
constexpr int kBfPieces = kBfChunk * 4;               // 16-byte pieces of a staged row
constexpr int kBfRowsPerPass = kWarps * 32 / kBfPieces;  // rows the block's threads stage at once
static_assert(kWarps * 32 % kBfPieces == 0, "a pass stages whole rows");
struct BfStage {
  const uint16_t* x;  // row row0's piece at block 0 of K
  int64_t step;       // kBfRowsPerPass rows, in elements
  int so;             // row row0's piece in a chunk buffer, in bytes
  int rows;           // of the thread's rows, those that exist (the rest are staged as zeros)
  int piece;
};
__device__ __forceinline__ BfStage bf_stage(const Args& a, int64_t g0) {
  BfStage t;
  t.piece = int(threadIdx.x) % kBfPieces;
  const int row0 = int(threadIdx.x) / kBfPieces;
  const int64_t first = g0 * 8 + row0, ld = a.nkb * 32;
  t.x = a.xb + first * ld + t.piece * 8;
  t.step = kBfRowsPerPass * ld;
  t.so = row0 * kBfRowBytes + t.piece * 16;
  t.rows = first < a.n ? int((a.n - first + kBfRowsPerPass - 1) / kBfRowsPerPass) : 0;
  return t;
}
// Blocks [kb, kb + kc) of the tile's NJ groups of rows into a chunk buffer.
template <int NJ>
__device__ __forceinline__ void stage_bf16(const Args& a, const BfStage& t, char* s, int64_t kb, int kc) {
  if (t.piece < kc * 4) {
#pragma unroll
    for (int i = 0; i < NJ * 8 / kBfRowsPerPass; ++i) {
      const bool in = i < t.rows;
      cp_async16_or_zeros(s + t.so + i * kBfRowsPerPass * kBfRowBytes, in ? t.x + i * t.step + kb * 32 : a.xb,
                          in ? 16 : 0);
    }
  }
  cp_async_commit();
}

// One block of 32 of the staged chunk (xs: lane's first bytes of it in group 0's rows) against a
// pair-half's two A fragments (lo: elements 0-15, hi: 16-31), every group: two mma a group, its sum
// scaled by the rows' scales sa, sb. No branch between groups (rows past the activations' are
// staged as zeros), so that their loads and mma chains interleave.
template <int NJ>
__device__ __forceinline__ void mma_bf16_groups(float (&acc)[NJ][4], const uint32_t (&lo)[4],
                                                const uint32_t (&hi)[4], float sa, float sb, const char* xs) {
  uint2 b0[NJ], b1[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    b0[j] = *reinterpret_cast<const uint2*>(xs + j * 8 * kBfRowBytes);
    b1[j] = *reinterpret_cast<const uint2*>(xs + j * 8 * kBfRowBytes + 32);
  }
  float p[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0.f;
    mma_bf16(p[j], lo, b0[j]);
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    mma_bf16(p[j], hi, b1[j]);
    acc[j][0] += p[j][0] * sa;
    acc[j][1] += p[j][1] * sa;
    acc[j][2] += p[j][2] * sb;
    acc[j][3] += p[j][3] * sb;
  }
}

// A warp's fragment-ordered Q4_0 weights in a dense product on bf16 activations (k_mmq_bf16, k_mmq_wgmma), loaded
// kPairs pairs of blocks at a time, and its block's activation groups (dense_groups); start_dense_q4 loads the
// first chunk before the wait on the kernel before where the weights are loaded ones (fixed), after it where a
// kernel writes them.
template <int kPairs>
struct DenseQ4 {
  WarpSpan sp;
  int64_t tile16;  // the warp's 16 rows
  int64_t g0;
  int ng;
  __device__ __forceinline__ void load(const Args& a, PairFrag<WType::Q4_0> (&f)[kPairs], int64_t kp, int lane) const {
#pragma unroll
    for (int u = 0; u < kPairs; ++u)
      if (kp + u < sp.kp1) f[u] = load_pair<WType::Q4_0>(pick_w(a, sp.wi), tile16, sp.nkp, kp + u, lane);
  }
};
template <int kPairs, int NJ>
__device__ __forceinline__ DenseQ4<kPairs> start_dense_q4(const Args& a, int warp, int lane,
                                                         PairFrag<WType::Q4_0> (&first)[kPairs]) {
  DenseQ4<kPairs> w;
  dense_groups<NJ>(a, w.g0, w.ng);
  w.sp = warp_span(a, warp);
  w.tile16 = (w.sp.wrow + warp * 16) / 16;
  const bool fixed = pick_w(a, w.sp.wi).fixed;
  if (fixed) w.load(a, first, w.sp.kb0 / 2, lane);
  pdl_begin();
  if (!fixed) w.load(a, first, w.sp.kb0 / 2, lane);
  return w;
}

// k_mmq_frag's grid, weight loads and epilogues (Q4_0, dense products), the activations as bf16.
template <int NJ>
__global__ void __launch_bounds__(kWarps * 32) k_mmq_bf16(Args a) {
  extern __shared__ __align__(16) char smem[];
  constexpr WType T = WType::Q4_0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gr = lane / 4, c = lane % 4;
  PairFrag<T> cur[kBfPairs];
  const DenseQ4<kBfPairs> wq = start_dense_q4<kBfPairs, NJ>(a, warp, lane, cur);
  const int64_t kb0 = wq.sp.kb0, kb1 = wq.sp.kb1, g0 = wq.g0;
  const int ng = wq.ng;
  constexpr int kBufBytes = NJ * 8 * kBfRowBytes;
  float acc[NJ][4];
  zero_acc<NJ>(acc);
  const BfStage stage = bf_stage(a, g0);
  auto chunk_blocks = [&](int64_t kb) { return int(kb1 - kb < kBfChunk ? kb1 - kb : kBfChunk); };
  if (kb0 < kb1) stage_bf16<NJ>(a, stage, smem, kb0, chunk_blocks(kb0));
  int buf = 0;
  for (int64_t kb = kb0; kb < kb1; kb += kBfChunk, buf ^= 1) {
    const int kc = chunk_blocks(kb);
    PairFrag<T> nxt[kBfPairs];
    wq.load(a, nxt, (kb + kBfChunk) / 2, lane);
    if (kb + kBfChunk < kb1) {
      stage_bf16<NJ>(a, stage, smem + (buf ^ 1) * kBufBytes, kb + kBfChunk, chunk_blocks(kb + kBfChunk));
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const char* xs = smem + buf * kBufBytes + gr * kBfRowBytes + 8 * c;
    auto block = [&](int u, int h) {
      uint32_t ra[4], rb[4];
      nibbles_bf16(h ? cur[u].q[0].z : cur[u].q[0].x, ra);
      nibbles_bf16(h ? cur[u].q[0].w : cur[u].q[0].y, rb);
      const uint32_t lo[4] = {ra[0], rb[0], ra[1], rb[1]}, hi[4] = {ra[2], rb[2], ra[3], rb[3]};
      const uint32_t s = h ? cur[u].s.y : cur[u].s.x;
      mma_bf16_groups<NJ>(acc, lo, hi, half_f32(uint16_t(s & 0xffffu)), half_f32(uint16_t(s >> 16)),
                          xs + (2 * u + h) * 64);
    };
    for_chunk_blocks<kBfPairs>(kc, block);
#pragma unroll
    for (int u = 0; u < kBfPairs; ++u) cur[u] = nxt[u];
    __syncthreads();
  }
  if (a.glu)
    store_glu<NJ>(a, acc, reinterpret_cast<float*>(smem), g0, ng, warp, lane);
  else
    store_tile<NJ>(a, acc, int64_t(blockIdx.x) * kTileRows, wq.sp.wi, g0, ng, warp, lane);
}

// ---- Hopper's warpgroup products on bf16 activations (k_mmq_wgmma, sm_90a).
//
// Past ~48 rows k_mmq_bf16 is bound by its issue slots (mma.sync m16n8k16: a load, two mma and four
// scalings a block of 32 and group of 8 rows, ~9.5 instructions an mma at 128 rows) and cuBLAS on the bf16
// copies, which reads 3.5x the bytes, wins there. Here one warpgroup (the block's four warps) issues
// wgmma.mma_async m64nNk16 (N = 64 or 128 activation rows: a tile) with its A operand in registers -
// each warp's 16 weight rows, unpacked as in k_mmq_bf16 - and B, the staged activations, read by the
// tensor cores from shared memory: a block of 32 is two instructions for the whole tile, none of its
// per-row-group work in the warps. There is no per-block scaling after the products: the weights are
// unpacked as bf16 of (n - 8) d, computed exactly in f32 and rounded to nearest-even once - the values
// of their bf16 copies, what cuBLAS's path multiplies.
//
// K order: wgmma reads B in shared memory in k order, so A must be too: lane c of a lane group needs
// elements (2c, 2c+1 | 8+2c, 9+2c) of a block for the first k16 and 16 more for the second, which lie in
// the fragment-ordered words of lanes c / 2 and 2 + c / 2 (word c': bytes 4c'..4c'+3, low nibbles
// elements 4c'.., high ones 16 + 4c'..): two shuffles a word and one byte permute give a word whose low
// nibbles are the first k16's four elements and high nibbles the second's.
constexpr int kWgPairs = 2, kWgChunk = 2 * kWgPairs;  // blocks of 32 a staged chunk
template <int NJ>
constexpr size_t wgmma_smem_bytes() {
  return size_t(2) * NJ * 8 * kWgChunk * 64;  // two chunk buffers of 8 NJ rows
}
// A chunk buffer holds wgmma's canonical K-major layout without swizzling: core matrices of 8 rows x 8
// k (16-byte rows, 128 bytes each), the tile's N / 8 of one k8 column together. Byte offset of (row, k):
// (k / 8) * 16 N + (row / 8) * 128 + (row % 8) * 16 + (k % 8) * 2. So the descriptor's leading byte
// offset (between core matrices along K) is 16 N and its stride byte offset (along N) 128.
__device__ __forceinline__ uint64_t wgmma_desc(const char* s, int n_rows) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(s));
  return uint64_t((a >> 4) & 0x3FFFu) | uint64_t(((16 * n_rows) >> 4) & 0x3FFF) << 16 | uint64_t(128 >> 4) << 32;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MB_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
// d[j][e] (column group j: element e is row 16 warp + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2)
// += A (a warp's rows in mma.m16n8k16's A fragment) · B (desc); asynchronous until wgmma_wait.
__device__ __forceinline__ void wgmma_bf16(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
      : MB_ACC4(0), MB_ACC4(1), MB_ACC4(2), MB_ACC4(3), MB_ACC4(4), MB_ACC4(5), MB_ACC4(6), MB_ACC4(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ void wgmma_bf16(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, "
      "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, "
      "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
      : MB_ACC4(0), MB_ACC4(1), MB_ACC4(2), MB_ACC4(3), MB_ACC4(4), MB_ACC4(5), MB_ACC4(6), MB_ACC4(7),
        MB_ACC4(8), MB_ACC4(9), MB_ACC4(10), MB_ACC4(11), MB_ACC4(12), MB_ACC4(13), MB_ACC4(14), MB_ACC4(15)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#undef MB_ACC4
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// The accumulators are the asynchronous products' until the wait: no access may move across it.
template <int NJ>
__device__ __forceinline__ void wgmma_hold(float (&d)[NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
// Shared memory written by cp.async (the generic proxy) is read by wgmma through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

// Lane c's k-ordered word of a block (see above) from the lane group's fragment-ordered words w.
__device__ __forceinline__ uint32_t k_ordered(uint32_t w, int lane) {
  const int src = (lane & ~3) | ((lane & 3) >> 1);
  const uint32_t w1 = __shfl_sync(0xffffffffu, w, src), w2 = __shfl_sync(0xffffffffu, w, src + 2);
  return __byte_perm(w1, w2, lane & 1 ? 0x7632 : 0x5410);
}
// A k-ordered word of one row as bf16 pairs of (n - 8) d: {0: first k16's elements 0-1, 1: its 2-3,
// 2: second k16's 0-1, 3: its 2-3}. A nibble n at bits 19-22 of 1.0f is 1 + n / 16, and 16 d times
// that less 24 d is (n - 8) d: exact in the fma (15 significant bits at most), rounded to bf16 once.
__device__ __forceinline__ void nibbles_scaled_bf16(uint32_t v, float d, uint32_t (&o)[4]) {
  const uint32_t lo = ((v << 3) & 0x78787878u) | 0x80808080u, hi = ((v >> 1) & 0x78787878u) | 0x80808080u;
  const float m = 16.f * d, b = -24.f * d;
  auto val = [&](uint32_t bytes, int i) {
    return fmaf(__uint_as_float(__byte_perm(bytes, 0x3F000000u, 0x7054u | (uint32_t(i) << 8))), m, b);
  };
  o[0] = pack_bf16_rn(val(lo, 0), val(lo, 1));
  o[1] = pack_bf16_rn(val(lo, 2), val(lo, 3));
  o[2] = pack_bf16_rn(val(hi, 0), val(hi, 1));
  o[3] = pack_bf16_rn(val(hi, 2), val(hi, 3));
}

// A thread's share of staging a chunk: 16-byte pieces (8 k) of rows 8 i + t % 8 at k8 column t / 8, so
// that 8 threads in a row fill one 128-byte core matrix.
struct WgStage {
  const uint16_t* x;  // row t % 8's piece at block 0 of K
  int64_t step;       // 8 rows, in elements
  int so;             // that piece's offset in a chunk buffer, bytes
  int rows;           // of the thread's NJ rows, those that exist
};
__device__ __forceinline__ WgStage wg_stage(const Args& a, int64_t g0, int n_rows) {
  WgStage t;
  const int r = int(threadIdx.x) % 8, k8 = int(threadIdx.x) / 8;
  const int64_t first = g0 * 8 + r, ld = a.nkb * 32;
  t.x = a.xb + first * ld + k8 * 8;
  t.step = 8 * ld;
  t.so = k8 * 16 * n_rows + r * 16;
  t.rows = first < a.n ? int((a.n - first + 7) / 8) : 0;
  return t;
}
// Blocks [kb, kb + kc) of the tile's rows into a chunk buffer; zeros for rows past the activations' and
// for the blocks of a last, partial chunk past kc (whose products run all the same: a branch around a
// wgmma makes the compiler serialize them all).
template <int NJ>
__device__ __forceinline__ void stage_wg(const Args& a, const WgStage& t, char* s, int64_t kb, int kc) {
  static_assert(kWgChunk * 4 * 8 == kWarps * 32, "a thread a k8 column and row of 8");
  const int rows = int(threadIdx.x) / 8 < kc * 4 ? t.rows : 0;
#pragma unroll
  for (int i = 0; i < NJ; ++i) {
    const bool in = i < rows;
    cp_async16_or_zeros(s + t.so + i * 128, in ? t.x + i * t.step + kb * 32 : a.xb, in ? 16 : 0);
  }
  cp_async_commit();
}

// k_mmq_bf16's grid, weight loads and epilogues, one warpgroup a block on a tile of 8 NJ activation rows.
template <int NJ>
__global__ void __launch_bounds__(kWarps * 32) k_mmq_wgmma(Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem[];
  constexpr WType T = WType::Q4_0;
  constexpr int kRows = 8 * NJ, kBufBytes = kRows * kWgChunk * 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  PairFrag<T> cur[kWgPairs];
  const DenseQ4<kWgPairs> wq = start_dense_q4<kWgPairs, NJ>(a, warp, lane, cur);
  const int64_t kb0 = wq.sp.kb0, kb1 = wq.sp.kb1, g0 = wq.g0;
  const int ng = wq.ng;
  float acc[NJ][4];
  zero_acc<NJ>(acc);
  const WgStage stage = wg_stage(a, g0, kRows);
  auto chunk_blocks = [&](int64_t kb) { return int(kb1 - kb < kWgChunk ? kb1 - kb : kWgChunk); };
  if (kb0 < kb1) stage_wg<NJ>(a, stage, smem, kb0, chunk_blocks(kb0));
  int buf = 0;
  for (int64_t kb = kb0; kb < kb1; kb += kWgChunk, buf ^= 1) {
    const int kc = chunk_blocks(kb);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    // The other buffer's last reader, the chunk before's products, was waited for.
    if (kb + kWgChunk < kb1) stage_wg<NJ>(a, stage, smem + (buf ^ 1) * kBufBytes, kb + kWgChunk, chunk_blocks(kb + kWgChunk));
    PairFrag<T> nxt[kWgPairs];
    wq.load(a, nxt, (kb + kWgChunk) / 2, lane);
    uint32_t af[kWgChunk][2][4];  // [block][k16] A fragments
#pragma unroll
    for (int u = 0; u < kWgPairs; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t ra[4], rb[4];
        const uint32_t s = h ? cur[u].s.y : cur[u].s.x;
        nibbles_scaled_bf16(k_ordered(h ? cur[u].q[0].z : cur[u].q[0].x, lane), half_f32(uint16_t(s & 0xffffu)), ra);
        nibbles_scaled_bf16(k_ordered(h ? cur[u].q[0].w : cur[u].q[0].y, lane), half_f32(uint16_t(s >> 16)), rb);
        // A block past the chunk's is zeros against zeros (cur's registers there may hold anything).
        const uint32_t keep = 2 * u + h < kc ? ~0u : 0u;
        uint32_t(&lo)[4] = af[2 * u + h][0];
        uint32_t(&hi)[4] = af[2 * u + h][1];
        lo[0] = ra[0] & keep, lo[1] = rb[0] & keep, lo[2] = ra[1] & keep, lo[3] = rb[1] & keep;
        hi[0] = ra[2] & keep, hi[1] = rb[2] & keep, hi[2] = ra[3] & keep, hi[3] = rb[3] & keep;
      }
    const char* xs = smem + buf * kBufBytes;
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 2 * kWgChunk; ++s) wgmma_bf16(acc, af[s / 2][s % 2], wgmma_desc(xs + s * 32 * kRows, kRows));
    wgmma_commit();
    wgmma_wait_all();
    wgmma_hold<NJ>(acc);
#pragma unroll
    for (int u = 0; u < kWgPairs; ++u) cur[u] = nxt[u];
  }
  __syncthreads();  // store_glu's shared memory is the staging buffers
  if (a.glu)
    store_glu<NJ>(a, acc, reinterpret_cast<float*>(smem), g0, ng, warp, lane);
  else
    store_tile<NJ>(a, acc, int64_t(blockIdx.x) * kTileRows, wq.sp.wi, g0, ng, warp, lane);
#endif
}

// Weight w's planes into the fragment order above: one thread a lane run.
template <WType T>
__global__ void k_make_frag(GpuWeight w, uint4* frag, uint2* frag_scale) {
  const int64_t nb = w.cols / 32, nkp = (nb + 1) / 2, units = w.rows / 16 * nkp * 32;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < units; u += int64_t(gridDim.x) * blockDim.x) {
    const int lane = int(u % 32), c = lane % 4;
    const int64_t kp = u / 32 % nkp, tile16 = u / 32 / nkp;
    const int64_t ra = tile16 * 16 + lane / 4, rb = ra + 8;
    uint32_t word[kFragWords<T>];
    uint16_t sc[4];
    for (int h = 0; h < 2; ++h) {
      const int64_t kb = 2 * kp + h;
      const bool in = kb < nb;
      if constexpr (T == WType::Q4_0) {
        const uint8_t* qs = static_cast<const uint8_t*>(w.qs);
        word[2 * h] = in ? *reinterpret_cast<const uint32_t*>(qs + (ra * nb + kb) * 16 + 4 * c) : 0x88888888u;
        word[2 * h + 1] = in ? *reinterpret_cast<const uint32_t*>(qs + (rb * nb + kb) * 16 + 4 * c) : 0x88888888u;
      } else {
        const int8_t* qs = static_cast<const int8_t*>(w.qs);
        const int8_t* pa = qs + (ra * nb + kb) * 32 + 4 * c;
        const int8_t* pb = qs + (rb * nb + kb) * 32 + 4 * c;
        word[4 * h + 0] = in ? *reinterpret_cast<const uint32_t*>(pa) : 0u;
        word[4 * h + 1] = in ? *reinterpret_cast<const uint32_t*>(pb) : 0u;
        word[4 * h + 2] = in ? *reinterpret_cast<const uint32_t*>(pa + 16) : 0u;
        word[4 * h + 3] = in ? *reinterpret_cast<const uint32_t*>(pb + 16) : 0u;
      }
      sc[2 * h] = in ? w.scale[ra * nb + kb] : 0;
      sc[2 * h + 1] = in ? w.scale[rb * nb + kb] : 0;
    }
    for (int i = 0; i < kFragWords<T> / 4; ++i)
      frag[u * (kFragWords<T> / 4) + i] = make_uint4(word[4 * i], word[4 * i + 1], word[4 * i + 2], word[4 * i + 3]);
    if (c == 0)
      frag_scale[(tile16 * nkp + kp) * 8 + lane / 4] =
          make_uint2(uint32_t(sc[0]) | uint32_t(sc[1]) << 16, uint32_t(sc[2]) | uint32_t(sc[3]) << 16);
  }
}

// The K splits' partial sums into the outputs: plain (each weight its own y), GLU (y[0] =
// gelu_tanh(gate) * up, the weights being gate and up), gelu-times (y[0] = gelu_tanh(s) * m).
__global__ void k_mmq_reduce(Args a, int splits, MmqMode mode, const float* m) {
  pdl_begin();
  const bool glu = mode == MmqMode::Glu;
  const int64_t out_rows = glu ? a.w[0].rows : a.rows;
  const int64_t total = a.n * out_rows;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / out_rows, r = i % out_rows;
    float s = 0.f, u = 0.f;
    for (int z = 0; z < splits; ++z) {
      const float* p = a.part + (int64_t(z) * a.n + t) * a.rows;
      s += p[r];
      if (glu) u += p[out_rows + r];
    }
    if (glu) {
      a.y[0][i] = gelu_tanh(s) * u;
    } else if (mode == MmqMode::GeluTimes) {
      a.y[0][i] = gelu_tanh(s) * m[i];
    } else {
      int wi = 0;
      int64_t rr = r;
      while (wi + 1 < a.nw && rr >= pick_w(a, wi).rows) rr -= pick_w(a, wi++).rows;
      pick_y(a, wi)[t * pick_w(a, wi).rows + rr] = s;
    }
  }
}

// The fragment-ordered kernel where every weight has its copy (a product's weights are made alike).
bool all_frag(const Args& a) {
  bool all = true;
  for (int i = 0; i < a.nw; ++i) all = all && a.w[i].frag;
  return all;
}
template <WType T, int NJ>
void launch_nj(const Args& a, dim3 grid, cudaStream_t st) {
  if (all_frag(a))
    launch_kernel(k_mmq_frag<T, NJ>, grid, kWarps * 32, 0, st, a);
  else
    launch_kernel(k_mmq<T, NJ>, grid, kWarps * 32, 0, st, a);
}
// f<NJ>() for NJ = nj (1 to kMaxGroups).
template <class F>
void with_groups(int nj, F&& f) {
  switch (nj) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    default: return f(std::integral_constant<int, 8>());
  }
}
template <WType T>
void launch_t(const Args& a, int nj, dim3 grid, cudaStream_t st) {
  with_groups(nj, [&](auto g) { launch_nj<T, decltype(g)::value>(a, grid, st); });
}
void launch(const Args& a, WType t, int nj, dim3 grid, cudaStream_t st) {
  if (t == WType::Q4_0)
    launch_t<WType::Q4_0>(a, nj, grid, st);
  else
    launch_t<WType::Q8_0>(a, nj, grid, st);
}

// Groups of 8 rows a tile: the product's groups in tiles of at most kMaxGroups, as even as they go
// (the kernels compute every group of a tile: fewer rows in a tile are wasted products).
int groups_per_tile(int64_t groups) {
  if (groups <= kMaxGroups) return int(std::max<int64_t>(groups, 1));
  const int64_t tiles = (groups + kMaxGroups - 1) / kMaxGroups;
  return int((groups + tiles - 1) / tiles);
}

__global__ void k_moe_tiles(const int32_t* experts, int64_t pairs, int E, int64_t tiled_rows, int tile_rows,
                            int32_t* row_pair, int4* tiles, int32_t* n_tiles) {
  pdl_begin();
  extern __shared__ int sm[];
  int *count = sm, *first = sm + E, *cursor = sm + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = cursor[e] = 0;
  for (int64_t r = threadIdx.x; r < tiled_rows; r += blockDim.x) row_pair[r] = -1;
  __syncthreads();
  // An expert id out of range (not route_topk's) is left out rather than written past the counts.
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x)
    if (experts[p] >= 0 && experts[p] < E) atomicAdd(&count[experts[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int row = 0, nt = 0;
    for (int e = 0; e < E; ++e) {
      first[e] = row;
      for (int t = 0; t < count[e]; t += tile_rows) tiles[nt++] = make_int4(e, row + t, min(tile_rows, count[e] - t), 0);
      row += (count[e] + 7) / 8 * 8;
    }
    *n_tiles = nt;
  }
  __syncthreads();
  // Rows within an expert land in any order: each output row's arithmetic does not depend on it.
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = experts[p];
    if (e >= 0 && e < E) row_pair[first[e] + atomicAdd(&cursor[e], 1)] = int32_t(p);
  }
}

// (16-row tile, pair of blocks) units of a fragment-ordered copy.
int64_t frag_tiles(const GpuWeight& w) { return w.rows / 16 * ((w.cols / 32 + 1) / 2); }

}  // namespace

bool mmq_supports(const GpuWeight& w) {
  return (w.type == WType::Q4_0 || w.type == WType::Q8_0) && w.rows % kTileRows == 0 && w.cols % 32 == 0;
}

int64_t frag_bytes(const GpuWeight& w) { return frag_tiles(w) * 32 * (w.type == WType::Q4_0 ? 16 : 32); }
int64_t frag_scale_bytes(const GpuWeight& w) { return frag_tiles(w) * 8 * 8; }

void make_frag(const GpuWeight& w, void* frag, void* frag_scale, cudaStream_t st) {
  const int64_t units = frag_tiles(w) * 32;  // a lane run each
  const unsigned blocks = unsigned(std::min<int64_t>((units + 255) / 256, 65535));
  if (w.type == WType::Q4_0)
    launch_kernel(k_make_frag<WType::Q4_0>, blocks, 256, 0, st, w, static_cast<uint4*>(frag),
                  static_cast<uint2*>(frag_scale));
  else
    launch_kernel(k_make_frag<WType::Q8_0>, blocks, 256, 0, st, w, static_cast<uint4*>(frag),
                  static_cast<uint2*>(frag_scale));
  check_launch("fragment-ordered weight");
}

int64_t tiled_x_rows(int64_t n) { return (n + 7) / 8 * 8; }

void tile_x(const float* x, int64_t n, int64_t k, const int32_t* src, int div, int64_t rows, int8_t* q, float* d,
            cudaStream_t st) {
  if (rows == 0) return;
  constexpr int warps = kTileXThreads / 32;
  launch_kernel(k_tile_x, dim3(unsigned(rows), unsigned((k / 32 + warps - 1) / warps)), kTileXThreads, 0, st, x, k, n,
                src, div, q, d);
  check_launch("tile activations");
}

int64_t mmq_splits(const GpuWeight* ws, int nw, int64_t n, int tile_groups) {
  int64_t rows = 0;
  for (int i = 0; i < nw; ++i) rows += ws[i].rows;
  const int64_t groups = (n + 7) / 8, nj = tile_groups > 0 ? tile_groups : groups_per_tile(groups);
  const int64_t blocks = rows / kTileRows * ((groups + nj - 1) / nj);
  const int64_t nb = ws[0].cols / 32;
  // Enough blocks for two a multiprocessor; each split at least 8 blocks of 32.
  const int64_t want = (2 * sm_count() + blocks - 1) / blocks;
  return std::max<int64_t>(1, std::min<int64_t>(want, nb / 8));
}

bool mmq_direct(const GpuWeight* ws, int nw, MmqMode mode, int64_t splits) {
  bool frag = true;
  for (int i = 0; i < nw; ++i) frag = frag && ws[i].frag;
  return splits == 1 && (mode == MmqMode::Plain || (mode == MmqMode::Glu && frag) ||
                         (mode == MmqMode::GeluTimes && nw == 1));
}

namespace {

// The launch's arguments but for the activations; the kernel writes ys itself where direct (see mmq_direct).
Args mmq_args(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, int64_t n, int64_t splits,
              float* part, bool direct) {
  Args a;
  a.nw = nw;
  for (int i = 0; i < nw; ++i) {
    a.w[i] = ws[i];
    a.rows += ws[i].rows;
    a.y[i] = ys[mode == MmqMode::Plain ? i : 0];
  }
  a.nkb = ws[0].cols / 32;
  a.n = n;
  a.groups = (n + 7) / 8;
  a.kb_per_split = ((a.nkb + splits - 1) / splits + 3) / 4 * 4;  // whole quads of blocks
  a.part = direct ? nullptr : part;
  if (direct) {
    a.glu = mode == MmqMode::Glu;
    a.m = mode == MmqMode::GeluTimes ? m : nullptr;
  }
  return a;
}

void mmq_reduce(const Args& a, MmqMode mode, const float* m, int64_t splits, cudaStream_t st) {
  const int64_t out = a.n * (mode == MmqMode::Glu ? a.w[0].rows : a.rows);
  const int64_t blocks = std::min<int64_t>((out + 255) / 256, 8 * int64_t(sm_count()));
  launch_kernel(k_mmq_reduce, unsigned(blocks), 256, 0, st, a, int(splits), mode, m);
  check_launch("mmq reduce");
}

template <int NJ>
void launch_bf16(const Args& a, dim3 grid, cudaStream_t st) {
  constexpr size_t smem = bf16_smem_bytes<NJ>();
  static const bool sized =
      cudaFuncSetAttribute(k_mmq_bf16<NJ>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess;
  (void)sized;  // a refusal shows as the launch's error
  launch_kernel(k_mmq_bf16<NJ>, grid, kWarps * 32, smem, st, a);
}

template <int NJ>
void launch_wgmma(const Args& a, dim3 grid, cudaStream_t st) {
  constexpr size_t smem = wgmma_smem_bytes<NJ>();
  static const bool sized =
      cudaFuncSetAttribute(k_mmq_wgmma<NJ>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess;
  (void)sized;
  launch_kernel(k_mmq_wgmma<NJ>, grid, kWarps * 32, smem, st, a);
}

}  // namespace

int mmq_wgmma_groups(int64_t n) { return n <= 64 ? 8 : 16; }

bool mmq_bf16_supports(const GpuWeight* ws, int nw) {
  for (int i = 0; i < nw; ++i)
    if (ws[i].type != WType::Q4_0 || !ws[i].frag || !mmq_supports(ws[i]) || ws[i].cols != ws[0].cols) return false;
  return nw > 0;
}

void mmq_bf16(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, const uint16_t* xb,
              int64_t n, int64_t splits, float* part, bool warpgroup, cudaStream_t st) {
  if (n == 0) return;
  const bool direct = mmq_direct(ws, nw, mode, splits);
  Args a = mmq_args(ws, ys, nw, mode, m, n, splits, part, direct);
  a.xb = xb;
  const int nj = warpgroup ? mmq_wgmma_groups(n) : groups_per_tile(a.groups);
  const dim3 grid(unsigned(a.rows / kTileRows), unsigned((a.groups + nj - 1) / nj), unsigned(splits));
  if (!warpgroup)
    with_groups(nj, [&](auto g) { launch_bf16<decltype(g)::value>(a, grid, st); });
  else if (nj == 8)
    launch_wgmma<8>(a, grid, st);
  else
    launch_wgmma<16>(a, grid, st);
  check_launch(warpgroup ? "mmq wgmma" : "mmq bf16");
  if (!direct) mmq_reduce(a, mode, m, splits, st);
}

void mmq(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, const int8_t* xq,
         const float* xd, int64_t n, int64_t splits, float* part, cudaStream_t st) {
  if (n == 0) return;
  const bool direct = mmq_direct(ws, nw, mode, splits);
  Args a = mmq_args(ws, ys, nw, mode, m, n, splits, part, direct);
  a.xq = reinterpret_cast<const int2*>(xq);
  a.xd = xd;
  const int nj = groups_per_tile(a.groups);
  const dim3 grid(unsigned(a.rows / kTileRows), unsigned((a.groups + nj - 1) / nj), unsigned(splits));
  launch(a, ws[0].type, nj, grid, st);
  check_launch("mmq");
  if (!direct) mmq_reduce(a, mode, m, splits, st);
}

int64_t moe_tiled_rows(int64_t pairs, int64_t E) { return tiled_x_rows(pairs + 7 * std::min(pairs, E)); }
int moe_tile_groups(int64_t pairs, int64_t E) {
  // An expert's pairs vary around the mean: groups for 1.5 times it, a power of two up to 8.
  return groups_per_tile((3 * pairs / std::max<int64_t>(2 * E, 1) + 7) / 8);
}
int64_t moe_max_tiles(int64_t pairs, int64_t E) {
  const int64_t tile = 8 * moe_tile_groups(pairs, E);
  return std::min(pairs, (pairs + tile - 1) / tile + E);
}

void moe_tiles(const int32_t* experts, int64_t pairs, int64_t E, int32_t* row_pair, int32_t* tiles, int32_t* n_tiles,
               cudaStream_t st) {
  launch_kernel(k_moe_tiles, 1u, 1024, size_t(3 * E) * sizeof(int), st, experts, pairs, int(E),
                moe_tiled_rows(pairs, E), 8 * moe_tile_groups(pairs, E), row_pair, reinterpret_cast<int4*>(tiles),
                n_tiles);
  check_launch("moe tiles");
}

void mmq_experts(const GpuWeight& w, int64_t rows_per_expert, int64_t pairs, int64_t E, const int8_t* xq,
                 const float* xd, const int32_t* tiles, const int32_t* n_tiles, const int32_t* row_pair, bool glu,
                 float* y, cudaStream_t st) {
  const int64_t max_tiles = moe_max_tiles(pairs, E);
  if (max_tiles == 0) return;
  Args a;
  a.w[0] = w;
  a.rows = rows_per_expert;
  a.xq = reinterpret_cast<const int2*>(xq);
  a.xd = xd;
  a.nkb = w.cols / 32;
  a.tiles = reinterpret_cast<const int4*>(tiles);
  a.n_tiles = n_tiles;
  a.row_out = row_pair;
  a.kb_per_split = a.nkb;
  a.y[0] = y;
  a.glu = glu;
  launch(a, w.type, moe_tile_groups(pairs, E), dim3(unsigned(rows_per_expert / kTileRows), unsigned(max_tiles), 1u),
         st);
  check_launch("mmq experts");
}

}  // namespace mb::cuda
