// Device helpers shared by the kernel files.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "backends/cuda/cuda_kernels.h"

namespace mb::cuda {

// Throws mb::Error naming `what` when the last launch failed (cuda_backend.cpp).
void check_launch(const char* what);
// Throws mb::Error naming `what` when a runtime or library call returned an error.
void check_call(cudaError_t e, const char* what);

// Programmatic dependent launch (Hopper): each kernel of a step may be scheduled while the one
// before it drains, which hides most of the few microseconds a launch costs between small kernels
// (a decode step is hundreds of them). Every kernel calls pdl_begin() before it touches memory that
// an earlier kernel may write or read: it waits for the previous grid to finish and its writes to be
// visible, then lets the next grid be scheduled. Only weights (GpuWeight::fixed: never written after
// load) may be read before it - the GEMVs load their first weights there, so a matrix's fetch
// overlaps the kernels before it. Data that kernels write is never read through the non-coherent
// path (__ldg): a grid that is already resident while its predecessor writes breaks that path's
// read-only-for-the-kernel's-lifetime contract. MARKBASE_CUDA_PDL=0 launches plainly
// (cuda_backend.cpp).
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
bool pdl_enabled();
// Blocks of 256 threads for a grid-stride loop over n elements: one an element, at most 65535 * 8.
inline unsigned grid_1d(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return unsigned(b < 1 ? 1 : b > 65535 * 8 ? 65535 * 8 : b);
}
// cluster_z > 1: blocks in clusters of (1, 1, cluster_z), which grid.z must be a multiple of.
template <typename... Params, typename... Args>
void launch_kernel_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                             unsigned cluster_z, Args&&... args) {
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = 1;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = cluster_z;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  g_device_calls.fetch_add(1, std::memory_order_relaxed);
  // A failed launch leaves its error for check_launch, which every launcher calls next.
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  launch_kernel_clustered(kernel, grid, block, smem, st, 1u, std::forward<Args>(args)...);
}

__device__ __forceinline__ float bf16_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
// Round to nearest even, as the host's f32_to_bf16 (NaN kept).
__device__ __forceinline__ uint16_t f32_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// Two values as a bf16 pair in one word, lo in the low half (an mma fragment register's order).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return uint32_t(f32_bf16(lo)) | uint32_t(f32_bf16(hi)) << 16;
}
// pack_bf16 by the hardware's conversion (one instruction a pair): the same bits for every value but NaN.
__device__ __forceinline__ uint32_t pack_bf16_rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 2^x by the special-function unit alone (exp2f adds the steps for results below 2^-126, which this flushes).
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// What bf16 h of v left out, as a second bf16 (v ~ h + remainder to 16 bits of mantissa).
__device__ __forceinline__ uint16_t bf16_remainder(float v, uint16_t h) { return f32_bf16(v - bf16_f32(h)); }
// 16 bytes from global to shared memory without the registers (through L2, so data the kernels before wrote
// is seen), or zeros where bytes is 0; commit_group closes a group, wait<N> waits for all but the N latest.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16_or_zeros(void* smem, const void* gmem, int bytes) {
  const uint32_t d = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// c += a · b on the tensor cores: a 16 x 16 bf16 A fragment (row-major), a 16 x 8 B fragment (column-major),
// f32 sums (PTX's m16n8k16 fragment layouts).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint2 b) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}
// Four 8 x 8 bf16 matrices from shared memory, lanes 8i..8i+7 giving the 16-byte rows of matrix i; r[i] holds
// matrix i in the mma fragment layout (lane 4g + c: row g, columns 2c and 2c + 1), or with .trans its transpose
// (row 2c and 2c + 1, column g): a B fragment's k pairs from rows that hold n.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ float half_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// The clamp and SiLU of the clamp/silu ops and of a clipped linear's fused passes (one expression, the same bits).
__device__ __forceinline__ float clamp_f(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }

__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi), as torch's gelu(approximate="tanh")
  return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
}

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A block of 32 activations held one per lane to int8: symmetric, scale d = amax / 127. Every
// path that quantizes activations (quantize_x, the norms that quantize what they write, the
// tensor-core products' tile_x) goes through it, so a row's int8 input is the same on each.
__device__ __forceinline__ int quantize_lane(float v, float& d) {
  const float amax = warp_max(fabsf(v));
  d = amax / 127.f;
  return amax == 0.f ? 0 : __float2int_rn(v / d);
}

// Where element e (row e / cols, column e % cols; cols a multiple of 32) lies in the block products'
// tiled activations (tile_x in kernels_mmq.cu): its byte in q (qi) and its block's scale in d (di).
__device__ __forceinline__ void tiled_at(int64_t e, int64_t cols, int64_t& qi, int64_t& di) {
  const int64_t r = e / cols, c = e % cols, blk = r / 8 * (cols / 32) + c / 32;
  const int t = int(r % 8), w = int(c % 32);
  qi = (blk * 32 + t * 4 + (w % 16) / 4) * 8 + (w / 16) * 4 + w % 4;
  di = blk * 8 + t;
}

// quantize32 for a block of 32 held four to a lane by 8 lanes (lanes 8g..8g+7 of a warp, element
// e0 = the lane's first, a multiple of 4): the same numbers (the max and the integer sum do not
// depend on the order they are formed in). Every lane of the warp calls it; lanes with !write
// (past a row's end, in whole groups of 8) only take part in the shuffles.
__device__ __forceinline__ void quantize32_quad(const float (&v)[4], int64_t e0, bool write, int8_t* q, float* d,
                                                float* s, int64_t tiled_cols = 0) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float dd = amax / 127.f;
  int qi[4];
  float qs = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    qi[i] = amax == 0.f ? 0 : __float2int_rn(v[i] / dd);
    qs += float(qi[i]);
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) qs += __shfl_xor_sync(0xffffffffu, qs, o);
  if (!write) return;
  if (tiled_cols) {
    int64_t at, di;
    tiled_at(e0, tiled_cols, at, di);
    *reinterpret_cast<char4*>(q + at) = make_char4(char(qi[0]), char(qi[1]), char(qi[2]), char(qi[3]));
    if (threadIdx.x % 8 == 0) d[di] = dd;
    return;
  }
  *reinterpret_cast<char4*>(q + e0) = make_char4(char(qi[0]), char(qi[1]), char(qi[2]), char(qi[3]));
  if (threadIdx.x % 8 == 0) {
    d[e0 / 32] = dd;
    s[e0 / 32] = dd * qs;
  }
}

// Activation e of a block of 32 held one per lane (lane = e % 32) to int8 (quantize_lane) with
// s = d * sum(q) (the offset term of unsigned weight nibbles).
__device__ __forceinline__ void quantize32(float v, int64_t e, int8_t* q, float* d, float* s, int64_t tiled_cols = 0) {
  float dd;
  const int qi = quantize_lane(v, dd);
  if (tiled_cols) {
    int64_t at, di;
    tiled_at(e, tiled_cols, at, di);
    q[at] = int8_t(qi);
    if (threadIdx.x % 32 == 0) d[di] = dd;
    return;
  }
  q[e] = int8_t(qi);
  const float qs = warp_sum(float(qi));
  if (threadIdx.x % 32 == 0) {
    d[e / 32] = dd;
    s[e / 32] = dd * qs;
  }
}

// Sum over a block of blockDim.x (a multiple of 32, <= 1024) threads; every thread gets it.
__device__ __forceinline__ float block_sum(float v, float* smem32) {
  v = warp_sum(v);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();
  if (l == 0) smem32[w] = v;
  __syncthreads();
  v = l < nw ? smem32[l] : 0.f;
  return warp_sum(v);
}

// The 6-bit scale and min of sub-block `sub` (0..7) of a Q4_K super-block's 12 scale bytes (ggml's
// get_scale_min_k4).
__device__ __forceinline__ void q4k_scale_min(const uint8_t* sc, int sub, int& s, int& m) {
  if (sub < 4) {
    s = sc[sub] & 63;
    m = sc[sub + 4] & 63;
  } else {
    s = (sc[sub + 4] & 0xF) | ((sc[sub - 4] >> 6) << 4);
    m = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
  }
}

// 1 / sqrt(mean(r²) + eps) of a row, every thread of the block getting it.
__device__ __forceinline__ float row_inv_rms(const float* r, int64_t cols, float eps, float* smem32) {
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ss += r[c] * r[c];
  ss = block_sum(ss, smem32);
  return rsqrtf(ss / float(cols) + eps);
}
// A norm's weight factor: w, 1 + w (Gemma 3), or 1 without a weight.
__device__ __forceinline__ float norm_factor(const float* w, int64_t c, int add_one) {
  return w ? (add_one ? 1.f + w[c] : w[c]) : 1.f;
}

// One weight element as f32 (lookups and conversions; matmuls use the wide paths).
__device__ __forceinline__ float weight_at(const GpuWeight& w, int64_t r, int64_t c) {
  switch (w.type) {
    case WType::F32:
      return static_cast<const float*>(w.qs)[r * w.cols + c];
    case WType::BF16:
      return bf16_f32(static_cast<const uint16_t*>(w.qs)[r * w.cols + c]);
    case WType::Q8_0: {
      const int64_t nb = w.cols / 32, b = c / 32;
      const int8_t q = static_cast<const int8_t*>(w.qs)[(r * nb + b) * 32 + c % 32];
      return float(q) * half_f32(w.scale[r * nb + b]);
    }
    case WType::Q4_0: {
      const int64_t nb = w.cols / 32, b = c / 32, j = c % 32;
      const uint8_t byte = static_cast<const uint8_t*>(w.qs)[(r * nb + b) * 16 + j % 16];
      const int q = j < 16 ? (byte & 15) : (byte >> 4);
      return float(q - 8) * half_f32(w.scale[r * nb + b]);
    }
    case WType::Q4_K: {
      const int64_t nsb = w.cols / 256, sb = c / 256, e = c % 256;
      const uint8_t* blk = static_cast<const uint8_t*>(w.qs) + (r * nsb + sb) * 144;
      const float d = half_f32(*reinterpret_cast<const uint16_t*>(blk));
      const float dmin = half_f32(*reinterpret_cast<const uint16_t*>(blk + 2));
      const uint8_t* sc = blk + 4;
      const int sub = int(e / 32);  // sub-block 0..7
      int s, m;
      q4k_scale_min(sc, sub, s, m);
      const uint8_t byte = blk[16 + (sub / 2) * 32 + e % 32];
      const int q = (sub % 2 == 0) ? (byte & 15) : (byte >> 4);
      return d * float(s) * float(q) - dmin * float(m);
    }
  }
  return 0.f;
}

// One head of hd elements, in place, by one block: an RMS norm (do_norm; weight w, 1 + w or
// none), then the half-split rotation at position p (inv_freq null: none). v: hd floats of shared
// memory; red: 32.
// One rotated pair (a, b) -> (x_j, x_{j+half}) at position p and frequency f. Angles in f32 as transformers forms
// them: float(pos) * inv_freq; precise sin/cos.
__device__ __forceinline__ void rotate_pair(float& xj, float& xh, float a, float b, float p, float f) {
  float s, c;
  sincosf(p * f, &s, &c);
  xj = a * c - b * s;
  xh = b * c + a * s;
}
__device__ __forceinline__ void head_norm_rope(float* xr, int64_t hd, int do_norm, const float* w, float eps,
                                               int add_one, float p, const float* inv_freq, float* v, float* red) {
  float inv = 1.f;
  if (do_norm) {
    float ss = 0.f;
    for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, red);
    inv = rsqrtf(ss / float(hd) + eps);
  }
  if (!inv_freq) {
    if (do_norm)
      for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) xr[c] = xr[c] * inv * norm_factor(w, c, add_one);
    return;
  }
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float a = xr[c];
    if (do_norm) a = a * inv * norm_factor(w, c, add_one);
    v[c] = a;
  }
  __syncthreads();
  const int64_t half = hd / 2;
  for (int64_t j = threadIdx.x; j < half; j += blockDim.x) {
    const float f = inv_freq[j];
    const float a = v[j], b = v[j + half];
    if (f == 0.f) {
      xr[j] = a;
      xr[j + half] = b;
    } else {
      rotate_pair(xr[j], xr[j + half], a, b, p, f);
    }
  }
}

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace mb::cuda
