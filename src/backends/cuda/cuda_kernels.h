// Launchers of the CUDA backend's kernels: plain host functions over device pointers, each
// enqueued on `stream` and returning at once. Shapes follow backend.h (row-major, f32 activations);
// weights are described by GpuWeight. Nothing here knows about models.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace mb::cuda {

// A weight on the GPU in the layout the kernels read. Block types are stored as planes so that a
// warp's loads are 16-byte aligned and coalesced (ggml's 18- and 34-byte blocks are not):
//   Q4_0: qs = rows x blocks x 16 bytes (element j of a block in byte j % 16, low nibble for
//         j < 16), scale = rows x blocks halves;  Q8_0: qs = rows x blocks x 32 int8, scale as Q4_0;
//   Q4_K: ggml's 144-byte super-blocks as they are (already 16-byte multiples), scale unused;
//   F32, BF16: plain rows in qs.
enum class WType : int { F32, BF16, Q8_0, Q4_0, Q4_K };
struct GpuWeight {
  WType type = WType::F32;
  int64_t rows = 0, cols = 0;          // all rows (experts stacked: E * rows of one expert)
  const void* qs = nullptr;
  const uint16_t* scale = nullptr;     // halves
  const uint16_t* bf16 = nullptr;      // a bf16 copy for large products, or null
  // Q8_0/Q4_0 in the tensor-core kernels' fragment order (kernels_mmq.cu, make_frag), or null.
  const void* frag = nullptr;
  const void* frag_scale = nullptr;
  int fixed = 0;                       // a loaded weight: never written, so readable before pdl_begin
};

// Activations quantized to int8 in blocks of 32 (for the integer dot products of Q8_0/Q4_0/Q4_K):
// q [n, k] int8, d [n, k/32] scale, s [n, k/32] = d * sum(q) of each block.
struct QuantX {
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* s = nullptr;
  int64_t k = 0;
};

void quantize_x(const float* x, int64_t n, int64_t k, int8_t* q, float* d, float* s, cudaStream_t st);
// Where a norm also writes its output as quantize_x would (q null: it does not).
struct QuantOut {
  int8_t* q = nullptr;
  float* d = nullptr;
  float* s = nullptr;
  int64_t tiled_cols = 0;  // non-zero: q and d in tile_x's layout for the block products (rows a multiple of 8; no s)
  uint16_t* bf16 = nullptr;  // non-null (q null): the output also goes out as bf16 (f32_bf16), for cuBLAS's products
};

// Whether GEMVs over fixed weights load their first weights before waiting for the kernel before
// them (default; MARKBASE_CUDA_EARLY_LOADS=0: after).
bool gemv_early_loads();
// Counts calls that may write device memory (every launch and CUDA or cuBLAS call of the backend):
// an activation quantized by the kernel that wrote it is reused while the count has not moved.
extern std::atomic<uint64_t> g_device_calls;
// GEMV grids hold at most this many times the blocks the GPU keeps resident, their warps looping
// over rows (MARKBASE_CUDA_GEMV_WAVES, default 2: E4B Q4_0 tg128 +2% over 0, a block per 8 rows).
int gemv_resident_waves();
// The current GPU's multiprocessors (asked once).
int sm_count();
// Waves of blocks (a block a multiprocessor each) that decode attention's key splits aim for
// (MARKBASE_CUDA_ATTN_WAVES, default 2).
int attention_waves();
// y[n, m] = x[n, k] · wᵀ for n <= kGemvMaxRows. x is read as f32 (F32/BF16 weights) or as xq.
inline constexpr int kGemvMaxRows = 8;
void gemv(const GpuWeight& w, const float* x, const QuantX* xq, int64_t n, float* y, cudaStream_t st);

// Several weights of one type and width over the same rows of x in one launch: ys[i][n, rows_i] =
// x · ws[i]ᵀ (nw <= 3, rows a multiple of 8 elements for F32/BF16); glu: ys[0] = gelu_tanh(x ·
// ws[0]ᵀ) * (x · ws[1]ᵀ). Block types read xq (quantize_x of x).
void gemv_multi(const GpuWeight* ws, float* const* ys, int nw, bool glu, const float* x, const QuantX* xq, int64_t n,
                cudaStream_t st);
// y[n, rows] = gelu_tanh(x · wᵀ) * m[n, rows] (n <= kGemvMaxRows).
void gemv_gelu_times(const GpuWeight& w, const float* x, const QuantX* xq, int64_t n, const float* m, float* y,
                     cudaStream_t st);
// Tensor-core products of Q8_0/Q4_0 weights (kernels_mmq.cu) with activations tiled for them:
// tile_x quantizes rows as quantize_x does into groups of 8 rows in mma fragment order, q
// [rows, k] int8 and d [rows, k/32] floats; row r reads x row src[r] / div (src null: r, zeros
// from n on; src[r] < 0: zeros). rows: tiled_x_rows(n) for a dense product.
bool mmq_supports(const GpuWeight& w);  // Q8_0 or Q4_0 with rows a multiple of 64
int64_t tiled_x_rows(int64_t n);
// A copy of w (mmq_supports) in the order the tensor-core kernels load it: frag_bytes(w) and
// frag_scale_bytes(w) of device memory, filled by make_frag; products whose weights all have one read it.
int64_t frag_bytes(const GpuWeight& w);
int64_t frag_scale_bytes(const GpuWeight& w);
void make_frag(const GpuWeight& w, void* frag, void* frag_scale, cudaStream_t st);
void tile_x(const float* x, int64_t n, int64_t k, const int32_t* src, int div, int64_t rows, int8_t* q, float* d,
            cudaStream_t st);
// ys[i][n, rows_i] = x · ws[i]ᵀ (Plain), ys[0] = gelu_tanh(x · ws[0]ᵀ) * (x · ws[1]ᵀ) (Glu) or
// gelu_tanh(x · ws[0]ᵀ) * m (GeluTimes); nw <= 3 weights of one type and width. K is cut into
// `splits` (mmq_splits) whose partial sums go to `part` [splits, n, Σ rows] and are added in a
// second kernel (not where mmq_direct: part may be null then).
enum class MmqMode : int { Plain = 0, Glu = 1, GeluTimes = 2 };
// tile_groups: the kernel's groups of 8 rows a tile where not groups_per_tile's (mmq_wgmma_groups).
int64_t mmq_splits(const GpuWeight* ws, int nw, int64_t n, int tile_groups = 0);
// Whether the product kernel writes ys itself (one split; the GLU epilogue needs fragment-ordered weights).
bool mmq_direct(const GpuWeight* ws, int nw, MmqMode mode, int64_t splits);
void mmq(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, const int8_t* xq,
         const float* xd, int64_t n, int64_t splits, float* part, cudaStream_t st);
// mmq's products (same modes, splits and direct writes) on bf16 activation rows xb [n, k], where every
// weight is Q4_0 with its fragment-ordered copy (mmq_bf16_supports): exact weights against bf16
// activations, no quantization of x. warpgroup: on Hopper's warpgroup instructions (wgmma; an sm_90 GPU
// only, the kernel is sm_90a's), for more rows: the weights rounded to bf16 as they are unpacked (their
// bf16 copies' values), tiles of 8 mmq_wgmma_groups(n) rows, splits from mmq_splits(..., mmq_wgmma_groups(n)).
bool mmq_bf16_supports(const GpuWeight* ws, int nw);
int mmq_wgmma_groups(int64_t n);
void mmq_bf16(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, const uint16_t* xb,
              int64_t n, int64_t splits, float* part, bool warpgroup, cudaStream_t st);
// Experts: pairs p (token p / k, expert experts[p]) sorted into per-expert tiles on the device, of
// 8 * moe_tile_groups rows at most (up to 64, from the mean pairs an expert: a tile's sums live in
// registers sized for its groups). moe_tiles writes row_pair [moe_tiled_rows] (tiled row -> pair, -1
// for padding), tiles [moe_max_tiles][4] and their count; mmq_experts, given the same pairs and E, then
// computes y[pair, rows_per_expert] = W[expert] · x of each pair's tiled row (tile_x with src =
// row_pair), or with glu (w fragment-ordered, each expert's rows gate then up) y[pair, rows_per_expert /
// 2] = gelu_tanh(gate · x) * (up · x).
int64_t moe_tiled_rows(int64_t pairs, int64_t E);
int moe_tile_groups(int64_t pairs, int64_t E);
int64_t moe_max_tiles(int64_t pairs, int64_t E);
void moe_tiles(const int32_t* experts, int64_t pairs, int64_t E, int32_t* row_pair, int32_t* tiles, int32_t* n_tiles,
               cudaStream_t st);
void mmq_experts(const GpuWeight& w, int64_t rows_per_expert, int64_t pairs, int64_t E, const int8_t* xq,
                 const float* xd, const int32_t* tiles, const int32_t* n_tiles, const int32_t* row_pair, bool glu,
                 float* y, cudaStream_t st);
// Rows of w as bf16 into out [rows, cols] (for cuBLAS).
void dequant_bf16(const GpuWeight& w, int64_t row0, int64_t rows, uint16_t* out, cudaStream_t st);
void f32_to_bf16(const float* x, int64_t n, uint16_t* out, cudaStream_t st);
// A clipped linear's passes around its product: x clamped to [lo, hi] as it is rounded to bf16; y clamped
// (where `clips`) and then activated: SiLU, or gelu_tanh(y) · times. The separate ops' expressions.
void clamp_to_bf16(const float* x, int64_t n, float lo, float hi, uint16_t* out, cudaStream_t st);
enum class ClipAct { None = 0, Silu = 1, GeluTanhTimes = 2 };
void clamp_activate(float* y, int64_t n, bool clips, float lo, float hi, ClipAct act, const float* times,
                    cudaStream_t st);

// Mixture of experts, pair p = token * k + j reading expert ids[p]:
// h[p, rows_per_expert] = W[ids[p]] · x[p / k (x_per_pair ? p : p / k)]; glu (W's rows per expert are gate then
// up, I each): h[p, I] = gelu_tanh(gate · x) * (up · x)
void moe_gemv(const GpuWeight& w, int64_t rows_per_expert, const float* x, const QuantX* xq, const int32_t* ids,
              int64_t pairs, int k, bool x_per_pair, bool glu, float* h, cudaStream_t st);
// out[t, H] = sum_j weights[t, j] * y[t * k + j, H]
void moe_combine(const float* y, const float* weights, int64_t n, int k, int64_t H, float* out, cudaStream_t st);
// act[p, I] = gelu_tanh(h[p, :I]) * h[p, I:2I]
void gelu_split_mul(const float* h, int64_t pairs, int64_t I, float* act, cudaStream_t st);
void route_topk(const float* logits, int64_t n, int64_t E, int k, const float* per_expert_scale, float* weights,
                int32_t* experts, cudaStream_t st);
// ids[r] = the first maximum of row r of x [rows, V], -1 for a row with a non-finite value.
// core/token_pick.h's TokenPick, as the kernels take it.
struct PickArgs {
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
  double u;
};
// Candidates the device sorts for top-k / top-p; a top_k above it, or a nucleus longer than it
// without top-k, gives -2 (the host picks that row).
inline constexpr int kPickList = 1024;
// ids[r] = core/token_pick.h's pick of row r of x [rows, V] by picks[r] (device memory), -1 where
// the row holds a non-finite value, -2 where its top-k or nucleus is longer than kPickList
// (sample_row_sorted picks those).
void sample_rows(const float* x, int64_t rows, int64_t V, const PickArgs* picks, int32_t* ids, cudaStream_t st);
// *id = the pick of one row of finite logits by sorting it whole: keys and sorted hold V numbers,
// temp sample_sort_temp_bytes(V) bytes.
size_t sample_sort_temp_bytes(int64_t V);
void sample_row_sorted(const float* row, int64_t V, const PickArgs& pick, uint64_t* keys, uint64_t* sorted,
                       void* temp, size_t temp_bytes, int32_t* id, cudaStream_t st);
void argmax_rows(const float* x, int64_t rows, int64_t V, int32_t* ids, cudaStream_t st);

// Elementwise and normalisation ops (backend.h semantics).
void embed(const GpuWeight& table, const int32_t* ids, int64_t n, float scale, float* out, cudaStream_t st);
void rms_norm(const float* x, const float* w, float eps, bool add_one, int64_t rows, int64_t cols, float* y,
              cudaStream_t st, QuantOut qo = {});
void rope(float* x, int64_t n, int64_t heads, int64_t hd, const int32_t* pos, const float* inv_freq,
          cudaStream_t st);
void rms_norm_rope(float* x, int64_t n, int64_t heads, int64_t hd, const float* w, float eps, bool add_one,
                   const int32_t* pos, const float* inv_freq, cudaStream_t st);
void add_rms_norm(float* x, float* branch, const float* w, float eps, bool add_one, float scale, int64_t rows,
                  int64_t cols, cudaStream_t st, QuantOut qo = {});
void add_rms_norm_norm(float* x, float* branch, const float* w, float eps, bool add_one, float scale,
                       const float* w_next, float* y, int64_t rows, int64_t cols, cudaStream_t st, QuantOut qo = {});
// out_bf16 non-null: out also goes out as bf16 (for the cuBLAS product that reads it next).
void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n, cudaStream_t st, uint16_t* out_bf16 = nullptr);
void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t st);
void mul(const float* a, const float* b, float* out, int64_t n, int64_t bn, cudaStream_t st);
// dst[i] = Σ_j src[rows[i·group + j]] · scale (backend.h's gather_sum_rows); rows in device memory.
void gather_sum_rows(const float* src, int64_t cols, const int32_t* rows, int64_t n, int64_t group, float scale,
                     float* dst, cudaStream_t st);
// out[i] = a[i] + b[i % bn]
void add_bcast(const float* a, const float* b, float* out, int64_t n, int64_t bn, cudaStream_t st);
void silu(float* x, int64_t n, cudaStream_t st);
// backend.h's layer_norm (b may be null), im2col, glu_causal_conv (w [D, K]) and local_attention
// (head dims up to kLocalAttnMaxHeadDim; context * 16 bytes of shared memory).
void layer_norm(const float* x, const float* w, const float* b, float eps, bool relu, int64_t rows, int64_t cols,
                float* y, cudaStream_t st);
void im2col(const float* x, const uint8_t* row_valid, int64_t h, int64_t w, int64_t c, int kernel, int stride, int pad,
            int64_t row0, int64_t rows, int64_t wo, float* cols, cudaStream_t st);
void glu_causal_conv(const float* g, const float* w, int64_t n, int64_t D, int64_t K, float* out, cudaStream_t st);
// The dense attention's P: heads x rows score rows of `cols` keys (rows `ld` apart in s and p) to bf16
// probabilities, row r of each head seeing columns up to first_hi + r + ahead[r] (ahead, on the device,
// where given: an image's tokens see to its last) or the last, and of them the `window` up to
// first_hi + r where window > 0 (an image's patches: first_hi cols - 1), soft-capped where softcap > 0;
// zeros elsewhere. p_lo (where given): each probability's remainder after bf16, in bf16 (p + p_lo: ~16 bits).
void softmax_rows_bf16(const float* s, int64_t heads, int64_t rows, int64_t cols, int64_t ld, int64_t first_hi,
                       const int32_t* ahead, int window, float softcap, uint16_t* p, uint16_t* p_lo, cudaStream_t st);
// Attention where every query sees every one of nk keys (an image's patches), fused on the tensor
// cores: q [rows, nh, hd] bf16, K and V [>= nk, nh, hd] bf16 (a KV head each), out [rows, nh, hd] f32.
// Head dims that are multiples of 8 up to 80 (the ViTs' 64 and 72); false (nothing launched) otherwise.
bool attention_whole(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t rows, int64_t nk, int64_t nh,
                     int64_t hd, float scale, float* out, cudaStream_t st);
inline constexpr int64_t kLocalAttnMaxHeadDim = 256;
inline constexpr int64_t kLocalAttnMaxContext = 3072;
struct LocalAttnArgs {
  int64_t chunk, left, context, rel_offset;
  float q_scale, k_scale, logit_cap, invalid_logit;
};
void local_attention(const float* q, const float* k, const float* v, const float* q_gain, const float* rel_keys,
                     const uint8_t* valid, int64_t n, int64_t heads, int64_t hd, const LocalAttnArgs& a, float* out,
                     cudaStream_t st);
void scale(float* x, int64_t n, float s, cudaStream_t st);
void softcap(float* x, int64_t n, float cap, cudaStream_t st);
void clamp(float* x, int64_t n, float lo, float hi, cudaStream_t st);
void slice_cols(const float* src, int64_t rows, int64_t cols, int64_t begin, int64_t w, float* dst, cudaStream_t st);
void gather_rows(const float* src, int64_t cols, const int32_t* rows, int64_t n, float* dst, cudaStream_t st);

// One sequence's KV as the attention kernels address it (backend.h's KVStore on the device).
struct KVSeq {
  const void* k = nullptr;  // bf16 [capacity, nkv, hd]
  const void* v = nullptr;
  const int32_t* pages = nullptr;  // device page table or null
  const int32_t* pos = nullptr;    // device positions of the sequence's rows
  const int32_t* last = nullptr;   // device: each row's last visible key (null: its own position)
  int64_t capacity = 0;
  int32_t begin = 0, count = 0;
  int32_t ring = 0;
  int32_t page_shift = 0;          // log2(page_size)
};
// Sequences an attention launch takes as its parameter (72 bytes each: 9 KB of the 32 KB that
// kernel parameters may hold since CUDA 12.1). Each launch more costs a decode step a few
// microseconds a layer: 128 streams were 4 launches of 32.
inline constexpr int kMaxSeqsPerLaunch = 128;
struct KVSeqs {
  KVSeq s[kMaxSeqsPerLaunch];
  int n = 0;
  // Rows ascend with the sequences and no two share one (order_rows): each block of the attention
  // kernels finds its row's sequence by bisection, 7 steps for 128 sequences, instead of a scan
  // through the parameters (E4B Q4_0 at 128 streams on an H100: 13,352 vs 11,287 tok/s).
  int ordered = 0;
};
// Sets seqs.ordered where it holds (allowed false: the kernels scan, as MARKBASE_CUDA_SEQ_SCAN=1 asks).
inline void order_rows(KVSeqs& seqs, bool allowed = true) {
  seqs.ordered = allowed;
  for (int i = 1; i < seqs.n && seqs.ordered; ++i)
    seqs.ordered = int64_t(seqs.s[i].begin) >= int64_t(seqs.s[i - 1].begin) + seqs.s[i - 1].count;
}
// Writes rows of k, v [n, nkv, hd] (f32) to each sequence's slots as bf16.
void kv_write(const KVSeqs& seqs, const float* k, const float* v, int64_t nkv, int64_t hd, cudaStream_t st);

// Per-head norms and rotary of q [n, nh, hd] and k [n, nkv, hd], v's weightless norm (v_norm), and
// k, v written to the slots of the rows of `seqs` (k, v null: q alone), in one launch.
struct AttnInputArgs {
  int64_t nh = 0, nkv = 0, hd = 0;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  int add_one = 0, v_norm = 0;
};
void attention_inputs(float* q, float* k, float* v, int64_t n, const AttnInputArgs& a, const int32_t* pos,
                      const float* inv_freq, const KVSeqs& seqs, cudaStream_t st);

struct AttnArgs {
  int64_t n_rows = 0;  // rows of q covered by the sequences (the highest begin + count)
  int64_t n_heads = 0, n_kv = 0, hd = 0;
  float scale = 1.f, softcap = 0.f;
  int window = 0;
  int64_t max_keys = 0;  // keys any row reads at most (positions rounded up to a multiple of 256)
  QuantOut qo;  // q non-null (hd a multiple of 32): out also goes out quantized (quantize_x's numbers)
};
// out[n, nh, hd] = attention of q[n, nh, hd]; `partial` scratch for the key splits:
// attention_partial_floats(args) floats.
int64_t attention_partial_floats(const AttnArgs& a);
void attention(const KVSeqs& seqs, const AttnArgs& a, const float* q, float* out, float* partial, cudaStream_t st);
// Keys k0 .. k0 + nk - 1 of s's store into contiguous bf16 rows of row_elems (nkv x hd, a multiple of 8).
void gather_kv(const KVSeq& s, int64_t k0, int64_t nk, int64_t row_elems, uint16_t* k, uint16_t* v, cudaStream_t st);
// The dense prefill's layouts: rows [rows, nh, hd] (row stride ld) to heads [nh, rows, hd] as bf16 hi and
// the rounding's remainder lo in bf16 (hi + lo: ~16 bits, so two tensor-core products come within ~1e-5 of
// f32's), and heads back to rows.
void rows_to_heads_bf16(const float* x, int64_t ld, int64_t rows, int64_t nh, int64_t hd, uint16_t* hi, uint16_t* lo,
                        cudaStream_t st);
void heads_to_rows(const float* x, int64_t rows, int64_t nh, int64_t hd, int64_t ld, float* out, cudaStream_t st);

// ggml blocks of `block_bytes` (a half scale first, then qs_bytes of quants) into GpuWeight planes.
void split_blocks(const void* raw, int64_t nblocks, int block_bytes, int qs_bytes, void* qs, uint16_t* scale,
                  cudaStream_t st);

// Copy bandwidth probe: reads src and writes dst `reps` times; returns seconds.
double copy_seconds(const void* src, void* dst, size_t bytes, int reps, cudaStream_t st);

}  // namespace mb::cuda
