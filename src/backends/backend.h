// The contract between model files and compute. Backends implement coarse ops on activations
// shaped [n_tokens, dim] and know nothing about Gemma; model files compose them and never branch
// on the backend. Each op has a plain reference implementation in the CPU backend that faster
// paths (SIMD, CUDA) are tested against.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "core/token_pick.h"

namespace mb {

// One layer's KV storage as one sequence sees it: rows of [n_kv_heads, head_dim]. A position's
// row is found through the sequence's page table when it has one (the serving runtime's paged
// memory: row pages[pos / page_size] * page_size + pos % page_size of a pool shared by many
// sequences), else it is `pos % capacity` for a ring (sliding-window layers) or `pos`. Ops read
// and write only the rows of positions the call names (each query's window), so a page table may
// hold -1 for pages the sequence no longer has.
struct KVStore {
  Tensor k, v;  // [capacity, n_kv_heads, head_dim]
  int64_t capacity = 0;
  bool ring = false;
  const int32_t* pages = nullptr;
  int64_t page_size = 0;  // a power of two
  int64_t n_pages = 0;  // entries of `pages`
  int64_t slot(int64_t pos) const {
    return pages ? int64_t(pages[pos / page_size]) * page_size + pos % page_size : ring ? pos % capacity : pos;
  }
};

// A host array that a step's ops name by pointer (token ids, positions, logit rows, page tables),
// for Backend::stage. `reserve` (>= bytes) is the room the staged layout sets aside for it, so a
// page table that grows keeps its place and a recorded step stays valid.
struct HostArray {
  const void* data = nullptr;
  size_t bytes = 0;
  size_t reserve = 0;
};

struct AttentionParams {
  float scale = 1.f;
  int window = 0;        // > 0: query at p sees keys (p - window, p]; 0: all keys <= p
  float softcap = 0.f;   // > 0: scores = softcap * tanh(scores / softcap)
  // The products may take q, k, the probabilities and v rounded to bf16, as SDPA on bf16 tensors
  // does (a vision tower with bf16 weights): the CPU then runs an image's attention as two rounded
  // GEMMs with an f32 softmax between (cpu::attention_whole_rounded).
  bool rounded_inputs = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // Zeroed memory owned by the returned tensor (KV caches, anything read before it is written).
  virtual Tensor alloc(DType dtype, std::vector<int64_t> shape) = 0;
  // Memory for an op's output: contents undefined, so every op writes all of its output. A
  // backend may hand out the same memory again once the tensor is dropped (the CPU backend keeps a
  // pool, so a forward pass does not page-fault through fresh memory each step).
  virtual Tensor scratch(DType dtype, std::vector<int64_t> shape) { return alloc(dtype, std::move(shape)); }
  // A weight in `dtype`, in whatever layout this backend's kernels want for `use`: a matmul weight
  // may carry a repacked copy (Tensor::packed); a lookup table (embeddings, the per-layer table)
  // never gets one, so it stays in the mmap and only the rows read are paged in. May alias `src`
  // when nothing needs to change (then the caller keeps `src`'s storage alive).
  // MatmulRoundedInputs: a bf16 matmul weight whose products may take the activations rounded to
  // bf16, as transformers' bf16 modules and GPU GEMMs do (the media towers): on the CPU ~2x the
  // f32-accurate products' speed where AMX runs them.
  enum class WeightUse { Matmul, Lookup, MatmulAndLookup, MatmulRoundedInputs };
  virtual Tensor prepare_weight(const Tensor& src, DType dtype, WeightUse use = WeightUse::Matmul) = 0;
  virtual bool supports_weight_dtype(DType dtype) const = 0;
  // The element type of KV stores (KVPageManager and KVCache allocate in it). Ops take f32
  // activations and convert when they write K/V.
  virtual DType kv_dtype() const { return DType::F32; }
  // The most rows a model hands one gated_ffn call: a prompt's [rows, F] gate and up activations
  // are its largest, so a host backend keeps them to a cache-friendly stretch, while a GPU's
  // products want a prompt's rows at once (a product of 256 rows leaves SMs without tiles).
  virtual int64_t ffn_rows_per_call() const { return 256; }

  // Copies a step's host arrays to the backend's memory in one transfer; until the next call, an
  // op given a pointer into one of them (ids, positions, page tables) reads that copy. Host-memory
  // backends have nothing to do. A pointer an op gets that was not staged is still valid input,
  // copied on its own (slower; never while recording). Call stage({}) before the arrays are freed:
  // a staged range is matched by address, so new data at an old address would read the old copy.
  virtual void stage(const std::vector<HostArray>& arrays) {}

  // Recorded steps (CUDA graphs): a decode step's ops are recorded once under a key that fixes
  // every shape and pointer they take (the staged data - ids, positions, page tables - may differ)
  // and replayed for later steps with that key, so the host does not issue the ops again.
  virtual bool can_record_steps() const { return false; }
  // Runs the recording kept under `key`; false when there is none.
  virtual bool replay_step(uint64_t key) { return false; }
  // Ops between these two are recorded, not run; end_recording keeps the recording and runs it. A
  // backend may run a key's first steps as plain ops and record a later one.
  virtual void begin_recording(uint64_t key) {}
  virtual void end_recording(uint64_t key) {}
  // Drops every recording (their buffers are about to change).
  virtual void forget_recordings() {}
  // Free memory of a device with its own (what KV pages may take); 0 for host memory.
  virtual size_t device_free_bytes() const { return 0; }
  // Bytes per second a device with its own memory streams through a buffer of `bytes` (a read
  // and a write of it count twice); 0 for host memory (bench measures that itself).
  virtual double measure_copy_bandwidth(size_t bytes) { return 0; }
  // Waits until every op issued so far is done (asynchronous backends; timing).
  virtual void synchronize() {}
  // Op timing on the device itself, for the profiler of an asynchronous backend: mark() puts a
  // timestamp into the op stream without waiting for it; marked_seconds() waits for the work and
  // returns the intervals between consecutive marks made since its last call (n marks: n - 1).
  virtual bool can_mark() const { return false; }
  virtual void mark() {}
  virtual std::vector<double> marked_seconds() { return {}; }
  // Seconds the host spent on `what` (a static string) between ops, for a profiler's table (the ops'
  // device time leaves it out: an asynchronous device idles through it).
  virtual void host_time(const char* what, double seconds) {}

  // y[n, m] = x[n, k] · w[m, k]ᵀ. w may be any supported weight dtype.
  virtual void matmul(const Tensor& x, const Tensor& w, Tensor& y) = 0;
  // Bounds on a matmul's input and output; ±inf where there are none.
  struct Clip {
    float in_lo, in_hi, out_lo, out_hi;
    bool clips_input() const { return std::isfinite(in_lo) || std::isfinite(in_hi); }
    bool clips_output() const { return std::isfinite(out_lo) || std::isfinite(out_hi); }
  };
  // What follows a clipped linear in the media towers: nothing, SiLU, or gelu_tanh(y) · times.
  enum class Activation { None, Silu, GeluTanhTimes };
  // y = act(clamp(clamp(x, in) · wᵀ, out)), x kept (the media towers' clipped linears), which a
  // backend may clamp and activate as its matmul reads x and writes y instead of in passes of their
  // own. times: GeluTanhTimes' other factor, y's shape.
  // (Defined here, as every default: the parser-only fuzz build has models but no backend .cpp, so
  // Backend keeps no out-of-line virtual that would put its vtable in one.)
  virtual void matmul_clipped(const Tensor& x, const Tensor& w, const Clip& clip, Tensor& y,
                              Activation act = Activation::None, const Tensor* times = nullptr) {
    check_activation(y, act, times);
    if (clip.clips_input()) {
      Tensor xc = scratch(DType::F32, x.shape);
      clamp_into(x, clip.in_lo, clip.in_hi, xc);
      matmul(xc, w, y);
    } else {
      matmul(x, w, y);
    }
    if (clip.clips_output()) clamp(y, clip.out_lo, clip.out_hi);
    if (act == Activation::Silu) silu(y);
    if (act == Activation::GeluTanhTimes) gelu_tanh_mul(y, *times, y);
  }
  static void check_activation(const Tensor& y, Activation act, const Tensor* times) {
    if (act == Activation::GeluTanhTimes)
      MB_CHECK(times && times->dtype == DType::F32 && times->numel() == y.numel(),
               "matmul_clipped: gelu_tanh · times needs f32 times of y's {} elements", y.numel());
  }
  // ys[i] = x · ws[i]ᵀ: several weights applied to one input (Q/K/V, gate/up), which a backend may
  // run as one pass.
  virtual void matmuls(const Tensor& x, const std::vector<const Tensor*>& ws, const std::vector<Tensor*>& ys) {
    for (size_t i = 0; i < ws.size(); ++i) matmul(x, *ws[i], *ys[i]);
  }
  // out = gelu_tanh(x · w_gateᵀ) * (x · w_upᵀ): a gated FFN's two projections and its activation,
  // which a backend may run as one pass (the activation applied to each block of outputs as it is
  // computed). out must not alias x.
  virtual void matmul_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, Tensor& out) {
    Tensor up = scratch(out.dtype, out.shape);
    matmuls(x, {&w_gate, &w_up}, {&out, &up});
    gelu_tanh_mul(out, up, out);
  }
  // out = gelu_tanh(x · wᵀ) * m: a projection gated by a given tensor m (Gemma 4's per-layer
  // input gate), which a backend may finish as it computes each output.
  virtual void matmul_gelu_times(const Tensor& x, const Tensor& w, const Tensor& m, Tensor& out) {
    matmul(x, w, out);
    gelu_tanh_mul(out, m, out);
  }
  // out = (gelu_tanh(x · w_gateᵀ) * (x · w_upᵀ)) · w_downᵀ: a whole gated FFN, which a backend may
  // run without handing the [n, F] activation through memory in floats. out must not alias x.
  virtual void gated_ffn(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, Tensor& out) {
    Tensor g = scratch(DType::F32, {x.rows(), w_gate.rows()});
    matmul_gelu_mul(x, w_gate, w_up, g);
    matmul(g, w_down, out);
  }
  // out[i] = table[ids[i]] * scale, converted to f32.
  virtual void embed(const Tensor& table, const int32_t* ids, int64_t n, float scale, Tensor& out) = 0;
  // Normalises each row of the last dim: y = x * (mean(x²) + eps)^-1/2 * (w or 1), w taken as (1 + w)
  // when add_one. x and y may alias.
  virtual void rms_norm(const Tensor& x, const Tensor* w, float eps, bool add_one, Tensor& y) = 0;
  // Half-split ("NeoX") rotary embedding in place. x [n, heads, head_dim]; inv_freq has
  // head_dim/2 entries (zeros leave their pair untouched); pos[n] absolute positions.
  virtual void rope(Tensor& x, const int32_t* pos, const float* inv_freq) = 0;

  // Fused forms of the sequences above that models run back to back; a backend may do each in one
  // pass over memory. The defaults compose the single ops, and an override must give the same
  // numbers.
  // rms_norm of each head of x [n, heads, head_dim] in place, then rope (query/key normalisation).
  virtual void rms_norm_rope(Tensor& x, const Tensor* w, float eps, bool add_one, const int32_t* pos,
                             const float* inv_freq) {
    Tensor rows = x.reshaped({x.dim(0) * x.dim(1), x.dim(2)});
    rms_norm(rows, w, eps, add_one, rows);
    rope(x, pos, inv_freq);
  }
  // The end of a residual branch: x = (x + rms_norm(branch) · w) · scale. branch may be
  // overwritten.
  virtual void add_rms_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale = 1.f) {
    rms_norm(branch, w, eps, add_one, branch);
    add(x, branch, x);
    if (scale != 1.f) this->scale(x, scale);
  }
  // ids [r] (I32) = the first maximum of each row of x [r, V] (f32), or -1 where the row holds a
  // NaN or an infinity (first_max_or_nonfinite): greedy picking without copying the rows off a
  // device (a GPU's logits).
  virtual void argmax_rows(const Tensor& x, Tensor& ids) = 0;
  // ids[i] = the token picks[i] chooses from row i of x [r, V] (core/token_pick.h, its draw given),
  // or -1 where the row holds a NaN or an infinity: sampling without copying the rows off a device.
  // This one picks on the host (copying a device's rows there first).
  virtual void sample_rows(const Tensor& x, std::span<const TokenPick> picks, std::span<int32_t> ids) {
    const int64_t r = x.rows(), V = x.cols();
    MB_CHECK(int64_t(picks.size()) == r && int64_t(ids.size()) == r, "sample_rows: {} picks and {} ids for x {}",
             picks.size(), ids.size(), x.shape_str());
    std::vector<float> host;
    const float* rows = x.f32();
    if (device() != Device::CPU) {
      host.resize(size_t(r * V));
      to_host(x, host.data());
      rows = host.data();
    }
    ThreadPool::global().parallel_for(r, 1, [&](int64_t b, int64_t e) {
      thread_local std::vector<PickCandidate> scratch;
      for (int64_t i = b; i < e; ++i) ids[size_t(i)] = pick_row({rows + i * V, size_t(V)}, picks[size_t(i)], scratch);
    });
  }
  static int32_t first_max_or_nonfinite(const float* row, int64_t V) {
    int32_t best = -1;
    for (int64_t c = 0; c < V; ++c) {
      if (!std::isfinite(row[c])) return -1;
      if (best < 0 || row[c] > row[best]) best = int32_t(c);
    }
    return best;
  }
  // add_rms_norm, then y = rms_norm(x) · w_next (the next block's input norm) from the new x, in
  // one pass. y must not alias x or branch.
  virtual void add_rms_norm_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale,
                                 const Tensor* w_next, Tensor& y) {
    add_rms_norm(x, branch, w, eps, add_one, scale);
    rms_norm(x, w_next, eps, add_one, y);
  }
  // Writes k, v [n, n_kv, hd] at the slots of positions pos[n].
  virtual void kv_write(KVStore& kv, const Tensor& k, const Tensor& v, const int32_t* pos) = 0;
  // One sequence of a batch: rows [begin, begin + count) of q/k/v and out, at positions
  // pos[count], over its own KV.
  struct AttentionSeq {
    const KVStore* kv = nullptr;
    int64_t begin = 0, count = 0;
    const int32_t* pos = nullptr;
    // Non-null (attention only): query i sees keys up to position last[i] >= pos[i] instead of
    // pos[i] (bidirectional image blocks); a window still counts back from pos[i]. Those keys must
    // have been written before the call.
    const int32_t* last = nullptr;
  };
  // kv_write() for each sequence of a batch (rows [begin, begin + count) of k and v into its
  // store), which a backend may run as one pass.
  virtual void kv_write_batch(const Tensor& k, const Tensor& v, const std::vector<AttentionSeq>& seqs) {
    for (const AttentionSeq& s : seqs)
      kv_write(const_cast<KVStore&>(*s.kv), k.slice_rows(s.begin, s.count), v.slice_rows(s.begin, s.count), s.pos);
  }
  // A layer's attention inputs after their projections, in place: each head of q [n, n_heads, hd]
  // and k [n, n_kv, hd] gets rms_norm_rope (weights q_norm, k_norm), each head of v an RMS norm
  // without weight when v_norm; then k and v go to the sequences' stores (kv_write_batch). k and v
  // null: q alone (a layer that reads another layer's KV).
  struct AttentionInputs {
    const Tensor* q_norm = nullptr;
    const Tensor* k_norm = nullptr;
    bool v_norm = false;
    float eps = 1e-6f;
    bool add_one = false;
    const int32_t* pos = nullptr;
    const float* inv_freq = nullptr;
  };
  virtual void attention_inputs(Tensor& q, Tensor* k, Tensor* v, const AttentionInputs& p,
                                const std::vector<AttentionSeq>& writes) {
    rms_norm_rope(q, p.q_norm, p.eps, p.add_one, p.pos, p.inv_freq);
    if (!k) return;
    rms_norm_rope(*k, p.k_norm, p.eps, p.add_one, p.pos, p.inv_freq);
    if (p.v_norm) {
      Tensor rows = v->reshaped({v->dim(0) * v->dim(1), v->dim(2)});
      rms_norm(rows, nullptr, p.eps, false, rows);
    }
    kv_write_batch(*k, *v, writes);
  }
  // Causal attention of q [n, n_heads, hd] (positions pos[n]) over every key at positions <= pos
  // (within the window) already written to kv; grouped heads: head h reads KV head h / (n_heads/n_kv).
  virtual void attention(const Tensor& q, const KVStore& kv, const int32_t* pos,
                         const AttentionParams& p, Tensor& out) = 0;
  // attention() for each sequence of a batch (a decode step of several users), which a backend
  // may run as one pass: the same numbers as one call per sequence. A backend may size its work by
  // the highest position rounded up to a multiple of 256 (recorded steps are keyed by it).
  virtual void attention_batch(const Tensor& q, const std::vector<AttentionSeq>& seqs, const AttentionParams& p,
                               Tensor& out) {
    for (const AttentionSeq& s : seqs) {
      Tensor qs = q.slice_rows(s.begin, s.count), os = out.slice_rows(s.begin, s.count);
      attention(qs, *s.kv, s.pos, p, os);
    }
  }
  // out = gelu_tanh(gate) * up (elementwise; out may alias either input).
  virtual void gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // out = a + b; out = a * b (b broadcast over rows when it has a single row: a bias, a gain); x *= s.
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  // add's sizes checked: b's elements (all of a's, or one row of them).
  static int64_t add_operand(const Tensor& a, const Tensor& b, const Tensor& out);
  virtual void mul(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  virtual void scale(Tensor& x, float s) = 0;
  // x = cap * tanh(x / cap)
  virtual void softcap(Tensor& x, float cap) = 0;
  // x = min(max(x, lo), hi) (the vision and audio towers' clipped linears).
  virtual void clamp(Tensor& x, float lo, float hi) = 0;
  // out = min(max(x, lo), hi), x kept (a clipped linear's input, which other linears read too).
  virtual void clamp_into(const Tensor& x, float lo, float hi, Tensor& out) {
    copy(x, out);
    clamp(out, lo, hi);
  }
  // x = x · sigmoid(x) (SiLU), in place.
  virtual void silu(Tensor& x) = 0;
  // torch's LayerNorm over each row of x [rows, width]: y = (x - mean) / sqrt(var + eps) · w (+ b when
  // given), the row's mean and biased variance; then max(0, y) with relu. w, b [width]; y may alias x.
  virtual void layer_norm(const Tensor& x, const Tensor& w, const Tensor* b, float eps, bool relu, Tensor& y) = 0;
  // A 2-D convolution's patches as matmul rows (im2col), for a weight [C_out, C, k, k] read as
  // [C_out, C·k·k]. x [H, W, C] is channels-last; the output grid is H' x W', H' = (H + 2·pad - k) /
  // stride + 1 (W' alike). cols [rows, W', C·k·k] holds output rows [row0, row0 + rows): its column
  // c·k² + i·k + j at output (y, x) is x[stride·y - pad + i, stride·x - pad + j, c], zero outside x
  // and in input rows whose row_valid[H] entry is 0 (row_valid null: every row counts).
  struct Im2col {
    int kernel = 3, stride = 1, pad = 0;
  };
  virtual void im2col(const Tensor& x, const uint8_t* row_valid, const Im2col& c, int64_t row0, Tensor& cols) = 0;
  // An im2col call's sizes, checked (an error names what does not fit).
  struct Im2colShape {
    int64_t h, w, c, ho, wo, rows, patch;
  };
  static Im2colShape im2col_shape(const Tensor& x, const Im2col& c, int64_t row0, const Tensor& cols);
  // A gated linear unit, then a causal depthwise convolution along the rows (time): g [n, 2D] gives
  // a[t] = g[t, :D] · sigmoid(g[t, D:]), and out [n, D] = Σ_j w[c, j] · a[t - (K-1) + j, c] over
  // j < K, a = 0 before row 0; w [D, K].
  virtual void glu_causal_conv(const Tensor& g, const Tensor& w, Tensor& out) = 0;
  static void check_glu_causal_conv(const Tensor& g, const Tensor& w, const Tensor& out);
  // A Conformer's chunked local self-attention with relative-position keys (an audio tower's).
  // q, k, v, out [n, heads, hd] (n frames); the queries come in chunks of `chunk` frames, and query t
  // of the chunk starting at frame c0 has one softmax entry per frame s of [c0 - left, c0 - left +
  // context). Its logit is cap · tanh((q̃·k̃_s + q̃·r_d) / cap) with q̃ = q_t · q_scale · q_gain, k̃ =
  // k_s · k_scale, d = t - s, r_d = row d + rel_offset of rel_keys [P, heads·hd] - where s is a
  // frame of the clip, valid[s] (a host array of n) and 0 <= d < left - else invalid_logit. The
  // output is the softmax-weighted sum of v_s over the entries whose frame is in the clip (the others
  // read as zero values).
  struct LocalAttention {
    int64_t chunk = 0, left = 0, context = 0, rel_offset = 0;
    float q_scale = 1.f, k_scale = 1.f, logit_cap = 0.f, invalid_logit = 0.f;
    const uint8_t* valid = nullptr;
  };
  virtual void local_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_gain,
                               const Tensor& rel_keys, const LocalAttention& p, Tensor& out) = 0;
  struct LocalAttentionShape {
    int64_t n, heads, hd;
  };
  static LocalAttentionShape local_attention_shape(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& q_gain, const Tensor& rel_keys,
                                                   const LocalAttention& p, const Tensor& out);
  // Mixture-of-experts routing: softmax over each row of logits [n, E], keep the top k,
  // renormalise them to sum 1, multiply by per_expert_scale[e] when given.
  virtual void route_topk(const Tensor& logits, int k, const Tensor* per_expert_scale,
                          Tensor& weights /*[n,k] f32*/, Tensor& experts /*[n,k] i32*/) = 0;
  // out[i] = Σ_j weights[i,j] · down[e] · (gelu_tanh(gate_up[e][:I] x_i) * gate_up[e][I:] x_i),
  // e = experts[i,j]; gate_up [E, 2I, H], down [E, H, I].
  virtual void moe_gated_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                                 const Tensor& weights, const Tensor& experts, Tensor& out) = 0;
  // dst[n, w] = src[:, begin : begin + w]
  virtual void slice_cols(const Tensor& src, int64_t begin, Tensor& dst) = 0;
  // dst[i] = src[rows[i]]
  virtual void gather_rows(const Tensor& src, const int32_t* rows, int64_t n, Tensor& dst) = 0;
  // dst[i] = Σ_j src[rows[i·group + j]] · scale for j = 0 .. group-1, summed in that order from zero
  // (pooling: each output row the scaled sum of its group of input rows); rows [dst rows · group].
  virtual void gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, float scale, Tensor& dst) = 0;
  static void check_gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, const Tensor& dst);
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  // Copies device data to host memory (no-op copy on the CPU backend).
  virtual void to_host(const Tensor& src, void* dst) = 0;
  // The inverse: dst's bytes from host memory (media soft tokens into the embedded rows, image
  // patches into an encoder). Not inside a recorded step.
  virtual void upload(const void* src, Tensor& dst) = 0;
};

// The host's time in a scope, reported to backend.host_time as `what` (a profiler's table lists it).
class HostTimer {
 public:
  HostTimer(Backend& be, const char* what) : be_(be), what_(what), t0_(std::chrono::steady_clock::now()) {}
  ~HostTimer() { be_.host_time(what_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count()); }
  HostTimer(const HostTimer&) = delete;
  HostTimer& operator=(const HostTimer&) = delete;

 private:
  Backend& be_;
  const char* what_;
  std::chrono::steady_clock::time_point t0_;
};

std::unique_ptr<Backend> make_cpu_backend();
// "cpu" or "cuda" (the first GPU); a clear error when this build or machine has no such device.
std::unique_ptr<Backend> make_backend(const std::string& device);
// Whether make_backend("cuda") can succeed: built with CUDA and a GPU is visible.
bool cuda_device_available();
// The first GPU's compute capability as major * 10 + minor (90: H100, H200), 0 without one.
int cuda_compute_capability();

}  // namespace mb
