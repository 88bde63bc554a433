// Attention over bf16 KV addressed through each sequence's page table (or a ring, or plain rows),
// for head dims up to 512 (Gemma 4's full-attention layers), which FlashAttention does not cover.
//
// A block takes one query row and GH query heads that share a KV head (so K and V are read once
// for the group; one head in decode of a few rows: heads_per_block) and one of S splits of the
// row's keys; its 4 warps take every 4th key of the split, each keeping an online softmax, merged
// in shared memory. With S > 1 (few query rows, as in decode) the splits' partial results are
// merged: for up to 16 rows and splits of up to 128 keys, by the S blocks themselves as one thread
// block cluster, through each other's shared memory; otherwise by a second kernel, one block a
// (row, head). (Merging in the last split block
// of a row to finish, with an arrival counter, was measured slower: E4B Q4_0 tg128 355 vs 388
// tok/s on an H200.) Every launch parameter is fixed by the batch's shape, never by positions, so
// a recorded decode step stays valid.
#include <algorithm>
#include <cfloat>
#include <cstdlib>

#include <cooperative_groups.h>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_kernels.h"

namespace mb::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kAttnWarps = 4;
constexpr int64_t kFewRows = 16;     // decode rows whose key splits merge in a cluster
constexpr int64_t kOneHeadRows = 4;  // decode rows that take one head a block

__device__ __forceinline__ int find_seq(const KVSeqs& seqs, int64_t row) {
  if (seqs.ordered) {
    int lo = 0, hi = seqs.n - 1, at = -1;  // the last sequence that begins at or before row
    while (lo <= hi) {
      const int mid = (lo + hi) / 2;
      if (seqs.s[mid].begin <= row) at = mid, lo = mid + 1;
      else hi = mid - 1;
    }
    return at >= 0 && row < int64_t(seqs.s[at].begin) + seqs.s[at].count ? at : -1;
  }
  for (int i = 0; i < seqs.n; ++i)
    if (row >= seqs.s[i].begin && row < seqs.s[i].begin + seqs.s[i].count) return i;
  return -1;
}

__device__ __forceinline__ int64_t kv_slot(const KVSeq& s, int64_t pos) {
  if (s.pages)
    return (int64_t(s.pages[pos >> s.page_shift]) << s.page_shift) | (pos & ((int64_t(1) << s.page_shift) - 1));
  return s.ring ? pos % s.capacity : pos;
}

__device__ __forceinline__ void widen8(const int4 raw, float* f) {
  const uint32_t r[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(r[i] << 16);
    f[2 * i + 1] = __uint_as_float(r[i] & 0xffff0000u);
  }
}

// Partial softmax results (m_s, l_s), s < n, from `ml(s)` (a float2), combined by their maxima: M = max
// m_s, each partial's weight w_s = exp(m_s - M) (0 for a partial that saw no key) handed to
// `weigh(s, w_s)` in order, and L = sum w_s l_s returned with M. The block's warps, the merge
// kernel and the cluster merge all combine this way.
template <class ML, class Weigh>
__device__ __forceinline__ float2 combine_partials(int n, ML ml, Weigh weigh) {
  float M = -INFINITY;
  for (int s = 0; s < n; ++s) M = fmaxf(M, ml(s).x);
  float L = 0.f;
  for (int s = 0; s < n; ++s) {
    const float2 p = ml(s);
    const float w = p.x == -INFINITY ? 0.f : __expf(p.x - M);
    L += w * p.y;
    weigh(s, w);
  }
  return make_float2(M, L);
}

// out for heads h0 .. h0 + nheads - 1 (nheads <= 8) of `row` from the S <= 32 splits' partials
// [M, L, acc[hd]], by one block. Loads go out kMergeBatch splits and kMergeElems elements at a
// time (a merge that walked them one by one was a chain of L2 round trips). a.qo.q non-null: the
// output also goes out as int8 blocks of 32 (hd a multiple of 32); a.qo.bf16: as bf16.
constexpr int kMergeBatch = 8, kMergeElems = 4;
__device__ __forceinline__ void merge_splits(const float* __restrict__ part, int64_t row, int64_t h0, int nheads,
                                             int S, const AttnArgs& a, float* __restrict__ out) {
  __shared__ float f[8][32], l[8][32], inv_l[8];
  const int64_t hd = a.hd, nh = a.n_heads, stride = hd + 2;
  const float* pr = part + (row * nh + h0) * S * stride;  // head i, split s at pr + (i * S + s) * stride
  for (int t = threadIdx.x; t < nheads * 32; t += blockDim.x) {
    const int i = t / 32, sp = t % 32;
    f[i][sp] = sp < S ? __ldcg(pr + (i * S + sp) * stride) : -INFINITY;
    l[i][sp] = sp < S ? __ldcg(pr + (i * S + sp) * stride + 1) : 0.f;
  }
  __syncthreads();
  if (threadIdx.x < nheads) {
    const int i = threadIdx.x;
    const float L = combine_partials(
        S, [&](int sp) { return make_float2(f[i][sp], l[i][sp]); }, [&](int sp, float w) { f[i][sp] = w; }).y;
    for (int sp = S; sp < 32; ++sp) f[i][sp] = 0.f;
    inv_l[i] = 1.f / L;
  }
  __syncthreads();
  const int64_t total = nheads * hd;
  for (int64_t base = threadIdx.x; base < total; base += int64_t(blockDim.x) * kMergeElems) {
    float v[kMergeElems] = {};
    for (int s0 = 0; s0 < S; s0 += kMergeBatch) {
      float x[kMergeElems][kMergeBatch];
#pragma unroll
      for (int u = 0; u < kMergeElems; ++u) {
        const int64_t idx = base + int64_t(u) * blockDim.x;
        const int64_t i = idx / hd, e = idx % hd;
#pragma unroll
        for (int j = 0; j < kMergeBatch; ++j)
          x[u][j] = idx < total && s0 + j < S ? __ldcg(pr + (i * S + s0 + j) * stride + 2 + e) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kMergeElems; ++u) {
        const int64_t i = (base + int64_t(u) * blockDim.x) / hd;
#pragma unroll
        for (int j = 0; j < kMergeBatch; ++j)
          if (s0 + j < 32 && i < nheads) v[u] += f[i][s0 + j] * x[u][j];
      }
    }
#pragma unroll
    for (int u = 0; u < kMergeElems; ++u) {
      const int64_t idx = base + int64_t(u) * blockDim.x;
      if (idx >= total) break;  // warp-uniform: total and blockDim are multiples of 32 with qo
      const int64_t i = idx / hd, e = idx % hd;
      const int64_t at = (row * nh + h0 + i) * hd + e;
      const float o = v[u] * inv_l[i];
      out[at] = o;
      if (a.qo.q) quantize32(o, at, a.qo.q, a.qo.d, a.qo.s, a.qo.tiled_cols);
      if (a.qo.bf16) a.qo.bf16[at] = f32_bf16(o);
    }
  }
}

// C: 256-element chunks of a head (1 or 2); GH: query heads per block; KU: keys a warp loads at
// once. Taken one at a time, a warp's keys are a chain of memory round trips (each key's page-table
// entry, then its K and V rows); KU keys' loads go out together (4 against 1: E4B Q4_0 tg128 +3%
// on an H100; 8 was slower than 4 at 4 heads a block, faster at one).
// CL: the S splits of a row are one thread block cluster and merge through each other's shared
// memory (no partials in global memory, no merge kernel).
template <int C, int GH, int KU, bool CL>
__global__ void __launch_bounds__(kAttnWarps * 32)
    k_attention(KVSeqs seqs, AttnArgs a, int64_t row0, int S, const float* q, float* out, float* part) {
  pdl_begin();
  extern __shared__ float sm[];  // [warps][GH][hd] acc, then [warps][GH] m and l
  __shared__ float block_ml[GH][2];  // CL: the block's M and L a head
  const int64_t row = row0 + blockIdx.x;
  const int si = find_seq(seqs, row);
  if (si < 0) return;
  const KVSeq& s = seqs.s[si];
  const int64_t hd = a.hd, nh = a.n_heads, group = a.n_heads / a.n_kv;
  const int64_t h0 = int64_t(blockIdx.y) * GH, g = h0 / group;
  const int split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const int64_t p = s.pos[row - s.begin];
  const int64_t hi = s.last ? s.last[row - s.begin] : p;  // an image's tokens see the whole image
  const int64_t lo = a.window > 0 ? (p - a.window + 1 > 0 ? p - a.window + 1 : 0) : 0;
  const int64_t nkeys = hi - lo + 1, chunk = (nkeys + S - 1) / S;
  const int64_t kb = lo + split * chunk;
  const int64_t ke = kb + chunk < hi + 1 ? kb + chunk : hi + 1;

  float qv[GH][C][8], acc[GH][C][8], m[GH], l[GH];
#pragma unroll
  for (int i = 0; i < GH; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t e = c * 256 + lane * 8;
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        acc[i][c][t] = 0.f;
        qv[i][c][t] = e + t < hd ? q[(row * nh + h0 + i) * hd + e + t] : 0.f;
      }
    }
  }
  const uint16_t* K = static_cast<const uint16_t*>(s.k);
  const uint16_t* V = static_cast<const uint16_t*>(s.v);
  // Keys key0 + j * kAttnWarps, j < KU, of this warp's share (every kAttnWarps-th key of the split).
  for (int64_t key0 = kb + warp; key0 < ke; key0 += int64_t(kAttnWarps) * KU) {
    int64_t base[KU];
#pragma unroll
    for (int j = 0; j < KU; ++j) {
      const int64_t key = key0 + int64_t(j) * kAttnWarps;
      base[j] = key < ke ? (kv_slot(s, key) * a.n_kv + g) * hd : -1;
    }
    int4 kr[KU][C], vr[KU][C];  // raw bf16 rows, widened where used (registers for KU keys' loads)
#pragma unroll
    for (int j = 0; j < KU; ++j)
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int64_t e = c * 256 + lane * 8;
        const bool in = base[j] >= 0 && e < hd;
        // not __ldg: the step's own kernels write K/V
        kr[j][c] = in ? *reinterpret_cast<const int4*>(K + base[j] + e) : make_int4(0, 0, 0, 0);
        vr[j][c] = in ? *reinterpret_cast<const int4*>(V + base[j] + e) : make_int4(0, 0, 0, 0);
      }
    float sc[KU][GH];
#pragma unroll
    for (int j = 0; j < KU; ++j) {
      float d[GH] = {};
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float kf[8];
        widen8(kr[j][c], kf);
#pragma unroll
        for (int i = 0; i < GH; ++i)
#pragma unroll
          for (int t = 0; t < 8; ++t) d[i] += qv[i][c][t] * kf[t];
      }
#pragma unroll
      for (int i = 0; i < GH; ++i) sc[j][i] = d[i];
    }
#pragma unroll
    for (int j = 0; j < KU; ++j)
#pragma unroll
      for (int i = 0; i < GH; ++i) {
        float d = warp_sum(sc[j][i]) * a.scale;
        if (a.softcap > 0.f) d = a.softcap * tanhf(d / a.softcap);
        sc[j][i] = base[j] >= 0 ? d : -INFINITY;
      }
#pragma unroll
    for (int i = 0; i < GH; ++i) {
      float mn = m[i];
#pragma unroll
      for (int j = 0; j < KU; ++j) mn = fmaxf(mn, sc[j][i]);
      const float corr = __expf(m[i] - mn);  // key0 is valid, so mn is finite
      float w[KU];
      l[i] *= corr;
#pragma unroll
      for (int j = 0; j < KU; ++j) {
        w[j] = __expf(sc[j][i] - mn);  // 0 for keys past the split
        l[i] += w[j];
      }
      m[i] = mn;
#pragma unroll
      for (int c = 0; c < C; ++c)
#pragma unroll
        for (int t = 0; t < 8; ++t) acc[i][c][t] *= corr;
#pragma unroll
      for (int j = 0; j < KU; ++j)
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float vf[8];
          widen8(vr[j][c], vf);
#pragma unroll
          for (int t = 0; t < 8; ++t) acc[i][c][t] += w[j] * vf[t];
        }
    }
  }
  // Merge the warps.
  float* sacc = sm;
  float* sml = sm + kAttnWarps * GH * hd;
#pragma unroll
  for (int i = 0; i < GH; ++i) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t e = c * 256 + lane * 8;
#pragma unroll
      for (int t = 0; t < 8; ++t)
        if (e + t < hd) sacc[(warp * GH + i) * hd + e + t] = acc[i][c][t];
    }
    if (lane == 0) {
      sml[(warp * GH + i) * 2] = m[i];
      sml[(warp * GH + i) * 2 + 1] = l[i];
    }
  }
  __syncthreads();
  for (int i = 0; i < GH; ++i) {
    float f[kAttnWarps];
    const float2 ML = combine_partials(
        kAttnWarps, [&](int w) { return make_float2(sml[(w * GH + i) * 2], sml[(w * GH + i) * 2 + 1]); },
        [&](int w, float wt) { f[w] = wt; });
    const float M = ML.x, L = ML.y;
    const int64_t h = h0 + i;
    for (int64_t e = threadIdx.x; e < hd; e += blockDim.x) {
      float v = 0.f;
      for (int w = 0; w < kAttnWarps; ++w) v += f[w] * sacc[(w * GH + i) * hd + e];
      if (S == 1) {
        const int64_t at = (row * nh + h) * hd + e;
        out[at] = v / L;
        if (a.qo.q) quantize32(v / L, at, a.qo.q, a.qo.d, a.qo.s, a.qo.tiled_cols);
        if (a.qo.bf16) a.qo.bf16[at] = f32_bf16(v / L);
      } else if (CL) {
        sacc[i * hd + e] = v;  // warp 0's slot, which only this thread reads
      } else {
        part[((row * nh + h) * S + split) * (hd + 2) + 2 + e] = v;
      }
    }
    if (S > 1 && threadIdx.x == 0) {
      if (CL) {
        block_ml[i][0] = M;
        block_ml[i][1] = L;
      } else {
        part[((row * nh + h) * S + split) * (hd + 2)] = M;
        part[((row * nh + h) * S + split) * (hd + 2) + 1] = L;
      }
    }
  }
  if constexpr (CL) {
    if (S == 1) return;
    // The cluster's S blocks are the row's splits: each merges its share of the GH x hd outputs, a
    // warp 32 consecutive ones at a time, reading every split's partials from its shared memory.
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int64_t total = GH * hd, groups = (total + 31) / 32;
    for (int64_t gi = int64_t(cluster.block_rank()) * kAttnWarps + warp; gi < groups; gi += int64_t(S) * kAttnWarps) {
      const int64_t idx = gi * 32 + lane;
      const int i = int(idx < total ? idx / hd : 0);
      const int64_t e = idx % hd;
      float v = 0.f;
      const float L = combine_partials(
                          S,
                          [&](int sp) {
                            const float* ml = cluster.map_shared_rank(&block_ml[0][0], sp) + i * 2;
                            return make_float2(ml[0], ml[1]);
                          },
                          [&](int sp, float w) {
                            if (idx < total) v += w * cluster.map_shared_rank(sacc, sp)[i * hd + e];
                          })
                          .y;
      if (idx < total) {  // whole warps when hd is a multiple of 32, as quantized outputs require
        const int64_t at = (row * nh + h0 + i) * hd + e;
        out[at] = v / L;
        if (a.qo.q) quantize32(v / L, at, a.qo.q, a.qo.d, a.qo.s, a.qo.tiled_cols);
        if (a.qo.bf16) a.qo.bf16[at] = f32_bf16(v / L);
      }
    }
    cluster.sync();  // no block leaves while another reads its shared memory
  }
}

__global__ void k_attention_merge(KVSeqs seqs, AttnArgs a, int64_t row0, int S, const float* part, float* out) {
  pdl_begin();
  const int64_t row = row0 + blockIdx.x;
  if (find_seq(seqs, row) < 0) return;
  merge_splits(part, row, blockIdx.y, 1, S, a, out);
}

__global__ void k_kv_write(KVSeqs seqs, int64_t row0, const float* k, const float* v, int64_t nkv, int64_t hd) {
  pdl_begin();
  const int64_t row = row0 + blockIdx.x;
  const int si = find_seq(seqs, row);
  if (si < 0) return;
  const KVSeq& s = seqs.s[si];
  const int64_t slot = kv_slot(s, s.pos[row - s.begin]);
  uint16_t* K = static_cast<uint16_t*>(const_cast<void*>(s.k));
  uint16_t* V = static_cast<uint16_t*>(const_cast<void*>(s.v));
  const int64_t w = nkv * hd;
  for (int64_t e = threadIdx.x; e < w; e += blockDim.x) {
    K[slot * w + e] = f32_bf16(k[row * w + e]);
    V[slot * w + e] = f32_bf16(v[row * w + e]);
  }
}

// One block per (row, head) of q, then of k and of v (when given): q and k get their RMS norm and
// rotary, v its weightless norm (v_norm); a k or v head then goes to its row's KV slot as bf16
// (rows of no sequence in `seqs` are left to kv_write). In place, so q, k, v keep what was done.
__global__ void k_attention_inputs(float* q, float* k, float* v, AttnInputArgs a, const int32_t* pos,
                                   const float* inv_freq, KVSeqs seqs) {
  pdl_begin();
  __shared__ float red[32];
  extern __shared__ float tmp[];
  const int64_t per = a.nh + (k ? 2 * a.nkv : 0);
  const int64_t row = blockIdx.x / per, h = blockIdx.x % per;
  const float p = float(pos[row]);
  if (h < a.nh) {
    head_norm_rope(q + (row * a.nh + h) * a.hd, a.hd, 1, a.q_norm, a.eps, a.add_one, p, inv_freq, tmp, red);
    return;
  }
  const bool is_k = h < a.nh + a.nkv;
  const int64_t kh = is_k ? h - a.nh : h - a.nh - a.nkv;
  float* xr = (is_k ? k : v) + (row * a.nkv + kh) * a.hd;
  if (is_k)
    head_norm_rope(xr, a.hd, 1, a.k_norm, a.eps, a.add_one, p, inv_freq, tmp, red);
  else
    head_norm_rope(xr, a.hd, a.v_norm, nullptr, a.eps, 0, p, nullptr, tmp, red);
  const int si = find_seq(seqs, row);
  if (si < 0) return;
  const KVSeq& s = seqs.s[si];
  const int64_t slot = kv_slot(s, s.pos[row - s.begin]);
  uint16_t* dst = static_cast<uint16_t*>(const_cast<void*>(is_k ? s.k : s.v)) + (slot * a.nkv + kh) * a.hd;
  __syncthreads();  // each thread wrote its own elements of xr, but the rotation's pairs cross threads
  for (int64_t e = threadIdx.x; e < a.hd; e += blockDim.x) dst[e] = f32_bf16(xr[e]);
}

// Query heads a block takes: those sharing a KV head read its K and V once. Up to 4 rows (decode
// of a few sequences) take one head a block: 4 times the blocks, each with fewer registers, so a
// warp's loads go out 8 keys at a time (KU, launch()) and the splits' warps finish in fewer rounds;
// the K/V rows a group's blocks share come from L2. Past 4 rows the GPU is full without it and the
// repeated K/V reads cost more than they save (docs/cuda.md has the A/B). MARKBASE_CUDA_ATTN_GH=N
// caps the heads a block at N for every launch.
int heads_per_block(const AttnArgs& a) {
  static const int gh_cap = [] {
    const char* v = std::getenv("MARKBASE_CUDA_ATTN_GH");
    return v ? std::max(1, std::atoi(v)) : 0;
  }();
  const int64_t group = a.n_heads / a.n_kv;
  int cap = a.hd > 256 ? 4 : 8;
  if (gh_cap > 0) cap = std::min(cap, gh_cap);
  else if (a.n_rows <= kOneHeadRows) cap = 1;
  for (int gh = cap; gh > 1; gh /= 2)
    if (group % gh == 0) return gh;
  return 1;
}

void rows_of(const KVSeqs& seqs, int64_t& row0, int64_t& rows) {
  int64_t lo = INT64_MAX, hi = 0;
  for (int i = 0; i < seqs.n; ++i) {
    lo = seqs.s[i].begin < lo ? seqs.s[i].begin : lo;
    hi = seqs.s[i].begin + seqs.s[i].count > hi ? seqs.s[i].begin + seqs.s[i].count : hi;
  }
  row0 = lo == INT64_MAX ? 0 : lo;
  rows = hi > row0 ? hi - row0 : 0;
}

// Clusters of up to 16 blocks are beyond the portable 8 and must be allowed per kernel.
template <int C, int GH, int KU, bool CL>
void set_attention_attributes() {
  static bool done = false;  // > 48 KB of shared memory must be asked for once per kernel
  if (done) return;
  cudaFuncSetAttribute(k_attention<C, GH, KU, CL>, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
  if (CL) cudaFuncSetAttribute(k_attention<C, GH, KU, CL>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  done = true;
}

// k_attention's dynamic shared memory: each warp's accumulators and (m, l) for the block's heads.
size_t attention_smem_bytes(int64_t hd, int gh) { return size_t(kAttnWarps * gh) * (size_t(hd) + 2) * sizeof(float); }

template <int C, int GH, int KU, bool CL>
void launch_attention(const KVSeqs& seqs, const AttnArgs& a, int64_t row0, int64_t rows, int S, const float* q,
                      float* out, float* part, cudaStream_t st) {
  const size_t smem = attention_smem_bytes(a.hd, GH);
  set_attention_attributes<C, GH, KU, CL>();
  const dim3 grid(unsigned(rows), unsigned(a.n_heads / GH), unsigned(S));
  launch_kernel_clustered(k_attention<C, GH, KU, CL>, grid, kAttnWarps * 32, smem, st, CL ? unsigned(S) : 1u, seqs, a,
                          row0, S, q, out, part);
}

template <int C, int GH>
void launch(const KVSeqs& seqs, const AttnArgs& a, int64_t row0, int64_t rows, int S, bool cluster, const float* q,
            float* out, float* part, cudaStream_t st) {
  // Keys' loads in flight a warp, as the registers allow: a block of one head has room for twice as many.
  constexpr int KU = (C == 1 ? 4 : 2) * (GH == 1 ? 2 : 1);
  if (cluster) return launch_attention<C, GH, KU, true>(seqs, a, row0, rows, S, q, out, part, st);
  launch_attention<C, GH, KU, false>(seqs, a, row0, rows, S, q, out, part, st);
}

// The largest cluster of attention blocks the GPU schedules (MARKBASE_CUDA_ATTN_CLUSTER caps it;
// 0 or 1: no clusters, splits merged by k_attention_merge).
int attention_cluster_max() {
  static const int n = [] {
    const char* v = std::getenv("MARKBASE_CUDA_ATTN_CLUSTER");
    int cap = v ? std::atoi(v) : 16;
    if (cap <= 1) return 1;
    cap = cap > 16 ? 16 : cap;
    // The largest block (head dim 512, 4 heads) as the probe: clusters of cap blocks must fit a GPC.
    set_attention_attributes<2, 4, 2, true>();
    for (; cap > 1; cap /= 2) {
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = 1;
      attr.val.clusterDim.y = 1;
      attr.val.clusterDim.z = unsigned(cap);
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(1, 1, unsigned(cap));
      cfg.blockDim = dim3(kAttnWarps * 32);
      cfg.dynamicSmemBytes = attention_smem_bytes(512, 4);
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, k_attention<2, 4, 2, true>, &cfg) == cudaSuccess && clusters > 0)
        break;
      (void)cudaGetLastError();
    }
    return cap;
  }();
  return n;
}

// One block a row: its max, the sum of exp(x - max), then each value over the sum in bf16. Row b
// of heads x rows score rows (`ld` apart in s, p and p_lo; head b / rows, query r = b % rows, whose
// own key is column first_hi + r) takes its keys up to its own plus ahead[r] where ahead is given (an
// image's tokens see to its last), or up to the last column if that is past it, and of them those
// within the window counted back from its own key (window > 0), soft-capped first where softcap > 0;
// zeros in every other column (none where first_hi is the last column: every query sees every key).
__global__ void k_softmax_rows_bf16(const float* s, int64_t cols, int64_t ld, int64_t rows, int64_t first_hi,
                                      const int32_t* ahead, int window, float softcap, uint16_t* p, uint16_t* p_lo) {
  pdl_begin();
  __shared__ float red[32];
  const float* row = s + int64_t(blockIdx.x) * ld;
  uint16_t* out = p + int64_t(blockIdx.x) * ld;
  uint16_t* out_lo = p_lo ? p_lo + int64_t(blockIdx.x) * ld : nullptr;
  const int64_t r = int64_t(blockIdx.x) % rows, own = first_hi + r;  // the row's own key
  const int64_t far = own + (ahead ? ahead[r] : 0);
  const int64_t hi = far < cols ? far : cols - 1;
  // The window counts back from the row's own key, not from an image's last (as the attention kernel).
  const int64_t lo = window > 0 && own - window + 1 > 0 ? own - window + 1 : 0;
  auto score = [&](int64_t c) { return softcap > 0.f ? softcap * tanhf(row[c] / softcap) : row[c]; };
  float m = -FLT_MAX;
  for (int64_t c = lo + threadIdx.x; c <= hi; c += blockDim.x) m = fmaxf(m, score(c));
  m = warp_max(m);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = threadIdx.x % 32 < blockDim.x / 32 ? red[threadIdx.x % 32] : -FLT_MAX;
  m = warp_max(m);
  float sum = 0.f;
  for (int64_t c = lo + threadIdx.x; c <= hi; c += blockDim.x) sum += __expf(score(c) - m);
  const float inv = 1.f / block_sum(sum, red);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = c >= lo && c <= hi ? __expf(score(c) - m) * inv : 0.f;
    const uint16_t h = f32_bf16(v);
    out[c] = h;
    if (out_lo) out_lo[c] = bf16_remainder(v, h);
  }
}

// Attention where every query sees every key of its sequence (an image's patches in a ViT), fused:
// S = Q·Kᵀ and O = P·V on the tensor cores (mma m16n8k16 bf16, f32 sums) with an online softmax
// between them, so the [heads, rows, keys] scores never reach memory. Written by hand: cuBLAS has no
// fused attention, cuDNN's (which would cover this) is not among the project's dependencies, and the
// FlashAttention kernels ship for PyTorch. A block takes 64 queries (16 a warp) of one head;
// K and V tiles of 64 keys reach shared memory by cp.async one tile ahead, their rows HDP (head dim
// rounded up to 16) plus 16 bytes wide, so the eight 16-byte rows of an ldmatrix fall on distinct
// banks (K's fragments as stored, V's transposed); dims past hd are zeros. P is rounded to bf16
// before its product (as torch's bf16 SDPA does), its sum kept in f32.
constexpr int kFlashWarps = 4, kFlashRows = 16 * kFlashWarps, kFlashKeys = 64;
template <int HDP>
struct FlashLayout {
  static constexpr int row = HDP * 2 + 16;         // bytes
  static constexpr int tile = kFlashKeys * row;    // a K or V tile
  static constexpr int bytes = 2 * 2 * tile;       // two stages of K and V
};

// q: [rows, nh, hd] bf16; K, V: [>= nk, nh, hd] bf16; out: [rows, nh, hd] f32. scale_log2: the
// scores' scale times log2(e).
template <int HDP>
__global__ void __launch_bounds__(kFlashWarps * 32)
    k_attention_whole(const uint16_t* q, const uint16_t* K, const uint16_t* V, int64_t rows, int64_t nk, int nh,
                      int hd, float scale_log2, float* out) {
  using L = FlashLayout<HDP>;
  constexpr int KS = HDP / 16, NT = HDP / 8;  // k steps of Q·Kᵀ, n tiles of P·V
  extern __shared__ __align__(16) unsigned char fsm[];
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int h = blockIdx.y;
  const int64_t width = int64_t(nh) * hd;
  const int64_t ra = int64_t(blockIdx.x) * kFlashRows + warp * 16 + g, rb = ra + 8;
  const int chunks = hd / 8;  // 16-byte chunks of a row
  // Dims past hd: zeros in every row of both stages (the copies below never write them).
  for (int i = threadIdx.x; i < 4 * kFlashKeys * (HDP / 8 - chunks); i += blockDim.x) {
    const int r = i / (HDP / 8 - chunks), ch = chunks + i % (HDP / 8 - chunks);
    *reinterpret_cast<int4*>(fsm + r * L::row + ch * 16) = make_int4(0, 0, 0, 0);
  }
  uint32_t qa[KS][4];
  auto q_pair = [&](int64_t r, int d) -> uint32_t {
    return r < rows && d < hd ? *reinterpret_cast<const uint32_t*>(q + r * width + int64_t(h) * hd + d) : 0u;
  };
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const int d = kk * 16 + 2 * c;
    qa[kk][0] = q_pair(ra, d);
    qa[kk][1] = q_pair(rb, d);
    qa[kk][2] = q_pair(ra, d + 8);
    qa[kk][3] = q_pair(rb, d + 8);
  }
  auto load_tile = [&](int stage, int64_t k0) {
    for (int i = threadIdx.x; i < 2 * kFlashKeys * chunks; i += blockDim.x) {
      const int kv = i / (kFlashKeys * chunks), j = (i / chunks) % kFlashKeys, ch = i % chunks;
      const uint16_t* base = kv ? V : K;
      const int64_t key = k0 + j;
      unsigned char* dst = fsm + (stage * 2 + kv) * L::tile + j * L::row + ch * 16;
      if (key < nk) cp_async16(dst, base + key * width + int64_t(h) * hd + ch * 8);
      else cp_async16_or_zeros(dst, base, 0);
    }
    cp_async_commit();
  };
  float o[NT][4] = {};
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g and g + 8
  const int tiles = int((nk + kFlashKeys - 1) / kFlashKeys);
  load_tile(0, 0);
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) load_tile((t + 1) & 1, int64_t(t + 1) * kFlashKeys);
    else cp_async_commit();  // an empty group: the wait below always leaves one
    cp_async_wait<1>();
    __syncthreads();
    const unsigned char* Ks = fsm + ((t & 1) * 2) * L::tile;
    const unsigned char* Vs = Ks + L::tile;
    float s[8][4] = {};
    // Lane l addresses row l % 8 of matrix l / 8: keys 16 jp + 8 (l / 16) + l % 8, dims 16 kk + 8 (l / 8 % 2).
    const unsigned char* kl = Ks + ((lane >> 4) * 8 + (lane & 7)) * L::row + ((lane >> 3) & 1) * 16;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t r[4];
        ldmatrix_x4(r, kl + jp * 16 * L::row + kk * 32);
        mma_bf16(s[2 * jp], qa[kk], make_uint2(r[0], r[1]));
        mma_bf16(s[2 * jp + 1], qa[kk], make_uint2(r[2], r[3]));
      }
    // The scores stay unscaled (scale > 0 keeps their order): exp2(s·scale_log2 - m·scale_log2) is one fma and
    // one ex2 a score. Keys past nk (the last tile's) drop out as -inf.
    if (int64_t(t + 1) * kFlashKeys > nk) {
      const int64_t key0 = int64_t(t) * kFlashKeys + 2 * c;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (key0 + j * 8 + e >= nk) s[j][e] = s[j][2 + e] = -INFINITY;
    }
    float t0 = -INFINITY, t1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      t0 = fmaxf(t0, fmaxf(s[j][0], s[j][1]));
      t1 = fmaxf(t1, fmaxf(s[j][2], s[j][3]));
    }
    t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, 1));
    t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, 2));
    t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, 1));
    t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, 2));
    const float n0 = fmaxf(m0, t0), n1 = fmaxf(m1, t1);  // finite: every tile has a key in range
    const float c0 = ex2_ftz((m0 - n0) * scale_log2), c1 = ex2_ftz((m1 - n1) * scale_log2);
    m0 = n0;
    m1 = n1;
    l0 *= c0;
    l1 *= c1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      o[n][0] *= c0;
      o[n][1] *= c0;
      o[n][2] *= c1;
      o[n][3] *= c1;
    }
    const float b0 = -n0 * scale_log2, b1 = -n1 * scale_log2;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j][0] = ex2_ftz(fmaf(s[j][0], scale_log2, b0));
      s[j][1] = ex2_ftz(fmaf(s[j][1], scale_log2, b0));
      s[j][2] = ex2_ftz(fmaf(s[j][2], scale_log2, b1));
      s[j][3] = ex2_ftz(fmaf(s[j][3], scale_log2, b1));
      l0 += s[j][0] + s[j][1];
      l1 += s[j][2] + s[j][3];
    }
    // O += P·V, 16 keys a step: P's A fragment is two score tiles' accumulators (rows g and g + 8).
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint32_t a[4] = {pack_bf16_rn(s[2 * ks][0], s[2 * ks][1]), pack_bf16_rn(s[2 * ks][2], s[2 * ks][3]),
                             pack_bf16_rn(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             pack_bf16_rn(s[2 * ks + 1][2], s[2 * ks + 1][3])};
      // Transposed: lane l addresses keys 16 ks + 8 (l / 8 % 2) + l % 8, dims 8 (2 np + l / 16).
      const unsigned char* vl = Vs + (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * L::row + (lane >> 4) * 16;
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, vl + np * 32);
        mma_bf16(o[2 * np], a, make_uint2(r[0], r[1]));
        mma_bf16(o[2 * np + 1], a, make_uint2(r[2], r[3]));
      }
    }
    __syncthreads();  // the next iteration's copy overwrites this stage
  }
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float i0 = 1.f / l0, i1 = 1.f / l1;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int d = n * 8 + 2 * c;
    if (d >= hd) continue;
    if (ra < rows)
      *reinterpret_cast<float2*>(out + ra * width + int64_t(h) * hd + d) = make_float2(o[n][0] * i0, o[n][1] * i0);
    if (rb < rows)
      *reinterpret_cast<float2*>(out + rb * width + int64_t(h) * hd + d) = make_float2(o[n][2] * i1, o[n][3] * i1);
  }
}

// Rows [rows, nh, hd] (row stride ld) to heads [nh, rows, hd] in bf16, with each value's remainder after
// bf16 in lo: a head's rows, and a KV head's query heads, then sit in one contiguous matrix.
// Where element i of heads [nh, rows, hd] lies in rows [rows, nh, hd] of row stride ld.
__device__ __forceinline__ int64_t row_index_of_head_element(int64_t i, int64_t rows, int64_t hd, int64_t ld) {
  const int64_t d = i % hd, r = (i / hd) % rows, h = i / (hd * rows);
  return r * ld + h * hd + d;
}

__global__ void k_rows_to_heads_bf16(const float* x, int64_t ld, int64_t rows, int64_t nh, int64_t hd, uint16_t* hi,
                                     uint16_t* lo) {
  pdl_begin();
  const int64_t total = rows * nh * hd;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[row_index_of_head_element(i, rows, hd, ld)];
    const uint16_t b = f32_bf16(v);
    hi[i] = b;
    lo[i] = bf16_remainder(v, b);
  }
}
// Heads [nh, rows, hd] back to rows [rows, nh, hd] (row stride ld).
__global__ void k_heads_to_rows(const float* x, int64_t rows, int64_t nh, int64_t hd, int64_t ld, float* out) {
  pdl_begin();
  const int64_t total = rows * nh * hd;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    out[row_index_of_head_element(i, rows, hd, ld)] = x[i];
}

// Keys k0 .. k0 + nk - 1 of a sequence's store (pages or a ring) into contiguous rows of
// row_elems bf16 (a multiple of 8), 16 bytes a thread.
__global__ void k_gather_kv(KVSeq s, int64_t k0, int64_t nk, int64_t row_elems, uint16_t* k, uint16_t* v) {
  pdl_begin();
  const int64_t per = row_elems / 8, total = nk * per;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = kv_slot(s, k0 + i / per) * per + i % per;
    reinterpret_cast<int4*>(k)[i] = reinterpret_cast<const int4*>(s.k)[at];
    reinterpret_cast<int4*>(v)[i] = reinterpret_cast<const int4*>(s.v)[at];
  }
}

// Chunked local attention (backend.h's local_attention), one warp per (frame, head): a query reads
// `left` keys at most, so the warp's lanes share each dot product over the head dims and the
// logits sit in shared memory; the softmax and the value sum follow the host's order.
constexpr int kLocalWarps = 4;
constexpr int kLocalDimsPerLane = kLocalAttnMaxHeadDim / 32;
__global__ void k_local_attention(const float* q, const float* k, const float* v, const float* q_gain,
                                  const float* rel, const uint8_t* valid, int64_t n, int64_t nh, int64_t hd,
                                  LocalAttnArgs a, float* out) {
  pdl_begin();
  extern __shared__ float local_logits[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kLocalWarps + warp;
  if (item >= n * nh) return;
  const int64_t t = item / nh, h = item % nh, width = nh * hd;
  float* logits = local_logits + warp * a.context;
  const int64_t first = t / a.chunk * a.chunk - a.left;
  float qs[kLocalDimsPerLane], o[kLocalDimsPerLane];
#pragma unroll
  for (int r = 0; r < kLocalDimsPerLane; ++r) {
    const int64_t i = lane + 32 * r;
    qs[r] = i < hd ? q[t * width + h * hd + i] * a.q_scale * q_gain[i] : 0.f;
    o[r] = 0.f;
  }
  float mx = -FLT_MAX;
  for (int64_t j = 0; j < a.context; ++j) {
    const int64_t s = first + j, d = t - s;
    float logit = a.invalid_logit;
    if (s >= 0 && s < n && valid[s] && d >= 0 && d < a.left) {
      const float* ks = k + s * width + h * hd;
      const float* rs = rel + (d + a.rel_offset) * width + h * hd;
      float content = 0.f, position = 0.f;
#pragma unroll
      for (int r = 0; r < kLocalDimsPerLane; ++r) {
        const int64_t i = lane + 32 * r;
        if (i < hd) {
          content += qs[r] * (ks[i] * a.k_scale);
          position += qs[r] * rs[i];
        }
      }
      content = warp_sum(content);
      position = warp_sum(position);
      logit = tanhf((content + position) / a.logit_cap) * a.logit_cap;
    }
    if (lane == 0) logits[j] = logit;
    mx = fmaxf(mx, logit);
  }
  __syncwarp();
  float sum = 0.f;
  for (int64_t j = 0; j < a.context; ++j) sum += expf(logits[j] - mx);
  for (int64_t j = 0; j < a.context; ++j) {
    const int64_t s = first + j;
    if (s < 0 || s >= n) continue;  // zero values
    const float p = expf(logits[j] - mx) / sum;
    const float* vs = v + s * width + h * hd;
#pragma unroll
    for (int r = 0; r < kLocalDimsPerLane; ++r) {
      const int64_t i = lane + 32 * r;
      if (i < hd) o[r] += p * vs[i];
    }
  }
#pragma unroll
  for (int r = 0; r < kLocalDimsPerLane; ++r) {
    const int64_t i = lane + 32 * r;
    if (i < hd) out[t * width + h * hd + i] = o[r];
  }
}

}  // namespace

void softmax_rows_bf16(const float* s, int64_t heads, int64_t rows, int64_t cols, int64_t ld, int64_t first_hi,
                       const int32_t* ahead, int window, float softcap, uint16_t* p, uint16_t* p_lo, cudaStream_t st) {
  if (heads * rows * cols == 0) return;
  launch_kernel(k_softmax_rows_bf16, unsigned(heads * rows), 256, 0, st, s, cols, ld, rows, first_hi, ahead, window,
                softcap, p, p_lo);
  check_launch("softmax rows");
}

bool attention_whole(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t rows, int64_t nk, int64_t nh,
                     int64_t hd, float scale, float* out, cudaStream_t st) {
  if (hd % 8 != 0 || hd > 80 || nk < 1 || !(scale > 0.f)) return false;
  if (rows == 0) return true;
  const dim3 grid(unsigned((rows + kFlashRows - 1) / kFlashRows), unsigned(nh));
  const float scale_log2 = scale * 1.4426950408889634f;
  if (hd <= 64)
    launch_kernel(k_attention_whole<64>, grid, kFlashWarps * 32, FlashLayout<64>::bytes, st, q, k, v, rows, nk,
                  int(nh), int(hd), scale_log2, out);
  else
    launch_kernel(k_attention_whole<80>, grid, kFlashWarps * 32, FlashLayout<80>::bytes, st, q, k, v, rows, nk,
                  int(nh), int(hd), scale_log2, out);
  check_launch("attention of whole sequences");
  return true;
}

void rows_to_heads_bf16(const float* x, int64_t ld, int64_t rows, int64_t nh, int64_t hd, uint16_t* hi, uint16_t* lo,
                        cudaStream_t st) {
  const int64_t n = rows * nh * hd;
  if (n == 0) return;
  launch_kernel(k_rows_to_heads_bf16, grid_1d(n), 256, 0, st, x, ld, rows, nh, hd, hi, lo);
  check_launch("rows_to_heads_bf16");
}

void heads_to_rows(const float* x, int64_t rows, int64_t nh, int64_t hd, int64_t ld, float* out, cudaStream_t st) {
  const int64_t n = rows * nh * hd;
  if (n == 0) return;
  launch_kernel(k_heads_to_rows, grid_1d(n), 256, 0, st, x, rows, nh, hd, ld, out);
  check_launch("heads_to_rows");
}

void gather_kv(const KVSeq& s, int64_t k0, int64_t nk, int64_t row_elems, uint16_t* k, uint16_t* v, cudaStream_t st) {
  if (nk == 0) return;
  launch_kernel(k_gather_kv, grid_1d(nk * row_elems / 8), 256, 0, st, s, k0, nk, row_elems, k, v);
  check_launch("gather KV");
}

void local_attention(const float* q, const float* k, const float* v, const float* q_gain, const float* rel_keys,
                     const uint8_t* valid, int64_t n, int64_t heads, int64_t hd, const LocalAttnArgs& a, float* out,
                     cudaStream_t st) {
  if (n * heads == 0) return;
  const int64_t blocks = (n * heads + kLocalWarps - 1) / kLocalWarps;
  launch_kernel(k_local_attention, unsigned(blocks), kLocalWarps * 32, size_t(kLocalWarps * a.context) * 4, st, q, k,
                v, q_gain, rel_keys, valid, n, heads, hd, a, out);
  check_launch("local_attention");
}

namespace {
// Splits of the keys a row's attention takes, and whether they merge in a cluster.
struct AttnPlan {
  int S = 1;
  bool cluster = false;
};
AttnPlan attention_plan(const AttnArgs& a) {
  // Enough splits to fill the GPU twice over, of at least 32 keys each and at most 512: a warp
  // walks its keys one after another, so in decode (a few rows) the keys per warp, not the bytes,
  // set the time. Prefill rows fill the GPU alone (one split, no merge).
  // (Longer splits, fewer of them, were slower on E4B Q4_0 tg128 after 512 tokens: 359 tok/s at
  // 32 keys, 341 at 64, 301 at 128, 240 at 256 - one split, no merge.)
  // Where one split's blocks already cover every SM (E4B's 128 decode rows: 256 blocks), more splits
  // only add the merge: as few as 512 keys a split allow (E4B Q4_0 at 128 streams after 128-token
  // prompts on an H100: 14,326 -> 15,525 tok/s; docs/cuda.md).
  const int64_t sms = sm_count();
  const int64_t base = a.n_rows * (a.n_heads / heads_per_block(a));
  const int64_t fill = (attention_waves() * sms + base - 1) / (base > 0 ? base : 1);
  const int64_t least = (a.max_keys + 511) / 512;
  int64_t s = base >= sms ? least : std::max(least, std::min(fill, (a.max_keys + 31) / 32));
  s = s < 1 ? 1 : s > 32 ? 32 : s;
  AttnPlan p;
  p.S = int(s);
  // A cluster's worth of splits of at most 128 keys merge in the cluster: one kernel, not two (E4B
  // Q4_0 tg128 +5-6%, 8 streams +4%). Not for more than 16 rows: at 64 streams clusters of 3 were
  // 3% slower than the merge kernel, at 128 (2 splits) the same.
  const int64_t cap = attention_cluster_max();
  if (s > 1 && cap > 1 && a.n_rows <= kFewRows && (a.max_keys + cap - 1) / cap <= 128) {
    p.S = int(std::min(s, cap));
    p.cluster = true;
  }
  return p;
}
}  // namespace

int64_t attention_partial_floats(const AttnArgs& a) {
  const AttnPlan p = attention_plan(a);
  return p.S > 1 && !p.cluster ? a.n_rows * a.n_heads * p.S * (a.hd + 2) : 0;
}

void attention(const KVSeqs& seqs, const AttnArgs& a, const float* q, float* out, float* partial, cudaStream_t st) {
  int64_t row0, rows;
  rows_of(seqs, row0, rows);
  if (rows == 0) return;
  const AttnPlan plan = attention_plan(a);
  const int S = plan.S;
  const int gh = heads_per_block(a);
  const int c = a.hd > 256 ? 2 : 1;
#define MB_ATTN(CC, GG) launch<CC, GG>(seqs, a, row0, rows, S, plan.cluster, q, out, partial, st)
  if (c == 1) {
    if (gh == 8)
      MB_ATTN(1, 8);
    else if (gh == 4)
      MB_ATTN(1, 4);
    else if (gh == 2)
      MB_ATTN(1, 2);
    else
      MB_ATTN(1, 1);
  } else {
    if (gh == 4)
      MB_ATTN(2, 4);
    else if (gh == 2)
      MB_ATTN(2, 2);
    else
      MB_ATTN(2, 1);
  }
#undef MB_ATTN
  check_launch("attention");
  if (S > 1 && !plan.cluster) {
    launch_kernel(k_attention_merge, dim3(unsigned(rows), unsigned(a.n_heads)), 128, 0, st, seqs, a, row0, S, partial,
                  out);
    check_launch("attention merge");
  }
}

void attention_inputs(float* q, float* k, float* v, int64_t n, const AttnInputArgs& a, const int32_t* pos,
                      const float* inv_freq, const KVSeqs& seqs, cudaStream_t st) {
  if (n == 0) return;
  const int64_t per = a.nh + (k ? 2 * a.nkv : 0);
  const int threads = a.hd >= 512 ? 256 : a.hd >= 256 ? 256 : 128;
  launch_kernel(k_attention_inputs, unsigned(n * per), threads, size_t(a.hd) * 4, st, q, k, v, a, pos, inv_freq, seqs);
  check_launch("attention inputs");
}

void kv_write(const KVSeqs& seqs, const float* k, const float* v, int64_t nkv, int64_t hd, cudaStream_t st) {
  int64_t row0, rows;
  rows_of(seqs, row0, rows);
  if (rows == 0) return;
  launch_kernel(k_kv_write, unsigned(rows), 256, 0, st, seqs, row0, k, v, nkv, hd);
  check_launch("kv_write");
}

}  // namespace mb::cuda
