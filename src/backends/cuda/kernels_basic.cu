// Elementwise, normalisation, rotary, lookup and routing kernels: memory-bound one-pass ops.
#include <algorithm>
#include <cfloat>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_kernels.h"

namespace mb::cuda {

namespace {

__global__ void k_embed(GpuWeight t, const int32_t* ids, int64_t n, float scale, float* out) {
  pdl_begin();
  const int64_t i = blockIdx.y;
  const int64_t row = ids[i];
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < t.cols; c += int64_t(gridDim.x) * blockDim.x)
    out[i * t.cols + c] = weight_at(t, row, c) * scale;
}

// QuantOut q (q.q non-null; cols a multiple of 32, blocks of a multiple of 32 threads): the norms
// also write what they write as int8 blocks (quantize32), for the GEMV or the block products
// (QuantOut::tiled_cols) that read it next.
__global__ void k_rms_norm(const float* x, const float* w, float eps, int add_one, int64_t cols, float* y,
                           QuantOut qo) {
  pdl_begin();
  __shared__ float red[32];
  const float* xr = x + blockIdx.x * cols;
  float* yr = y + blockIdx.x * cols;
  const float inv = row_inv_rms(xr, cols, eps, red);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float r = xr[c] * inv * norm_factor(w, c, add_one);
    yr[c] = r;
    if (qo.q) quantize32(r, blockIdx.x * cols + c, qo.q, qo.d, qo.s, qo.tiled_cols);
    if (qo.bf16) qo.bf16[blockIdx.x * cols + c] = f32_bf16(r);
  }
}

// One block per (token, head): optional RMS norm of the head, then the half-split rotation.
__global__ void k_norm_rope(float* x, int64_t heads, int64_t hd, const float* w, float eps, int add_one, int do_norm,
                            const int32_t* pos, const float* inv_freq) {
  pdl_begin();
  __shared__ float red[32];
  extern __shared__ float v[];
  head_norm_rope(x + blockIdx.x * hd, hd, do_norm, w, eps, add_one, float(pos[blockIdx.x / heads]), inv_freq, v, red);
}

// rope alone: a thread a rotated pair (j, j + hd/2) of one head row (rotate_pair, as head_norm_rope).
// A block a head row (k_norm_rope) left blocks of 16-32 threads for a ViT's half-heads of 32 values
// (~300k blocks a call for five 280-token images: ~0.2 TB/s).
__global__ void k_rope_pairs(float* x, int64_t rows, int64_t heads, int64_t hd, const int32_t* pos,
                             const float* inv_freq) {
  pdl_begin();
  const int64_t half = hd / 2, total = rows * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / half, j = i % half;
    const float f = inv_freq[j];
    if (f == 0.f) continue;
    float* xr = x + r * hd;
    rotate_pair(xr[j], xr[j + half], xr[j], xr[j + half], float(pos[r / heads]), f);
  }
}

__global__ void k_add_rms_norm(float* x, float* br, const float* w, float eps, int add_one, float scale, int64_t cols,
                               QuantOut qo) {
  pdl_begin();
  __shared__ float red[32];
  float* xr = x + blockIdx.x * cols;
  const float* b = br + blockIdx.x * cols;
  const float inv = row_inv_rms(b, cols, eps, red);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float r = xr[c] + b[c] * inv * norm_factor(w, c, add_one);
    if (scale != 1.f) r *= scale;
    xr[c] = r;
    if (qo.q) quantize32(r, blockIdx.x * cols + c, qo.q, qo.d, qo.s, qo.tiled_cols);
    if (qo.bf16) qo.bf16[blockIdx.x * cols + c] = f32_bf16(r);
  }
}

// add_rms_norm, then y = rms_norm(new x) * (w2 or 1 + w2): each thread re-reads what it wrote.
__global__ void k_add_rms_norm_norm(float* x, float* br, const float* w, float eps, int add_one, float scale,
                                    const float* w2, float* y, int64_t cols, QuantOut qo) {
  pdl_begin();
  __shared__ float red[32];
  float* xr = x + blockIdx.x * cols;
  const float* b = br + blockIdx.x * cols;
  float* yr = y + blockIdx.x * cols;
  const float inv = row_inv_rms(b, cols, eps, red);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float r = xr[c] + b[c] * inv * norm_factor(w, c, add_one);
    if (scale != 1.f) r *= scale;
    xr[c] = r;
  }
  // Each thread reads back only the elements it wrote.
  const float inv2 = row_inv_rms(xr, cols, eps, red);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float r = xr[c] * inv2 * norm_factor(w2, c, add_one);
    yr[c] = r;
    if (qo.q) quantize32(r, blockIdx.x * cols + c, qo.q, qo.d, qo.s, qo.tiled_cols);
    if (qo.bf16) qo.bf16[blockIdx.x * cols + c] = f32_bf16(r);
  }
}

// rms_norm of rows of at most 128 values (a ViT's heads: 64 or 72), LANES lanes a row and a float4 a lane,
// the sum by shuffles among the row's lanes. A block a row left 16-32 threads a block for the ~30k head rows
// of a 2,400-patch image (36 us a call on an H100, ~0.2 TB/s).
template <int LANES>
__global__ void k_rms_norm_small(const float* x, const float* w, float eps, int add_one, int64_t rows, int64_t cols,
                                 float* y, uint16_t* y_bf16) {
  pdl_begin();
  const int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / LANES;
  const int sub = threadIdx.x % LANES;
  const bool in = r < rows && sub < cols / 4;  // every lane takes part in the shuffles
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4 a = in ? reinterpret_cast<const float4*>(x + r * cols)[sub] : zero;
  float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (!in) return;
  const float inv = rsqrtf(ss / float(cols) + eps);
  float4 f = w ? reinterpret_cast<const float4*>(w)[sub] : make_float4(1.f, 1.f, 1.f, 1.f);
  if (w && add_one) f = make_float4(1.f + f.x, 1.f + f.y, 1.f + f.z, 1.f + f.w);
  const float4 o = make_float4(a.x * inv * f.x, a.y * inv * f.y, a.z * inv * f.z, a.w * inv * f.w);
  reinterpret_cast<float4*>(y + r * cols)[sub] = o;
  if (y_bf16) reinterpret_cast<uint2*>(y_bf16 + r * cols)[sub] = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
}

// The three norms above with a row held in registers, V float4s a thread (rows of cols % 4 == 0,
// at most kNormRegMax elements): every load of a row goes out at once and each value is read from
// memory once. The loops above cost a memory round trip per pass (two to four) and were ~8 us a
// 2,560-element decode row on an H200, most of a decode layer's norm time.
constexpr int kNormRegThreads = 512;
constexpr int64_t kNormRegMax = 4 * 4 * kNormRegThreads;
enum NormMode { kNormPlain, kNormAdd, kNormAddNorm };

// MODE kNormPlain: y = rms_norm(x) * w. kNormAdd: x = (x + rms_norm(br) * w) * scale.
// kNormAddNorm: that, then y = rms_norm(new x) * w2. qo (q non-null): the last row written also
// goes out as int8 blocks of 32 (quantize32_quad; blockDim a multiple of 8).
template <int V, int MODE>
__global__ void k_norm_regs(float* x, const float* br, const float* w, const float* w2, float eps, int add_one,
                            float scale, int64_t cols, float* y, QuantOut qo) {
  pdl_begin();
  __shared__ float red[32];
  const int64_t nvec = cols / 4, base = blockIdx.x * cols;
  const float4* src = reinterpret_cast<const float4*>((MODE == kNormPlain ? x : br) + base);
  const float4* xs = reinterpret_cast<const float4*>(x + base);
  float4 a[V], r[V], wa[V], wb[V];
  const float4 one = make_float4(1.f, 1.f, 1.f, 1.f), zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    const bool in = i < nvec;
    a[j] = in ? src[i] : zero;
    r[j] = in && MODE != kNormPlain ? xs[i] : zero;
    wa[j] = in && w ? reinterpret_cast<const float4*>(w)[i] : one;
    wb[j] = in && MODE == kNormAddNorm && w2 ? reinterpret_cast<const float4*>(w2)[i] : one;
  }
  auto factor = [&](float4 f, bool has) {
    if (has && add_one) f = make_float4(1.f + f.x, 1.f + f.y, 1.f + f.z, 1.f + f.w);
    return f;
  };
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) ss += a[j].x * a[j].x + a[j].y * a[j].y + a[j].z * a[j].z + a[j].w * a[j].w;
  const float inv = rsqrtf(block_sum(ss, red) / float(cols) + eps);
  float4 out[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float4 f = factor(wa[j], w != nullptr);
    float4 o = make_float4(a[j].x * inv * f.x, a[j].y * inv * f.y, a[j].z * inv * f.z, a[j].w * inv * f.w);
    if (MODE != kNormPlain) {
      o = make_float4(r[j].x + o.x, r[j].y + o.y, r[j].z + o.z, r[j].w + o.w);
      if (scale != 1.f) o = make_float4(o.x * scale, o.y * scale, o.z * scale, o.w * scale);
    }
    out[j] = o;
  }
  if (MODE == kNormAddNorm) {
    float ss2 = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j)
      ss2 += out[j].x * out[j].x + out[j].y * out[j].y + out[j].z * out[j].z + out[j].w * out[j].w;
    const float inv2 = rsqrtf(block_sum(ss2, red) / float(cols) + eps);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i < nvec) reinterpret_cast<float4*>(x + base)[i] = out[j];
      const float4 f = factor(wb[j], w2 != nullptr);
      out[j] = make_float4(out[j].x * inv2 * f.x, out[j].y * inv2 * f.y, out[j].z * inv2 * f.z, out[j].w * inv2 * f.w);
    }
  }
  float* dst = MODE == kNormAdd ? x : y;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    if (i < nvec) reinterpret_cast<float4*>(dst + base)[i] = out[j];
    if (qo.bf16 && i < nvec) {
      const uint2 b = make_uint2(pack_bf16(out[j].x, out[j].y), pack_bf16(out[j].z, out[j].w));
      reinterpret_cast<uint2*>(qo.bf16 + base)[i] = b;
    }
    // Blocks of 32 are 8 whole float4s, so a group of 8 lanes is all in the row or all past it.
    if (qo.q && j * blockDim.x < nvec) {
      const float v4[4] = {out[j].x, out[j].y, out[j].z, out[j].w};
      quantize32_quad(v4, base + 4 * i, i < nvec, qo.q, qo.d, qo.s, qo.tiled_cols);
    }
  }
}

__global__ void k_gelu_mul(const float* g, const float* u, float* o, int64_t n, uint16_t* ob) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float r = gelu_tanh(g[i]) * u[i];
    o[i] = r;
    if (ob) ob[i] = f32_bf16(r);
  }
}
__global__ void k_gelu_split_mul(const float* h, int64_t pairs, int64_t I, float* act) {
  pdl_begin();
  const int64_t n = pairs * I;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i / I, c = i % I;
    act[i] = gelu_tanh(h[p * 2 * I + c]) * h[p * 2 * I + I + c];
  }
}
__global__ void k_add(const float* a, const float* b, float* o, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = a[i] + b[i];
}
__global__ void k_add_bcast(const float* a, const float* b, float* o, int64_t n, int64_t bn) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = a[i] + b[i % bn];
}
__global__ void k_gather_sum_rows(const float* src, int64_t cols, const int32_t* rows, int64_t n, int64_t group,
                                  float scale, float* dst) {
  pdl_begin();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n * cols; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / cols, c = e % cols;
    float acc = 0.f;
    for (int64_t j = 0; j < group; ++j) acc += src[int64_t(rows[i * group + j]) * cols + c] * scale;
    dst[e] = acc;
  }
}
__global__ void k_silu(float* x, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = silu_f(x[i]);
}
// One block per row: the mean, then the variance around it (two passes over the row, as the host's).
__global__ void k_layer_norm(const float* x, const float* w, const float* b, float eps, int relu, int64_t cols,
                             float* y) {
  pdl_begin();
  __shared__ float red[32];
  const float* xr = x + blockIdx.x * cols;
  float* yr = y + blockIdx.x * cols;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += xr[c];
  const float mean = block_sum(sum, red) / float(cols);
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ss += (xr[c] - mean) * (xr[c] - mean);
  const float rstd = rsqrtf(block_sum(ss, red) / float(cols) + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = (xr[c] - mean) * rstd * w[c];
    if (b) v += b[c];
    yr[c] = relu ? fmaxf(v, 0.f) : v;
  }
}
// One thread per value of cols [rows, wo, C·k·k]; consecutive threads take consecutive columns.
__global__ void k_im2col(const float* x, const uint8_t* row_valid, int64_t h, int64_t w, int64_t c, int kernel,
                         int stride, int pad, int64_t row0, int64_t rows, int64_t wo, float* cols) {
  pdl_begin();
  const int64_t kk = int64_t(kernel) * kernel, patch = c * kk, n = rows * wo * patch;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t col = e % patch, o = e / patch, oy = row0 + o / wo, ox = o % wo;
    const int64_t ch = col / kk, i = col % kk / kernel, j = col % kernel;
    const int64_t iy = oy * stride - pad + i, ix = ox * stride - pad + j;
    const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w && (!row_valid || row_valid[iy]);
    cols[e] = inside ? x[(iy * w + ix) * c + ch] : 0.f;
  }
}
// One thread per (t, channel): the K gated values it reads are recomputed (K is a handful).
__global__ void k_glu_causal_conv(const float* g, const float* wt, int64_t n, int64_t D, int64_t K, float* out) {
  pdl_begin();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n * D; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / D, c = e % D;
    float acc = 0.f;
    for (int64_t j = K - 1 - t > 0 ? K - 1 - t : 0; j < K; ++j) {
      const int64_t s = t - (K - 1) + j;
      const float gate = g[s * 2 * D + D + c];
      acc += wt[c * K + j] * (g[s * 2 * D + c] * (1.f / (1.f + expf(-gate))));
    }
    out[e] = acc;
  }
}
__global__ void k_mul(const float* a, const float* b, float* o, int64_t n, int64_t bn) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = a[i] * b[i % bn];
}
__global__ void k_scale(float* x, int64_t n, float s) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}
__global__ void k_softcap(float* x, int64_t n, float cap) {
  pdl_begin();
  const float inv = 1.f / cap;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = tanhf(x[i] * inv) * cap;
}
__global__ void k_clamp(float* x, int64_t n, float lo, float hi) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = clamp_f(x[i], lo, hi);
}
__global__ void k_slice_cols(const float* src, int64_t rows, int64_t cols, int64_t begin, int64_t w, float* dst) {
  pdl_begin();
  const int64_t n = rows * w;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[(i / w) * cols + begin + i % w];
}
__global__ void k_gather_rows(const float* src, int64_t cols, const int32_t* rows, int64_t n, float* dst) {
  pdl_begin();
  const int64_t total = n * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[int64_t(rows[i / cols]) * cols + i % cols];
}
__global__ void k_f32_to_bf16(const float* x, int64_t n, uint16_t* o) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = f32_bf16(x[i]);
}
// k_clamp, k_silu and k_gelu_mul in one pass (their device functions), so a clipped linear's numbers are the
// separate ops'. With no finite bound the default skips the clamp, and so does `clips` (fmaxf(NaN, -inf)
// would turn a NaN into -inf).
__global__ void k_clamp_to_bf16(const float* x, int64_t n, float lo, float hi, uint16_t* o) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    o[i] = f32_bf16(clamp_f(x[i], lo, hi));
}
__global__ void k_clamp_activate(float* y, int64_t n, int clips, float lo, float hi, int act, const float* times) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v = y[i];
    if (clips) v = clamp_f(v, lo, hi);
    if (act == 1) v = silu_f(v);
    if (act == 2) v = gelu_tanh(v) * times[i];
    y[i] = v;
  }
}

// The two above four values a thread (n % 4 == 0, 16-byte aligned): the scalar loops read ~0.75 TB/s, and a
// clipped linear of a ViT runs one of each around every product.
__global__ void k_clamp_to_bf16_v4(const float4* x, int64_t n4, float lo, float hi, uint2* o) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = x[i];
    o[i] = make_uint2(pack_bf16(clamp_f(v.x, lo, hi), clamp_f(v.y, lo, hi)),
                      pack_bf16(clamp_f(v.z, lo, hi), clamp_f(v.w, lo, hi)));
  }
}
__global__ void k_clamp_activate_v4(float4* y, int64_t n4, int clips, float lo, float hi, int act, const float4* times) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float v[4] = {y[i].x, y[i].y, y[i].z, y[i].w};
    float t[4] = {1.f, 1.f, 1.f, 1.f};
    if (act == 2) t[0] = times[i].x, t[1] = times[i].y, t[2] = times[i].z, t[3] = times[i].w;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (clips) v[e] = clamp_f(v[e], lo, hi);
      if (act == 1) v[e] = silu_f(v[e]);
      if (act == 2) v[e] = gelu_tanh(v[e]) * t[e];
    }
    y[i] = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// One warp per block of 32 activations: symmetric int8 with scale amax / 127.
__global__ void k_quantize_x(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  pdl_begin();
  const int64_t b = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= blocks) return;
  quantize32(x[b * 32 + lane], b * 32 + lane, q, d, s);
}

// One block per row: the first maximum, or -1 if the row holds a non-finite value (as the host's
// Backend::first_max_or_nonfinite).
__global__ void k_argmax_rows(const float* x, int64_t V, int32_t* ids) {
  pdl_begin();
  __shared__ float sbest[32];
  __shared__ int64_t sidx[32];
  __shared__ int sbad[32];
  const float* r = x + blockIdx.x * V;
  float best = -INFINITY;
  int64_t bi = INT64_MAX;
  int bad = 0;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
    const float v = r[c];
    if (!isfinite(v)) bad = 1;
    else if (v > best || bi == INT64_MAX) best = v, bi = c;  // a thread's columns ascend: the first stays
  }
  // (value desc, column asc) across the warp, then across the warps.
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi != INT64_MAX && (bi == INT64_MAX || ob > best || (ob == best && oi < bi))) best = ob, bi = oi;
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
  const int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
  if (l == 0) sbest[w] = best, sidx[w] = bi, sbad[w] = bad;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < nw; ++i) {
      if (sidx[i] != INT64_MAX && (bi == INT64_MAX || sbest[i] > best || (sbest[i] == best && sidx[i] < bi)))
        best = sbest[i], bi = sidx[i];
      bad |= sbad[i];
    }
    ids[blockIdx.x] = bad || bi == INT64_MAX ? -1 : int32_t(bi);
  }
}

// One block per token: softmax over E logits, top k by repeated arg-max (ties to the lower index),
// renormalised, times the per-expert scale.
__global__ void k_route_topk(const float* logits, int64_t E, int k, const float* pes, float* weights,
                             int32_t* experts) {
  pdl_begin();
  extern __shared__ float prob[];
  __shared__ float red[32];
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  __shared__ int chosen[64];
  const float* l = logits + blockIdx.x * E;
  float mx = -FLT_MAX;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = -FLT_MAX;
  for (int i = 0; i < int(blockDim.x / 32); ++i) mx = fmaxf(mx, red[i]);
  __syncthreads();
  float sum = 0.f;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) sum += (prob[e] = expf(l[e] - mx));
  sum = block_sum(sum, red);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) prob[e] /= sum;
  __syncthreads();
  float tot = 0.f;
  for (int j = 0; j < k; ++j) {
    float bv = -1.f;
    int bi = int(E);
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
      const float p = prob[e];
      if (p > bv || (p == bv && int(e) < bi)) {
        bv = p;
        bi = int(e);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (threadIdx.x % 32 == 0) {
      best_v[threadIdx.x / 32] = bv;
      best_i[threadIdx.x / 32] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float v = best_v[0];
      int idx = best_i[0];
      for (int i = 1; i < int(blockDim.x / 32); ++i)
        if (best_v[i] > v || (best_v[i] == v && best_i[i] < idx)) {
          v = best_v[i];
          idx = best_i[i];
        }
      chosen[j] = idx;
      prob[idx] = -2.f - prob[idx];  // taken; its value stays recoverable
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    for (int j = 0; j < k; ++j) tot += -2.f - prob[chosen[j]];
    for (int j = 0; j < k; ++j) {
      const int e = chosen[j];
      float w = (-2.f - prob[e]) / tot;
      if (pes) w *= pes[e];
      weights[blockIdx.x * k + j] = w;
      experts[blockIdx.x * k + j] = e;
    }
  }
}

__global__ void k_moe_combine(const float* y, const float* weights, int64_t n, int k, int64_t H, float* out) {
  pdl_begin();
  const int64_t total = n * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, c = i % H;
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += weights[t * k + j] * y[(t * k + j) * H + c];
    out[i] = acc;
  }
}

__global__ void k_copy_probe(const int4* src, int4* dst, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// ggml blocks (a half scale, then qs_bytes of quants) into a quants plane and a scales plane.
__global__ void k_split_blocks(const uint8_t* raw, int64_t nblocks, int block_bytes, int qs_bytes, uint8_t* qs,
                               uint16_t* scale) {
  pdl_begin();
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nblocks; b += int64_t(gridDim.x) * blockDim.x) {
    const uint8_t* src = raw + b * block_bytes;
    scale[b] = uint16_t(src[0] | (src[1] << 8));
    for (int i = 0; i < qs_bytes; ++i) qs[b * qs_bytes + i] = src[2 + i];
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int norm_threads(int64_t cols) { return cols >= 1024 ? 1024 : cols >= 256 ? 256 : cols > 64 ? 128 : 64; }

}  // namespace

void embed(const GpuWeight& table, const int32_t* ids, int64_t n, float scale, float* out, cudaStream_t st) {
  if (n == 0) return;
  const dim3 grid(unsigned((table.cols + 255) / 256), unsigned(n));
  launch_kernel(k_embed, grid, 256, 0, st, table, ids, n, scale, out);
  check_launch("embed");
}

namespace {

// k_norm_regs when the row fits (V float4s for each of at most kNormRegThreads threads); false
// when it does not.
template <int MODE>
bool norm_regs(float* x, const float* br, const float* w, const float* w2, float eps, bool add_one, float scale,
               int64_t rows, int64_t cols, float* y, QuantOut qo, cudaStream_t st) {
  if (cols % 4 != 0 || cols > kNormRegMax || (qo.q && cols % 32 != 0) || !aligned16(x) || !aligned16(br) ||
      !aligned16(w) || !aligned16(w2) || !aligned16(y) || !aligned16(qo.bf16))
    return false;
  const int64_t nvec = cols / 4, v = (nvec + kNormRegThreads - 1) / kNormRegThreads;
  const unsigned threads = unsigned(((nvec + v - 1) / v + 31) / 32 * 32);
#define MB_NORM_REGS(VV) \
  launch_kernel(k_norm_regs<VV, MODE>, unsigned(rows), threads, 0, st, x, br, w, w2, eps, int(add_one), scale, cols, y, qo)
  if (v == 1)
    MB_NORM_REGS(1);
  else if (v == 2)
    MB_NORM_REGS(2);
  else if (v == 3)
    MB_NORM_REGS(3);
  else
    MB_NORM_REGS(4);
#undef MB_NORM_REGS
  return true;
}

}  // namespace

void rms_norm(const float* x, const float* w, float eps, bool add_one, int64_t rows, int64_t cols, float* y,
              cudaStream_t st, QuantOut qo) {
  if (rows == 0) return;
  if (cols % 4 == 0 && cols <= 128 && !qo.q && aligned16(x) && aligned16(w) && aligned16(y) &&
      reinterpret_cast<uintptr_t>(qo.bf16) % 8 == 0) {
    const int64_t nvec = cols / 4;
    const int lanes = nvec <= 4 ? 4 : nvec <= 8 ? 8 : nvec <= 16 ? 16 : 32;
    const unsigned blocks = unsigned((rows * lanes + 255) / 256);
    if (lanes == 4)
      launch_kernel(k_rms_norm_small<4>, blocks, 256, 0, st, x, w, eps, int(add_one), rows, cols, y, qo.bf16);
    else if (lanes == 8)
      launch_kernel(k_rms_norm_small<8>, blocks, 256, 0, st, x, w, eps, int(add_one), rows, cols, y, qo.bf16);
    else if (lanes == 16)
      launch_kernel(k_rms_norm_small<16>, blocks, 256, 0, st, x, w, eps, int(add_one), rows, cols, y, qo.bf16);
    else
      launch_kernel(k_rms_norm_small<32>, blocks, 256, 0, st, x, w, eps, int(add_one), rows, cols, y, qo.bf16);
    check_launch("rms_norm");
    return;
  }
  if (norm_regs<kNormPlain>(const_cast<float*>(x), nullptr, w, nullptr, eps, add_one, 1.f, rows, cols, y, qo, st)) {
    check_launch("rms_norm");
    return;
  }
  launch_kernel(k_rms_norm, unsigned(rows), norm_threads(cols), 0, st, x, w, eps, add_one, cols, y, qo);
  check_launch("rms_norm");
}

void rope(float* x, int64_t n, int64_t heads, int64_t hd, const int32_t* pos, const float* inv_freq, cudaStream_t st) {
  if (n == 0) return;
  const int64_t pairs = n * heads * (hd / 2);
  const unsigned blocks = unsigned(std::min<int64_t>((pairs + 255) / 256, int64_t(sm_count()) * 16));
  launch_kernel(k_rope_pairs, blocks, 256, 0, st, x, n * heads, heads, hd, pos, inv_freq);
  check_launch("rope");
}

void rms_norm_rope(float* x, int64_t n, int64_t heads, int64_t hd, const float* w, float eps, bool add_one,
                   const int32_t* pos, const float* inv_freq, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_norm_rope, unsigned(n * heads), norm_threads(hd), size_t(hd) * 4, st, x, heads, hd, w, eps, add_one,
                1, pos, inv_freq);
  check_launch("rms_norm_rope");
}

void add_rms_norm(float* x, float* branch, const float* w, float eps, bool add_one, float scale, int64_t rows,
                  int64_t cols, cudaStream_t st, QuantOut qo) {
  if (rows == 0) return;
  if (norm_regs<kNormAdd>(x, branch, w, nullptr, eps, add_one, scale, rows, cols, nullptr, qo, st)) {
    check_launch("add_rms_norm");
    return;
  }
  launch_kernel(k_add_rms_norm, unsigned(rows), norm_threads(cols), 0, st, x, branch, w, eps, add_one, scale, cols,
                qo);
  check_launch("add_rms_norm");
}

void add_rms_norm_norm(float* x, float* branch, const float* w, float eps, bool add_one, float scale,
                       const float* w_next, float* y, int64_t rows, int64_t cols, cudaStream_t st, QuantOut qo) {
  if (rows == 0) return;
  if (norm_regs<kNormAddNorm>(x, branch, w, w_next, eps, add_one, scale, rows, cols, y, qo, st)) {
    check_launch("add_rms_norm_norm");
    return;
  }
  launch_kernel(k_add_rms_norm_norm, unsigned(rows), norm_threads(cols), 0, st, x, branch, w, eps, add_one, scale,
                w_next, y, cols, qo);
  check_launch("add_rms_norm_norm");
}

void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n, cudaStream_t st, uint16_t* out_bf16) {
  if (n == 0) return;
  launch_kernel(k_gelu_mul, grid_1d(n), 256, 0, st, g, u, out, n, out_bf16);
  check_launch("gelu_tanh_mul");
}
void gelu_split_mul(const float* h, int64_t pairs, int64_t I, float* act, cudaStream_t st) {
  if (pairs * I == 0) return;
  launch_kernel(k_gelu_split_mul, grid_1d(pairs * I), 256, 0, st, h, pairs, I, act);
  check_launch("moe gelu");
}
void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_add, grid_1d(n), 256, 0, st, a, b, out, n);
  check_launch("add");
}
void add_bcast(const float* a, const float* b, float* out, int64_t n, int64_t bn, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_add_bcast, grid_1d(n), 256, 0, st, a, b, out, n, bn);
  check_launch("add (broadcast)");
}
void gather_sum_rows(const float* src, int64_t cols, const int32_t* rows, int64_t n, int64_t group, float scale,
                     float* dst, cudaStream_t st) {
  if (n * cols == 0) return;
  launch_kernel(k_gather_sum_rows, grid_1d(n * cols), 256, 0, st, src, cols, rows, n, group, scale, dst);
  check_launch("gather_sum_rows");
}
void silu(float* x, int64_t n, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_silu, grid_1d(n), 256, 0, st, x, n);
  check_launch("silu");
}
void layer_norm(const float* x, const float* w, const float* b, float eps, bool relu, int64_t rows, int64_t cols,
                float* y, cudaStream_t st) {
  if (rows == 0) return;
  launch_kernel(k_layer_norm, unsigned(rows), norm_threads(cols), 0, st, x, w, b, eps, int(relu), cols, y);
  check_launch("layer_norm");
}
void im2col(const float* x, const uint8_t* row_valid, int64_t h, int64_t w, int64_t c, int kernel, int stride, int pad,
            int64_t row0, int64_t rows, int64_t wo, float* cols, cudaStream_t st) {
  const int64_t n = rows * wo * c * kernel * kernel;
  if (n == 0) return;
  launch_kernel(k_im2col, grid_1d(n), 256, 0, st, x, row_valid, h, w, c, kernel, stride, pad, row0, rows, wo, cols);
  check_launch("im2col");
}
void glu_causal_conv(const float* g, const float* w, int64_t n, int64_t D, int64_t K, float* out, cudaStream_t st) {
  if (n * D == 0) return;
  launch_kernel(k_glu_causal_conv, grid_1d(n * D), 256, 0, st, g, w, n, D, K, out);
  check_launch("glu_causal_conv");
}
void mul(const float* a, const float* b, float* out, int64_t n, int64_t bn, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_mul, grid_1d(n), 256, 0, st, a, b, out, n, bn);
  check_launch("mul");
}
void scale(float* x, int64_t n, float s, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_scale, grid_1d(n), 256, 0, st, x, n, s);
  check_launch("scale");
}
void softcap(float* x, int64_t n, float cap, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_softcap, grid_1d(n), 256, 0, st, x, n, cap);
  check_launch("softcap");
}
void clamp(float* x, int64_t n, float lo, float hi, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_clamp, grid_1d(n), 256, 0, st, x, n, lo, hi);
  check_launch("clamp");
}
void slice_cols(const float* src, int64_t rows, int64_t cols, int64_t begin, int64_t w, float* dst, cudaStream_t st) {
  if (rows * w == 0) return;
  launch_kernel(k_slice_cols, grid_1d(rows * w), 256, 0, st, src, rows, cols, begin, w, dst);
  check_launch("slice_cols");
}
void gather_rows(const float* src, int64_t cols, const int32_t* rows, int64_t n, float* dst, cudaStream_t st) {
  if (n * cols == 0) return;
  launch_kernel(k_gather_rows, grid_1d(n * cols), 256, 0, st, src, cols, rows, n, dst);
  check_launch("gather_rows");
}
void f32_to_bf16(const float* x, int64_t n, uint16_t* out, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_f32_to_bf16, grid_1d(n), 256, 0, st, x, n, out);
  check_launch("f32_to_bf16");
}
void clamp_to_bf16(const float* x, int64_t n, float lo, float hi, uint16_t* out, cudaStream_t st) {
  if (n == 0) return;
  if (n % 4 == 0 && aligned16(x) && reinterpret_cast<uintptr_t>(out) % 8 == 0)
    launch_kernel(k_clamp_to_bf16_v4, grid_1d(n / 4), 256, 0, st, reinterpret_cast<const float4*>(x), n / 4, lo, hi,
                  reinterpret_cast<uint2*>(out));
  else
    launch_kernel(k_clamp_to_bf16, grid_1d(n), 256, 0, st, x, n, lo, hi, out);
  check_launch("clamp_to_bf16");
}
void clamp_activate(float* y, int64_t n, bool clips, float lo, float hi, ClipAct act, const float* times,
                    cudaStream_t st) {
  if (n == 0) return;
  if (n % 4 == 0 && aligned16(y) && (act != ClipAct::GeluTanhTimes || aligned16(times)))
    launch_kernel(k_clamp_activate_v4, grid_1d(n / 4), 256, 0, st, reinterpret_cast<float4*>(y), n / 4, int(clips),
                  lo, hi, int(act), reinterpret_cast<const float4*>(times));
  else
    launch_kernel(k_clamp_activate, grid_1d(n), 256, 0, st, y, n, int(clips), lo, hi, int(act), times);
  check_launch("clamp_activate");
}
void quantize_x(const float* x, int64_t n, int64_t k, int8_t* q, float* d, float* s, cudaStream_t st) {
  const int64_t blocks = n * k / 32;
  if (blocks == 0) return;
  launch_kernel(k_quantize_x, blocks_for(blocks * 32, 256), 256, 0, st, x, blocks, q, d, s);
  check_launch("quantize activations");
}
void argmax_rows(const float* x, int64_t rows, int64_t V, int32_t* ids, cudaStream_t st) {
  if (rows == 0) return;
  launch_kernel(k_argmax_rows, unsigned(rows), 1024, 0, st, x, V, ids);
  check_launch("argmax_rows");
}
void route_topk(const float* logits, int64_t n, int64_t E, int k, const float* per_expert_scale, float* weights,
                int32_t* experts, cudaStream_t st) {
  if (n == 0) return;
  launch_kernel(k_route_topk, unsigned(n), 128, size_t(E) * 4, st, logits, E, k, per_expert_scale, weights, experts);
  check_launch("route_topk");
}
void moe_combine(const float* y, const float* weights, int64_t n, int k, int64_t H, float* out, cudaStream_t st) {
  if (n * H == 0) return;
  launch_kernel(k_moe_combine, grid_1d(n * H), 256, 0, st, y, weights, n, k, H, out);
  check_launch("moe combine");
}

void split_blocks(const void* raw, int64_t nblocks, int block_bytes, int qs_bytes, void* qs, uint16_t* scale,
                  cudaStream_t st) {
  if (nblocks == 0) return;
  launch_kernel(k_split_blocks, grid_1d(nblocks), 256, 0, st, static_cast<const uint8_t*>(raw), nblocks, block_bytes,
                qs_bytes, static_cast<uint8_t*>(qs), scale);
  check_launch("repack weight blocks");
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

double copy_seconds(const void* src, void* dst, size_t bytes, int reps, cudaStream_t st) {
  const int64_t n = int64_t(bytes / 16);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch_kernel(k_copy_probe, sm_count() * 8, 512, 0, st, static_cast<const int4*>(src), static_cast<int4*>(dst),
                n);  // warm-up
  cudaEventRecord(a, st);
  for (int r = 0; r < reps; ++r)
    launch_kernel(k_copy_probe, sm_count() * 8, 512, 0, st, static_cast<const int4*>(src), static_cast<int4*>(dst), n);
  cudaEventRecord(b, st);
  cudaEventSynchronize(b);
  check_launch("bandwidth probe");
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return double(ms) / 1e3;
}

}  // namespace mb::cuda
