// Matrix-vector products for decode (a few activation rows against a weight read once from memory,
// dequantized in registers) and the conversions that feed cuBLAS for larger products.
//
// Hand-written because no library does this part: cuBLAS has no block-quantized types, and a
// GEMV is memory-bound, so its speed is how close the weight stream gets to the memory bandwidth.
// Layout: a warp per weight row; its lanes walk the row in units (8 elements of F32/BF16, a
// 32-element block of Q8_0/Q4_0, a 64-element half of a Q4_K sub-block pair), each unit one or two
// 16-byte loads; the block types take int8 activations (QuantX) and __dp4a dot products.
#include <algorithm>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_kernels.h"

namespace mb::cuda {

namespace {

constexpr int kWarps = 8;  // rows per block

__device__ __forceinline__ int4 ld_stream(const void* p) { return __ldcs(static_cast<const int4*>(p)); }
// Activations may sit in shared memory (quantized by the block) or global memory: a generic load.
__device__ __forceinline__ int4 ld_x(const void* p) { return *static_cast<const int4*>(p); }
__device__ __forceinline__ float bf16r(float f) { return bf16_f32(f32_bf16(f)); }

// Unit u of weight row `row`: load() reads its weight bytes (one or two 16-byte loads), dot()
// adds its products with each of NX activation rows (x row j at x + j * k, or xq row j) into acc.
// Loads and products are separate so that a lane can put several units' loads in flight before
// it waits for the first: a GEMV is bound by how many bytes are in flight, not by arithmetic.
template <WType T>
struct Unit;

template <>
struct Unit<WType::F32> {
  static constexpr int kElems = 8;
  struct Raw {
    float4 a, b;
  };
  __device__ static Raw load(const GpuWeight& w, int64_t row, int64_t u) {
    const float* wp = static_cast<const float*>(w.qs) + row * w.cols + u * 8;
    return {__ldcs(reinterpret_cast<const float4*>(wp)), __ldcs(reinterpret_cast<const float4*>(wp + 4))};
  }
  template <int NX>
  __device__ static void dot(const Raw& r, int64_t cols, int64_t u, const float* x, const QuantX&, float* acc,
                             const int64_t* xrow) {
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      if (xrow[j] < 0) continue;
      const float* xp = x + xrow[j] * cols + u * 8;
      const float4 c = *reinterpret_cast<const float4*>(xp), d = *reinterpret_cast<const float4*>(xp + 4);
      acc[j] +=
          r.a.x * c.x + r.a.y * c.y + r.a.z * c.z + r.a.w * c.w + r.b.x * d.x + r.b.y * d.y + r.b.z * d.z + r.b.w * d.w;
    }
  }
};

template <>
struct Unit<WType::BF16> {
  static constexpr int kElems = 8;
  struct Raw {
    int4 q;
  };
  __device__ static Raw load(const GpuWeight& w, int64_t row, int64_t u) {
    return {ld_stream(static_cast<const uint16_t*>(w.qs) + row * w.cols + u * 8)};
  }
  template <int NX>
  __device__ static void dot(const Raw& r, int64_t cols, int64_t u, const float* x, const QuantX&, float* acc,
                             const int64_t* xrow) {
    const uint32_t q[4] = {uint32_t(r.q.x), uint32_t(r.q.y), uint32_t(r.q.z), uint32_t(r.q.w)};
    float wf[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      wf[2 * i] = __uint_as_float(q[i] << 16);
      wf[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
    }
    // The activations rounded to bf16 as the cuBLAS path (prefill, large batches) rounds them, so
    // a token's numbers do not depend on which path its batch took.
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      if (xrow[j] < 0) continue;
      const float* xp = x + xrow[j] * cols + u * 8;
      const float4 c = *reinterpret_cast<const float4*>(xp), d = *reinterpret_cast<const float4*>(xp + 4);
      acc[j] += wf[0] * bf16r(c.x) + wf[1] * bf16r(c.y) + wf[2] * bf16r(c.z) + wf[3] * bf16r(c.w) + wf[4] * bf16r(d.x) +
                wf[5] * bf16r(d.y) + wf[6] * bf16r(d.z) + wf[7] * bf16r(d.w);
    }
  }
};

template <>
struct Unit<WType::Q8_0> {
  static constexpr int kElems = 32;
  struct Raw {
    int4 a, b;
    float d;
  };
  __device__ static Raw load(const GpuWeight& w, int64_t row, int64_t u) {
    const int64_t nb = w.cols / 32;
    const int8_t* qp = static_cast<const int8_t*>(w.qs) + (row * nb + u) * 32;
    return {ld_stream(qp), ld_stream(qp + 16), half_f32(w.scale[row * nb + u])};
  }
  template <int NX>
  __device__ static void dot(const Raw& r, int64_t, int64_t u, const float*, const QuantX& xq, float* acc,
                             const int64_t* xrow) {
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      if (xrow[j] < 0) continue;
      const int8_t* xp = xq.q + xrow[j] * xq.k + u * 32;
      const int4 c = ld_x(xp), d = ld_x(xp + 16);
      int s = __dp4a(r.a.x, c.x, 0);
      s = __dp4a(r.a.y, c.y, s);
      s = __dp4a(r.a.z, c.z, s);
      s = __dp4a(r.a.w, c.w, s);
      s = __dp4a(r.b.x, d.x, s);
      s = __dp4a(r.b.y, d.y, s);
      s = __dp4a(r.b.z, d.z, s);
      s = __dp4a(r.b.w, d.w, s);
      acc[j] += r.d * xq.d[xrow[j] * (xq.k / 32) + u] * float(s);
    }
  }
};

template <>
struct Unit<WType::Q4_0> {
  static constexpr int kElems = 32;
  struct Raw {
    int4 a;
    float d;
  };
  __device__ static Raw load(const GpuWeight& w, int64_t row, int64_t u) {
    const int64_t nb = w.cols / 32;
    return {ld_stream(static_cast<const uint8_t*>(w.qs) + (row * nb + u) * 16), half_f32(w.scale[row * nb + u])};
  }
  template <int NX>
  __device__ static void dot(const Raw& r, int64_t, int64_t u, const float*, const QuantX& xq, float* acc,
                             const int64_t* xrow) {
    const int lo[4] = {r.a.x & 0x0F0F0F0F, r.a.y & 0x0F0F0F0F, r.a.z & 0x0F0F0F0F, r.a.w & 0x0F0F0F0F};
    const int hi[4] = {(r.a.x >> 4) & 0x0F0F0F0F, (r.a.y >> 4) & 0x0F0F0F0F, (r.a.z >> 4) & 0x0F0F0F0F,
                       (r.a.w >> 4) & 0x0F0F0F0F};
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      if (xrow[j] < 0) continue;
      const int8_t* xp = xq.q + xrow[j] * xq.k + u * 32;
      const int4 c = ld_x(xp), d = ld_x(xp + 16);
      int s = __dp4a(lo[0], c.x, 0);
      s = __dp4a(lo[1], c.y, s);
      s = __dp4a(lo[2], c.z, s);
      s = __dp4a(lo[3], c.w, s);
      s = __dp4a(hi[0], d.x, s);
      s = __dp4a(hi[1], d.y, s);
      s = __dp4a(hi[2], d.z, s);
      s = __dp4a(hi[3], d.w, s);
      const int64_t xb = xrow[j] * (xq.k / 32) + u;
      acc[j] += r.d * (xq.d[xb] * float(s) - 8.f * xq.s[xb]);
    }
  }
};

template <>
struct Unit<WType::Q4_K> {
  static constexpr int kElems = 64;
  struct Raw {
    int4 head, qa, qb;  // head: d, dmin, 12 scale bytes
  };
  __device__ static Raw load(const GpuWeight& w, int64_t row, int64_t u) {
    const int64_t nsb = w.cols / 256, sb = u / 4;
    const int pair = int(u % 4);
    const uint8_t* blk = static_cast<const uint8_t*>(w.qs) + (row * nsb + sb) * 144;
    return {__ldg(reinterpret_cast<const int4*>(blk)), ld_stream(blk + 16 + pair * 32),
            ld_stream(blk + 16 + pair * 32 + 16)};
  }
  template <int NX>
  __device__ static void dot(const Raw& r, int64_t, int64_t u, const float*, const QuantX& xq, float* acc,
                             const int64_t* xrow) {
    const int64_t sb = u / 4;
    const int pair = int(u % 4);
    const uint32_t h0 = uint32_t(r.head.x);
    const float d = half_f32(uint16_t(h0 & 0xffff)), dmin = half_f32(uint16_t(h0 >> 16));
    uint8_t sc[12];
    const uint32_t hw[3] = {uint32_t(r.head.y), uint32_t(r.head.z), uint32_t(r.head.w)};
#pragma unroll
    for (int i = 0; i < 12; ++i) sc[i] = uint8_t(hw[i / 4] >> (8 * (i % 4)));
    float scale[2], mins[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int s, m;
      q4k_scale_min(sc, 2 * pair + h, s, m);
      scale[h] = d * float(s);
      mins[h] = dmin * float(m);
    }
    const int q[8] = {r.qa.x, r.qa.y, r.qa.z, r.qa.w, r.qb.x, r.qb.y, r.qb.z, r.qb.w};
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      if (xrow[j] < 0) continue;
      const int64_t xb = xrow[j] * (xq.k / 32) + sb * 8 + 2 * pair;  // first of the two x blocks
      const int8_t* xp = xq.q + xb * 32;
      const int4 c0 = ld_x(xp), c1 = ld_x(xp + 16), c2 = ld_x(xp + 32), c3 = ld_x(xp + 48);
      const int xa[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const int xbv[8] = {c2.x, c2.y, c2.z, c2.w, c3.x, c3.y, c3.z, c3.w};
      int s0 = 0, s1 = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s0 = __dp4a(q[i] & 0x0F0F0F0F, xa[i], s0);
        s1 = __dp4a((q[i] >> 4) & 0x0F0F0F0F, xbv[i], s1);
      }
      acc[j] += scale[0] * xq.d[xb] * float(s0) - mins[0] * xq.s[xb] + scale[1] * xq.d[xb + 1] * float(s1) -
                mins[1] * xq.s[xb + 1];
    }
  }
};

// Units a lane loads before it multiplies: ~128 bytes of weights in flight per lane and dot.
template <WType T>
__host__ __device__ constexpr int batch_units() {
  return T == WType::Q4_0 ? 8 : T == WType::Q4_K ? 2 : 4;
}

// The dots of `nd` weight rows (wr[i], rr[i]) with NX activation rows over a warp: each lane
// takes units lane, lane + 32, ... in batches of B, every load of a batch issued first.
// waiting (the weights are fixed and pdl_begin has not come yet): the first batch's loads go out
// before pdl_begin, which comes here, so they overlap the kernels this one waits for (a decode
// GEMV's rows are often a single batch).
template <WType T, int NX, int ND>
__device__ __forceinline__ void warp_dots(const GpuWeight (&wr)[ND], const int64_t (&rr)[ND], int64_t cols,
                                          const float* x, const QuantX& xq, const int64_t* xrow, int lane,
                                          bool& waiting, float (&acc)[ND][NX]) {
  using U = Unit<T>;
  constexpr int B = batch_units<T>() / ND > 0 ? batch_units<T>() / ND : 1;
  const int64_t units = cols / U::kElems;
  for (int64_t u0 = lane; u0 < units; u0 += 32 * B) {
    typename U::Raw raw[ND][B];
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int i = 0; i < ND; ++i)
        if (u0 + 32 * b < units) raw[i][b] = U::load(wr[i], rr[i], u0 + 32 * b);
    if (waiting) {
      pdl_begin();
      waiting = false;
    }
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int i = 0; i < ND; ++i)
        if (u0 + 32 * b < units) U::template dot<NX>(raw[i][b], cols, u0 + 32 * b, x, xq, acc[i], xrow);
  }
  if (waiting) {
    pdl_begin();
    waiting = false;
  }
}

// Up to 3 weights applied to the same activation rows in one launch (Q/K/V), or a gate and an up
// weight whose results meet in gelu_tanh(gate) * up (GLU). A warp takes one row of the weights'
// rows laid end to end (GLU: that row of both). Block types read int8 activations (quantize_x).
struct MultiArgs {
  GpuWeight w[3];
  float* y[3];
  int nw = 1;
  int64_t total_rows = 0;
  const float* x = nullptr;
  QuantX xq;  // the activations quantized (block types)
  int64_t n = 0, k = 0;
  const float* m = nullptr;  // kGeluTimes: y = gelu_tanh(x · wᵀ) * m, m [n, rows]
  int early = 0;             // every weight is fixed: the first loads go before pdl_begin
};

// Kernel parameters indexed at run time would be copied to local memory: select with constants.
__device__ __forceinline__ const GpuWeight& pick_w(const MultiArgs& a, int i) {
  return i == 0 ? a.w[0] : i == 1 ? a.w[1] : a.w[2];
}
__device__ __forceinline__ float* pick_y(const MultiArgs& a, int i) {
  return i == 0 ? a.y[0] : i == 1 ? a.y[1] : a.y[2];
}
__device__ __forceinline__ int64_t pick_rows(const MultiArgs& a, int i) {
  return i == 0 ? a.w[0].rows : i == 1 ? a.w[1].rows : a.w[2].rows;
}

constexpr int kPlain = 0, kGlu = 1, kGeluTimes = 2;

// A warp takes rows v, v + stride, ... of the weights' rows laid end to end (GLU: that row of
// both); the grid is at most gemv_resident_waves() times what the GPU holds at once, so warps stay
// resident instead of a block retiring and launching per 8 rows.
template <WType T, int NX, int MODE>
__global__ void __launch_bounds__(kWarps * 32) k_gemv_multi(MultiArgs a) {
  constexpr bool GLU = MODE == kGlu;
  constexpr int ND = GLU ? 2 : 1;
  bool waiting = a.early;
  if (!waiting) pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t xrow[NX];
#pragma unroll
  for (int j = 0; j < NX; ++j) xrow[j] = j < a.n ? j : -1;
  const int64_t stride = int64_t(gridDim.x) * kWarps;
  for (int64_t v = int64_t(blockIdx.x) * kWarps + warp; v < a.total_rows; v += stride) {
    GpuWeight wr[ND];
    int64_t rr[ND];
    int wi = 0;
    int64_t row = v;
    if (GLU) {
      wr[0] = a.w[0];
      rr[0] = v;
      wr[ND - 1] = a.w[1];
      rr[ND - 1] = v;
    } else {
      while (wi + 1 < a.nw && row >= pick_rows(a, wi)) row -= pick_rows(a, wi++);
      wr[0] = pick_w(a, wi);
      rr[0] = row;
    }
    float acc[ND][NX];
#pragma unroll
    for (int i = 0; i < ND; ++i)
#pragma unroll
      for (int j = 0; j < NX; ++j) acc[i][j] = 0.f;
    warp_dots<T, NX, ND>(wr, rr, a.k, a.x, a.xq, xrow, lane, waiting, acc);
#pragma unroll
    for (int i = 0; i < ND; ++i)
#pragma unroll
      for (int j = 0; j < NX; ++j) acc[i][j] = warp_sum(acc[i][j]);
    if (lane != 0) continue;
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      if (j >= a.n) break;
      if (GLU) {
        a.y[0][j * a.total_rows + v] = gelu_tanh(acc[0][j]) * acc[ND - 1][j];
      } else if (MODE == kGeluTimes) {
        a.y[0][j * a.total_rows + v] = gelu_tanh(acc[0][j]) * a.m[j * a.total_rows + v];
      } else {
        pick_y(a, wi)[j * pick_rows(a, wi) + row] = acc[0][j];
      }
    }
  }
}

// Odd shapes (F32/BF16 rows that are not a multiple of 8 elements): one element at a time.
__global__ void k_gemv_scalar(GpuWeight w, const float* x, int64_t n, float* y) {
  pdl_begin();
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= w.rows) return;
  for (int64_t j = 0; j < n; ++j) {
    float acc = 0.f;
    for (int64_t c = lane; c < w.cols; c += 32) acc += weight_at(w, row, c) * x[j * w.cols + c];
    acc = warp_sum(acc);
    if (lane == 0) y[j * w.rows + row] = acc;
  }
}

// Pair p: y[p, r] = W[ids[p] * rpe + r] · x[p / k or p]. GLU (rpe = 2I, y [pairs, I]): a warp takes gate row r
// and up row r + I of its expert and writes gelu_tanh(gate) * up, so the [pairs, 2I] products never leave the SM
// and both rows' loads are in flight together (warp_dots with two rows, the same sums in the same lane order).
template <WType T, bool GLU>
__global__ void __launch_bounds__(kWarps * 32) k_moe_gemv(GpuWeight w, int64_t rpe, const float* x, QuantX xq,
                                                          const int32_t* ids, int k, int x_per_pair, float* y) {
  pdl_begin();
  constexpr int ND = GLU ? 2 : 1;
  const int64_t out_rows = GLU ? rpe / 2 : rpe;
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t p = blockIdx.y;
  const int lane = threadIdx.x % 32;
  if (r >= out_rows) return;
  const int64_t row = int64_t(ids[p]) * rpe + r;
  const int64_t xrow[1] = {x_per_pair ? p : p / k};
  GpuWeight wr[ND];
  int64_t rr[ND];
  float acc[ND][1];
#pragma unroll
  for (int i = 0; i < ND; ++i) {
    wr[i] = w;
    rr[i] = row + i * out_rows;
    acc[i][0] = 0.f;
  }
  bool waiting = false;
  warp_dots<T, 1, ND>(wr, rr, w.cols, x, xq, xrow, lane, waiting, acc);
  const float g = warp_sum(acc[0][0]);
  if constexpr (GLU) {
    const float u = warp_sum(acc[ND - 1][0]);
    if (lane == 0) y[p * out_rows + r] = gelu_tanh(g) * u;
  } else {
    if (lane == 0) y[p * out_rows + r] = g;
  }
}

__global__ void k_dequant_bf16(GpuWeight w, int64_t row0, int64_t rows, uint16_t* out) {
  pdl_begin();
  const int64_t total = rows * w.cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / w.cols, c = i % w.cols;
    if (w.type == WType::BF16)
      out[i] = static_cast<const uint16_t*>(w.qs)[(row0 + r) * w.cols + c];
    else
      out[i] = f32_bf16(weight_at(w, row0 + r, c));
  }
}

// Q8_0 and Q4_0 rows to bf16, eight values a thread: one 8-byte load of quants and a 16-byte store, no division
// (k_dequant_bf16 above takes a 64-bit division and a 2-byte store a value: E4B Q4_0 without bf16 copies, every
// product on dequantized slabs, prefilled 512 tokens at 15,157 tok/s with it and 26,844 with this on an H100).
// A block's 32 values are four units; Q4_0's unit u takes bytes (u % 2) * 8 .. +8 of the block, low nibbles for
// u < 2, high for u >= 2 (values j and j + 16 share byte j). The same expression as weight_at, so the same bits.
template <WType T>
__global__ void k_dequant_blocks_bf16(GpuWeight w, int64_t block0, int64_t units, uint4* out) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < units; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = block0 + i / 4;
    const int u = int(i % 4);
    const float d = half_f32(w.scale[b]);
    float v[8];
    if constexpr (T == WType::Q8_0) {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const int8_t*>(w.qs) + b * 32 + u * 8);
      const int8_t* q = reinterpret_cast<const int8_t*>(&raw);
      for (int e = 0; e < 8; ++e) v[e] = float(q[e]) * d;
    } else {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w.qs) + b * 16 + (u % 2) * 8);
      const uint8_t* q = reinterpret_cast<const uint8_t*>(&raw);
      for (int e = 0; e < 8; ++e) v[e] = float((u < 2 ? q[e] & 15 : q[e] >> 4) - 8) * d;
    }
    out[i] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
  }
}

// Blocks of `Kernel` the GPU holds at once (the occupancy calculator's figure, asked once per
// kernel: keyed by the kernel itself, as kernels of one signature differ in registers).
template <auto Kernel> int64_t resident_blocks() {
  static const int64_t n = [] {
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kWarps * 32, 0);
    return int64_t(sm_count()) * std::max(per_sm, 1);
  }();
  return n;
}

template <WType T, int NX, int MODE>
void launch_multi_mode(const MultiArgs& a, cudaStream_t st) {
  int64_t grid = (a.total_rows + kWarps - 1) / kWarps;
  const int waves = gemv_resident_waves();
  if (waves > 0) grid = std::min(grid, waves * resident_blocks<k_gemv_multi<T, NX, MODE>>());
  launch_kernel(k_gemv_multi<T, NX, MODE>, unsigned(grid), kWarps * 32, 0, st, a);
}

template <WType T, int NX>
void launch_multi(const MultiArgs& a, int mode, cudaStream_t st) {
  if (mode == kGlu)
    launch_multi_mode<T, NX, kGlu>(a, st);
  else if (mode == kGeluTimes)
    launch_multi_mode<T, NX, kGeluTimes>(a, st);
  else
    launch_multi_mode<T, NX, kPlain>(a, st);
}

template <WType T>
void launch_multi_nx(const MultiArgs& a, int mode, cudaStream_t st) {
  if (a.n == 1)
    launch_multi<T, 1>(a, mode, st);
  else if (a.n == 2)
    launch_multi<T, 2>(a, mode, st);
  else if (a.n <= 4)
    launch_multi<T, 4>(a, mode, st);
  else
    launch_multi<T, 8>(a, mode, st);
}

}  // namespace

namespace {

void gemv_any(const GpuWeight* ws, float* const* ys, int nw, int mode, const float* m, const float* x, const QuantX* xq,
              int64_t n, cudaStream_t st) {
  if (n == 0) return;
  const bool glu = mode == kGlu;
  const WType t = ws[0].type;
  const int64_t k = ws[0].cols;
  for (int64_t j0 = 0; j0 < n; j0 += kGemvMaxRows) {
    MultiArgs a;
    a.nw = nw;
    a.k = k;
    a.n = n - j0 < kGemvMaxRows ? n - j0 : kGemvMaxRows;
    a.total_rows = 0;
    a.early = gemv_early_loads();
    for (int i = 0; i < nw; ++i) {
      a.early = a.early && ws[i].fixed;
      a.w[i] = ws[i];
      a.y[i] = ys[glu ? 0 : i] + j0 * (glu ? ws[0].rows : ws[i].rows);
      if (!glu) a.total_rows += ws[i].rows;
    }
    if (glu) a.total_rows = ws[0].rows;
    a.x = x ? x + j0 * k : nullptr;
    a.m = m ? m + j0 * ws[0].rows : nullptr;
    if (xq && xq->q) {
      a.xq = *xq;
      a.xq.q += j0 * k;
      a.xq.d += j0 * (k / 32);
      a.xq.s += j0 * (k / 32);
    }
    switch (t) {
      case WType::F32:
        launch_multi_nx<WType::F32>(a, mode, st);
        break;
      case WType::BF16:
        launch_multi_nx<WType::BF16>(a, mode, st);
        break;
      case WType::Q8_0:
        launch_multi_nx<WType::Q8_0>(a, mode, st);
        break;
      case WType::Q4_0:
        launch_multi_nx<WType::Q4_0>(a, mode, st);
        break;
      case WType::Q4_K:
        launch_multi_nx<WType::Q4_K>(a, mode, st);
        break;
    }
  }
  check_launch("gemv");
}

}  // namespace

void gemv_multi(const GpuWeight* ws, float* const* ys, int nw, bool glu, const float* x, const QuantX* xq, int64_t n,
                cudaStream_t st) {
  gemv_any(ws, ys, nw, glu ? kGlu : kPlain, nullptr, x, xq, n, st);
}

void gemv_gelu_times(const GpuWeight& w, const float* x, const QuantX* xq, int64_t n, const float* m, float* y,
                     cudaStream_t st) {
  gemv_any(&w, &y, 1, kGeluTimes, m, x, xq, n, st);
}

void gemv(const GpuWeight& w, const float* x, const QuantX* xq, int64_t n, float* y, cudaStream_t st) {
  if (n == 0 || w.rows == 0) return;
  if ((w.type == WType::F32 || w.type == WType::BF16) && w.cols % 8 != 0) {
    launch_kernel(k_gemv_scalar, unsigned((w.rows + kWarps - 1) / kWarps), kWarps * 32, 0, st, w, x, n, y);
    check_launch("gemv");
    return;
  }
  gemv_multi(&w, &y, 1, false, x, xq, n, st);
}

template <bool GLU>
void launch_moe_gemv(const GpuWeight& w, dim3 grid, int64_t rows_per_expert, const float* x, const QuantX& xq,
                     const int32_t* ids, int k, bool x_per_pair, float* h, cudaStream_t st) {
  auto launch = [&](auto kernel) {
    launch_kernel(kernel, grid, kWarps * 32, 0, st, w, rows_per_expert, x, xq, ids, k, int(x_per_pair), h);
  };
  switch (w.type) {
    case WType::F32: launch(k_moe_gemv<WType::F32, GLU>); break;
    case WType::BF16: launch(k_moe_gemv<WType::BF16, GLU>); break;
    case WType::Q8_0: launch(k_moe_gemv<WType::Q8_0, GLU>); break;
    case WType::Q4_0: launch(k_moe_gemv<WType::Q4_0, GLU>); break;
    case WType::Q4_K: launch(k_moe_gemv<WType::Q4_K, GLU>); break;
  }
}

void moe_gemv(const GpuWeight& w, int64_t rows_per_expert, const float* x, const QuantX* xq, const int32_t* ids,
              int64_t pairs, int k, bool x_per_pair, bool glu, float* h, cudaStream_t st) {
  if (pairs == 0) return;
  const int64_t out_rows = glu ? rows_per_expert / 2 : rows_per_expert;
  const dim3 grid(unsigned((out_rows + kWarps - 1) / kWarps), unsigned(pairs));
  const QuantX none{};
  const QuantX& q = w.type == WType::F32 || w.type == WType::BF16 ? none : *xq;
  if (glu)
    launch_moe_gemv<true>(w, grid, rows_per_expert, x, q, ids, k, x_per_pair, h, st);
  else
    launch_moe_gemv<false>(w, grid, rows_per_expert, x, q, ids, k, x_per_pair, h, st);
  check_launch("moe gemv");
}

void dequant_bf16(const GpuWeight& w, int64_t row0, int64_t rows, uint16_t* out, cudaStream_t st) {
  const int64_t total = rows * w.cols;
  if (total == 0) return;
  if ((w.type == WType::Q8_0 || w.type == WType::Q4_0) && w.cols % 32 == 0 &&
      reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    const int64_t units = total / 8, grid = std::min<int64_t>((units + 255) / 256, int64_t(sm_count()) * 16);
    const int64_t block0 = row0 * (w.cols / 32);
    if (w.type == WType::Q8_0)
      launch_kernel(k_dequant_blocks_bf16<WType::Q8_0>, unsigned(grid), 256, 0, st, w, block0, units,
                    reinterpret_cast<uint4*>(out));
    else
      launch_kernel(k_dequant_blocks_bf16<WType::Q4_0>, unsigned(grid), 256, 0, st, w, block0, units,
                    reinterpret_cast<uint4*>(out));
    check_launch("dequantize blocks to bf16");
    return;
  }
  int64_t blocks = (total + 255) / 256;
  if (blocks > 65535 * 16) blocks = 65535 * 16;
  launch_kernel(k_dequant_bf16, unsigned(blocks), 256, 0, st, w, row0, rows, out);
  check_launch("dequantize to bf16");
}

}  // namespace mb::cuda
