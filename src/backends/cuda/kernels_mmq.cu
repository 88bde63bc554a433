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
  asm volatile(
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

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

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
template <int NJ, int CH>
__device__ __forceinline__ void mma_groups(float (&acc)[NJ][4], const uint32_t (&af)[4], float sa, float sb,
                                           const int2* sq, const float* sd, int blk, int ng, int lane) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (j >= ng) break;
    const int at = j * CH + blk;
    const int2 b = sq[at * 32 + lane];
    const float2 s = *reinterpret_cast<const float2*>(&sd[at * 8 + 2 * (lane % 4)]);
    int p[4] = {0, 0, 0, 0};
    mma_s8(p, af, b);
    acc[j][0] += small_int_f32(p[0]) * (sa * s.x);
    acc[j][1] += small_int_f32(p[1]) * (sa * s.y);
    acc[j][2] += small_int_f32(p[2]) * (sb * s.x);
    acc[j][3] += small_int_f32(p[3]) * (sb * s.y);
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

// The activation groups of the block (read after the wait: experts' tiles are made on the device):
// experts - its tile's (expert, first row, rows), which also moves wrow into the expert's rows
// (false: no tile for this block); dense - the groups of blockIdx.y.
template <int NJ>
__device__ __forceinline__ bool block_groups(const Args& a, int64_t& wrow, int64_t& g0, int& ng) {
  if (a.tiles) {
    if (int(blockIdx.y) >= *a.n_tiles) return false;
    const int4 t = a.tiles[blockIdx.y];
    wrow += int64_t(t.x) * a.rows;
    g0 = t.y / 8;
    ng = (t.z + 7) / 8;
  } else {
    g0 = int64_t(blockIdx.y) * NJ;
    ng = int(a.groups - g0 < NJ ? a.groups - g0 : NJ);
  }
  return true;
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
#pragma unroll
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
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
        mma_groups<NJ, kChunk>(acc, f[u].a, f[u].sa, f[u].sb, sq[buf], sd[buf], u0 + u, ng, lane);
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
  // wrow: the block's first row in weight wi, warp w's 16 rows from wrow + 16 w (glu: the warps'
  // pairs on the same 32 rows of gate and up)
  int64_t wrow = tile_row;
  int wi = 0;
  if (a.glu) {  // experts: gate and up are an expert's two halves of one weight
    wi = a.tiles ? 0 : warp / 2;
    wrow = int64_t(blockIdx.x) * 32 + (warp / 2) * ((a.tiles ? a.rows / 2 : 0) - 32);
  } else {
    wi = weight_of_rows(a, wrow);
  }
  const GpuWeight& w0 = pick_w(a, wi);
  const int64_t nb = w0.cols / 32, nkp = (nb + 1) / 2;
  const int64_t kb0 = int64_t(blockIdx.z) * a.kb_per_split, kb1 = min(nb, kb0 + a.kb_per_split);
  const int64_t kp1 = (kb1 + 1) / 2;
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
#pragma unroll
  for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
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
#pragma unroll
    for (int u = 0; u < kPairs; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (2 * u + h >= kc) break;
        uint32_t af[4];
        float sa, sb;
        pair_block<T>(cur[u], h, af, sa, sb);
        mma_groups<NJ, kCh>(acc, af, sa, sb, sq[buf], sd[buf], 2 * u + h, ng, lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kPairs; ++u) cur[u] = nxt[u];
    __syncthreads();
  }
  if (a.glu)
    store_glu<NJ>(a, acc, reinterpret_cast<float*>(&sq[0][0]), g0, ng, warp, lane);
  else
    store_tile<NJ>(a, acc, tile_row, wi, g0, ng, warp, lane);
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
template <WType T>
void launch_t(const Args& a, int nj, dim3 grid, cudaStream_t st) {
  if (nj == 1)
    launch_nj<T, 1>(a, grid, st);
  else if (nj == 2)
    launch_nj<T, 2>(a, grid, st);
  else if (nj <= 4)
    launch_nj<T, 4>(a, grid, st);
  else
    launch_nj<T, 8>(a, grid, st);
}
void launch(const Args& a, WType t, int nj, dim3 grid, cudaStream_t st) {
  if (t == WType::Q4_0)
    launch_t<WType::Q4_0>(a, nj, grid, st);
  else
    launch_t<WType::Q8_0>(a, nj, grid, st);
}

int sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return std::max(sms, 1);
  }();
  return n;
}

int groups_per_tile(int64_t groups) {
  return groups <= 1 ? 1 : groups <= 2 ? 2 : groups <= 4 ? 4 : kMaxGroups;
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

int64_t mmq_splits(const GpuWeight* ws, int nw, int64_t n) {
  int64_t rows = 0;
  for (int i = 0; i < nw; ++i) rows += ws[i].rows;
  const int64_t groups = (n + 7) / 8, nj = groups_per_tile(groups);
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

void mmq(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, const int8_t* xq,
         const float* xd, int64_t n, int64_t splits, float* part, cudaStream_t st) {
  if (n == 0) return;
  Args a;
  a.nw = nw;
  for (int i = 0; i < nw; ++i) {
    a.w[i] = ws[i];
    a.rows += ws[i].rows;
    a.y[i] = ys[mode == MmqMode::Plain ? i : 0];
  }
  a.xq = reinterpret_cast<const int2*>(xq);
  a.xd = xd;
  a.nkb = ws[0].cols / 32;
  a.n = n;
  a.groups = (n + 7) / 8;
  a.kb_per_split = ((a.nkb + splits - 1) / splits + 3) / 4 * 4;  // whole quads of blocks
  const bool direct = mmq_direct(ws, nw, mode, splits);
  a.part = direct ? nullptr : part;
  if (direct) {
    a.glu = mode == MmqMode::Glu;
    a.m = mode == MmqMode::GeluTimes ? m : nullptr;
  }
  const int nj = groups_per_tile(a.groups);
  const dim3 grid(unsigned(a.rows / kTileRows), unsigned((a.groups + nj - 1) / nj), unsigned(splits));
  launch(a, ws[0].type, nj, grid, st);
  check_launch("mmq");
  if (direct) return;
  const int64_t out = n * (mode == MmqMode::Glu ? ws[0].rows : a.rows);
  const int64_t blocks = std::min<int64_t>((out + 255) / 256, 8 * int64_t(sm_count()));
  launch_kernel(k_mmq_reduce, unsigned(blocks), 256, 0, st, a, int(splits), mode, m);
  check_launch("mmq reduce");
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
