// Gemma 4 text decoder (E2B, E4B, 26B-A4B, 31B and the 12B unified model's text part), written
// once against backend ops. Gemma 3 is the same block with fewer parts ((1 + w) norms, no V norm,
// no PLE/MoE/layer scalar, a query_pre_attn_scalar scale), selected by ModelConfig fields rather
// than a second copy of this file. Shapes in comments: n = tokens in the batch, H = hidden size,
// nh/nkv = query/KV heads, hd = the layer's head dim, P = per-layer-embedding width, L = layers.
// Reference: transformers 5.17.0 modeling_gemma4.py; ../shared/docs/gemma4-text.md §2.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "models/gemma4/gemma4.h"
#include "models/model.h"

namespace mb {

namespace {

struct Gemma4Layer {
  Tensor attn_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_attn_norm;
  Tensor pre_ffn_norm, gate_proj, up_proj, down_proj, post_ffn_norm;
  float layer_scalar = 1.f;
  // Per-layer embeddings (E2B/E4B).
  Tensor ple_gate, ple_proj, ple_post_norm;
  // Mixture of experts (26B-A4B).
  Tensor router_proj, router_scale, per_expert_scale, experts_gate_up, experts_down;
  Tensor pre_ffn_norm_2, post_ffn_norm_1, post_ffn_norm_2;
  std::vector<float> inv_freq;  // hd/2 entries; zeros = unrotated ("proportional" RoPE)
  bool owns_kv = true;
};

// transformers multiplies by a scalar tensor cast to the weight dtype first.
float scale_in_dtype(double s, DType dtype) {
  float f = float(s);
  if (dtype == DType::BF16) return round_to_bf16(f);
  if (dtype == DType::F16) return f16_to_f32(f32_to_f16(f));
  return f;
}

class Gemma4Model final : public Model {
 public:
  Gemma4Model(std::shared_ptr<const Checkpoint> ck, Backend& be, const ModelLoadOptions& opts)
      : ck_(std::move(ck)), cfg_(ck_->config), be_(be), opts_(opts) {
    load_weights();
  }

  const ModelConfig& config() const override { return cfg_; }
  size_t weight_bytes() const override { return weight_bytes_; }
  size_t decode_weight_bytes() const override {
    if (!cfg_.moe) return weight_bytes_;
    const double routed = double(cfg_.top_k_experts) / double(cfg_.n_experts);
    return weight_bytes_ - expert_bytes_ + size_t(double(expert_bytes_) * routed);
  }

  void forward(const Batch& batch, KVMemory& kv, std::vector<float>& logits) override {
    step(batch, kv, &logits, nullptr, {});
  }
  void forward_pick(const Batch& batch, KVMemory& kv, std::span<const TokenPick> picks,
                    std::vector<int32_t>& ids) override {
    step(batch, kv, nullptr, &ids, picks);
  }
  // forward's body: the logit rows to the host (logits) or their picks (ids).
  void step(const Batch& batch, KVMemory& kv, std::vector<float>* logits, std::vector<int32_t>* ids,
            std::span<const TokenPick> picks);
  void deliver(const Tensor& out, int64_t r, std::vector<float>* logits, std::vector<int32_t>* ids,
               std::span<const TokenPick> picks);
  // The ops of a step from the staged inputs to the logits of batch.logit_rows in `out` [r, V].
  void compute(const Batch& batch, KVMemory& kv, Tensor& out);

 private:
  Tensor weight(const std::string& name, std::vector<int64_t> shape, bool matrix,
                Backend::WeightUse use = Backend::WeightUse::Matmul) {
    Tensor src = ck_->tensors.get(cfg_.tensor_prefix + name, shape);
    MB_CHECK(be_.supports_weight_dtype(src.dtype), "tensor '{}' has dtype {}, which the {} backend cannot use",
             cfg_.tensor_prefix + name, dtype_name(src.dtype), be_.name());
    DType want = !matrix ? DType::F32 : opts_.keep_checkpoint_dtype ? src.dtype : opts_.weight_dtype;
    Tensor t = be_.prepare_weight(src, want, use);
    weight_bytes_ += t.nbytes();
    return t;
  }
  // A [1] weight read on the host: it becomes an op argument, not a tensor.
  float host_scalar(const std::string& name) const {
    Tensor t = ck_->tensors.get(cfg_.tensor_prefix + name, {1});
    if (t.dtype == DType::F32) return t.f32()[0];
    if (t.dtype == DType::BF16) return bf16_to_f32(t.ptr<uint16_t>()[0]);
    if (t.dtype == DType::F16) return f16_to_f32(t.ptr<uint16_t>()[0]);
    fail("tensor '{}' has unsupported dtype {}", cfg_.tensor_prefix + name, dtype_name(t.dtype));
  }
  bool has(const std::string& name) const { return ck_->tensors.contains(cfg_.tensor_prefix + name); }

  void load_weights();
  // h: rms_norm(x) by the layer's input norm; each block leaves in `next` the normalised input
  // of what follows it (the residual add and that norm run as one op), `next_norm` (null: none).
  void attention_block(int l, Tensor& x, Tensor& h, const Batch& batch, KVMemory& kv, Tensor& next);
  void ffn_block(int l, Tensor& x, Tensor& h, float scale, const Tensor* next_norm, Tensor& next);
  Tensor per_layer_inputs(const Batch& batch, const Tensor& x0);

  std::shared_ptr<const Checkpoint> ck_;
  const ModelConfig& cfg_;
  Backend& be_;
  ModelLoadOptions opts_;
  size_t weight_bytes_ = 0;
  size_t expert_bytes_ = 0;

  Tensor embed_tokens, final_norm, lm_head;
  float embed_scale = 1.f;
  Tensor ple_table, ple_model_proj, ple_proj_norm;
  float ple_scale = 1.f;
  std::vector<Gemma4Layer> layers_;
  // Where recorded decode steps leave their logits: one buffer for every recording, so its
  // address is part of none of their keys; growing it drops the recordings.
  Tensor step_logits_;
};

std::vector<float> rope_inv_freq(const LayerConfig& L) {
  // transformers: inv_freq = 1 / base^(arange(0, 2*n_rot, 2) / head_dim) in f32, then zeros for
  // the non-rotated ("NoPE") slots of proportional RoPE; linear scaling divides the frequencies.
  const int half = L.head_dim / 2;
  const int rotated = L.rope.partial_rotary_factor < 1.f
                          ? int(L.rope.partial_rotary_factor * float(L.head_dim)) / 2
                          : half;
  std::vector<float> f(size_t(half), 0.f);
  for (int i = 0; i < rotated; ++i) {
    float expo = float(2 * i) / float(L.head_dim);
    f[size_t(i)] = 1.f / std::pow(L.rope.theta, expo) / L.rope.linear_factor;
  }
  return f;
}

void Gemma4Model::load_weights() {
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size, P = cfg_.ple_dim, NL = cfg_.n_layers;
  embed_tokens = weight("embed_tokens.weight", {V, H}, true,
                        cfg_.tie_embeddings ? Backend::WeightUse::MatmulAndLookup : Backend::WeightUse::Lookup);
  embed_scale = scale_in_dtype(std::sqrt(double(H)), embed_tokens.dtype);
  final_norm = weight("norm.weight", {H}, false);
  lm_head = embed_tokens;
  if (!cfg_.tie_embeddings) {
    Tensor src = ck_->tensors.get("lm_head.weight", {V, H});
    lm_head = be_.prepare_weight(src, opts_.keep_checkpoint_dtype ? src.dtype : opts_.weight_dtype);
    weight_bytes_ += lm_head.nbytes();
  }
  if (P > 0) {
    // The PLE table (2.3B parameters on E2B) is read a row per token: keep it in the mmap as is.
    Tensor src = ck_->tensors.get(cfg_.tensor_prefix + "embed_tokens_per_layer.weight",
                                  {int64_t(cfg_.ple_vocab), NL * P});
    MB_CHECK(be_.supports_weight_dtype(src.dtype), "embed_tokens_per_layer has unsupported dtype {}",
             dtype_name(src.dtype));
    ple_table = be_.prepare_weight(src, src.dtype, Backend::WeightUse::Lookup);
    ple_scale = scale_in_dtype(std::sqrt(double(P)), ple_table.dtype);
    ple_model_proj = weight("per_layer_model_projection.weight", {NL * P, H}, true);
    ple_proj_norm = weight("per_layer_projection_norm.weight", {P}, false);
  }
  layers_.resize(size_t(NL));
  for (int l = 0; l < NL; ++l) {
    const LayerConfig& L = cfg_.layers[size_t(l)];
    Gemma4Layer& w = layers_[size_t(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    const int64_t hd = L.head_dim, nh = cfg_.n_heads, nkv = L.n_kv_heads, F = L.ffn_dim;
    w.owns_kv = L.kv_source == l;
    w.inv_freq = rope_inv_freq(L);
    w.attn_norm = weight(p + "input_layernorm.weight", {H}, false);
    w.q_proj = weight(p + "self_attn.q_proj.weight", {nh * hd, H}, true);
    w.q_norm = weight(p + "self_attn.q_norm.weight", {hd}, false);
    if (w.owns_kv) {  // KV-shared layers' k/v weights are in the checkpoint but unused, as in HF
      w.k_proj = weight(p + "self_attn.k_proj.weight", {nkv * hd, H}, true);
      w.k_norm = weight(p + "self_attn.k_norm.weight", {hd}, false);
      if (L.has_v_proj) w.v_proj = weight(p + "self_attn.v_proj.weight", {nkv * hd, H}, true);
    }
    w.o_proj = weight(p + "self_attn.o_proj.weight", {H, nh * hd}, true);
    w.post_attn_norm = weight(p + "post_attention_layernorm.weight", {H}, false);
    w.pre_ffn_norm = weight(p + "pre_feedforward_layernorm.weight", {H}, false);
    w.gate_proj = weight(p + "mlp.gate_proj.weight", {F, H}, true);
    w.up_proj = weight(p + "mlp.up_proj.weight", {F, H}, true);
    w.down_proj = weight(p + "mlp.down_proj.weight", {H, F}, true);
    w.post_ffn_norm = weight(p + "post_feedforward_layernorm.weight", {H}, false);
    if (has(p + "layer_scalar")) w.layer_scalar = host_scalar(p + "layer_scalar");
    if (P > 0) {
      w.ple_gate = weight(p + "per_layer_input_gate.weight", {P, H}, true);
      w.ple_proj = weight(p + "per_layer_projection.weight", {H, P}, true);
      w.ple_post_norm = weight(p + "post_per_layer_input_norm.weight", {H}, false);
    }
    if (cfg_.moe) {
      const int64_t E = cfg_.n_experts, I = cfg_.moe_ffn_dim;
      w.router_proj = weight(p + "router.proj.weight", {E, H}, true);
      w.router_scale = weight(p + "router.scale", {H}, false);
      w.per_expert_scale = weight(p + "router.per_expert_scale", {E}, false);
      w.experts_gate_up = weight(p + "experts.gate_up_proj", {E, 2 * I, H}, true);
      w.experts_down = weight(p + "experts.down_proj", {E, H, I}, true);
      expert_bytes_ += w.experts_gate_up.nbytes() + w.experts_down.nbytes();
      w.pre_ffn_norm_2 = weight(p + "pre_feedforward_layernorm_2.weight", {H}, false);
      w.post_ffn_norm_1 = weight(p + "post_feedforward_layernorm_1.weight", {H}, false);
      w.post_ffn_norm_2 = weight(p + "post_feedforward_layernorm_2.weight", {H}, false);
    }
  }
}

// ple[L][n, P]: per_layer_inputs of §2.2, one [n, P] tensor per layer.
Tensor Gemma4Model::per_layer_inputs(const Batch& batch, const Tensor& x0) {
  const int64_t n = x0.rows(), H = cfg_.hidden_size, P = cfg_.ple_dim, NL = cfg_.n_layers;
  Tensor tok = be_.scratch(DType::F32, {n, NL * P});
  be_.embed(ple_table, batch.tokens.data(), n, ple_scale, tok);  // token-identity part
  Tensor ctx = be_.scratch(DType::F32, {n, NL * P});
  be_.matmul(x0, ple_model_proj, ctx);  // context part from the scaled embedding
  be_.scale(ctx, float(1.0 / std::sqrt(double(H))));
  Tensor ctx_rows = ctx.reshaped({n * NL, P});
  be_.rms_norm(ctx_rows, &ple_proj_norm, cfg_.rms_eps, cfg_.norm_adds_one, ctx_rows);
  be_.add(ctx, tok, ctx);
  be_.scale(ctx, float(1.0 / std::sqrt(2.0)));
  // Regroup layer-major so each layer reads a contiguous [n, P] block (one row already is).
  if (n == 1) return ctx.reshaped({NL, n, P});
  Tensor out = be_.scratch(DType::F32, {NL, n, P});
  for (int64_t l = 0; l < NL; ++l) {
    Tensor dst = out.slice_rows(l, 1).reshaped({n, P});
    be_.slice_cols(ctx, l * P, dst);
  }
  return out;
}

void Gemma4Model::attention_block(int l, Tensor& x, Tensor& h, const Batch& batch, KVMemory& kv, Tensor& next) {
  const LayerConfig& L = cfg_.layers[size_t(l)];
  Gemma4Layer& w = layers_[size_t(l)];
  const int64_t n = x.rows(), H = cfg_.hidden_size, nh = cfg_.n_heads, nkv = L.n_kv_heads, hd = L.head_dim;
  const float eps = cfg_.rms_eps;
  const bool add1 = cfg_.norm_adds_one;

  Tensor q = be_.scratch(DType::F32, {n, nh, hd});
  Tensor k, v;
  if (w.owns_kv) {
    k = be_.scratch(DType::F32, {n, nkv, hd});
    v = be_.scratch(DType::F32, {n, nkv, hd});
    if (L.has_v_proj) be_.matmuls(h, {&w.q_proj, &w.k_proj, &w.v_proj}, {&q, &k, &v});
    else be_.matmuls(h, {&w.q_proj, &w.k_proj}, {&q, &k});
  } else {
    be_.matmul(h, w.q_proj, q);
  }
  Backend::AttentionInputs in;
  in.q_norm = &w.q_norm;
  in.k_norm = w.owns_kv ? &w.k_norm : nullptr;
  in.v_norm = cfg_.v_norm;
  in.eps = eps;
  in.add_one = add1;
  in.pos = batch.positions.data();
  in.inv_freq = w.inv_freq.data();
  std::vector<Backend::AttentionSeq> writes;
  if (w.owns_kv) {
    if (!L.has_v_proj) be_.copy(k, v);  // attention_k_eq_v: V is the raw K projection, normalised without weight
    for (const BatchSequence& s : batch.seqs)
      writes.push_back({&kv.store(s.kv_slot, l), s.begin, s.count, batch.positions.data() + s.begin});
    be_.attention_inputs(q, &k, &v, in, writes);
  } else {
    be_.attention_inputs(q, nullptr, nullptr, in, writes);
  }

  h = Tensor();
  AttentionParams ap;
  ap.scale = cfg_.attn_scale;
  ap.softcap = cfg_.attn_logit_softcap;
  ap.window = L.kind == AttnKind::Sliding ? cfg_.sliding_window : 0;
  Tensor att = be_.scratch(DType::F32, {n, nh, hd});
  std::vector<Backend::AttentionSeq> seqs;
  const bool sees_ahead =
      !batch.last_keys.empty() && (L.kind == AttnKind::Sliding || cfg_.bidirectional_images_all_layers);
  for (const BatchSequence& s : batch.seqs)
    seqs.push_back({&kv.store(s.kv_slot, L.kv_source), s.begin, s.count, batch.positions.data() + s.begin,
                    sees_ahead ? batch.last_keys.data() + s.begin : nullptr});
  be_.attention_batch(q, seqs, ap, att);
  q = k = v = Tensor();
  Tensor a = be_.scratch(DType::F32, {n, H});
  be_.matmul(att.reshaped({n, nh * hd}), w.o_proj, a);
  next = be_.scratch(DType::F32, {n, H});
  be_.add_rms_norm_norm(x, a, &w.post_attn_norm, eps, add1, 1.f, &w.pre_ffn_norm, next);
}

// scale: the layer scalar when this is the layer's last residual add, else 1.
void Gemma4Model::ffn_block(int l, Tensor& x, Tensor& h, float scale, const Tensor* next_norm, Tensor& next) {
  Gemma4Layer& w = layers_[size_t(l)];
  const int64_t n = x.rows(), H = cfg_.hidden_size;
  const float eps = cfg_.rms_eps;
  const bool add1 = cfg_.norm_adds_one;

  Tensor m = be_.scratch(DType::F32, {n, H});
  // The [n, F] gate and up outputs are a prefill's largest activations, so a prompt of more rows
  // than the backend asks for runs the FFN in equal stretches of at most that many: peak memory is
  // one stretch's working set. On the CPU, stretches of over half that take the kernel path the
  // whole prompt would, and on a given path a token's result does not depend on the batch, so no
  // number changes.
  const int64_t max_rows = std::max<int64_t>(1, be_.ffn_rows_per_call());
  const int64_t n_stretches = (n + max_rows - 1) / max_rows, stretch = (n + n_stretches - 1) / n_stretches;
  for (int64_t r0 = 0; r0 < n; r0 += stretch) {
    const int64_t rows = std::min(stretch, n - r0);
    Tensor hr = h.slice_rows(r0, rows), mr = m.slice_rows(r0, rows);
    be_.gated_ffn(hr, w.gate_proj, w.up_proj, w.down_proj, mr);
  }
  h = Tensor();

  if (cfg_.moe) {
    // Dense branch and routed experts both read the residual stream x (post-attention).
    be_.rms_norm(m, &w.post_ffn_norm_1, eps, add1, m);
    const int64_t E = cfg_.n_experts, K = cfg_.top_k_experts;
    Tensor z = be_.scratch(DType::F32, {n, H});
    be_.rms_norm(x, nullptr, eps, false, z);
    be_.mul(z, w.router_scale, z);
    be_.scale(z, float(1.0 / std::sqrt(double(H))));
    Tensor router_logits = be_.scratch(DType::F32, {n, E});
    be_.matmul(z, w.router_proj, router_logits);
    Tensor rw = be_.scratch(DType::F32, {n, K}), ri = be_.scratch(DType::I32, {n, K});
    be_.route_topk(router_logits, int(K), &w.per_expert_scale, rw, ri);
    Tensor xe = be_.scratch(DType::F32, {n, H}), m2 = be_.scratch(DType::F32, {n, H});
    be_.rms_norm(x, &w.pre_ffn_norm_2, eps, add1, xe);
    be_.moe_gated_experts(xe, w.experts_gate_up, w.experts_down, rw, ri, m2);
    be_.rms_norm(m2, &w.post_ffn_norm_2, eps, add1, m2);
    be_.add(m, m2, m);
  }
  if (next_norm) {
    next = be_.scratch(DType::F32, {n, H});
    be_.add_rms_norm_norm(x, m, &w.post_ffn_norm, eps, add1, scale, next_norm, next);
  } else {
    be_.add_rms_norm(x, m, &w.post_ffn_norm, eps, add1, scale);
  }
}

void Gemma4Model::deliver(const Tensor& out, int64_t r, std::vector<float>* logits, std::vector<int32_t>* ids,
                          std::span<const TokenPick> picks) {
  if (logits) {
    if (r > 0) be_.to_host(out, logits->data());
    return;
  }
  MB_CHECK(picks.empty() || int64_t(picks.size()) == r, "forward_pick: {} picks for {} rows", picks.size(), r);
  ids->resize(size_t(r));
  if (r == 0) return;
  bool greedy = true;
  for (const TokenPick& p : picks) greedy = greedy && p.temperature <= 0.f;
  if (!greedy) {
    be_.sample_rows(out, picks, *ids);
    return;
  }
  Tensor t = be_.scratch(DType::I32, {r});
  be_.argmax_rows(out, t);
  be_.to_host(t, ids->data());
}

void Gemma4Model::step(const Batch& batch, KVMemory& kv, std::vector<float>* logits, std::vector<int32_t>* ids,
                       std::span<const TokenPick> picks) {
  const int64_t n = int64_t(batch.tokens.size()), V = cfg_.vocab_size;
  MB_CHECK(n > 0 && batch.positions.size() == size_t(n), "forward: empty or inconsistent batch");
  for (const BatchSequence& s : batch.seqs) {
    MB_CHECK(s.count <= kv.max_step(), "forward: {} tokens in one step exceed the step limit {}", s.count,
             kv.max_step());
    MB_CHECK(batch.positions[size_t(s.begin + s.count - 1)] < kv.max_context(),
             "context full: position {} exceeds the context size {}",
             batch.positions[size_t(s.begin + s.count - 1)], kv.max_context());
  }
  const int64_t r = int64_t(batch.logit_rows.size());
  if (logits) logits->resize(size_t(r * V));
  for (const EmbeddingRows& e : batch.embeddings)
    MB_CHECK(e.row >= 0 && e.count > 0 && e.row + e.count <= n && e.data, "forward: embedding rows [{}, {}) of {}",
             e.row, e.row + e.count, n);
  const StepInputs in = step_inputs(batch, kv, cfg_, be_);
  be_.stage(in.arrays);
  // The staged arrays die with this call: unstage them on the way out, or a later op's host array
  // that the allocator puts at one of their addresses (a media encoder's positions) would read this
  // step's staged copy instead of its own data.
  struct Unstage {
    Backend& be;
    ~Unstage() { be.stage({}); }
  } unstage{be_};
  MB_CHECK(batch.last_keys.empty() || batch.last_keys.size() == size_t(n), "forward: {} last keys for {} tokens",
           batch.last_keys.size(), n);
  // Steps with given embeddings are prompt steps: never recorded (the rows' data is not staged).
  if (in.record_key == 0 || r == 0 || !batch.embeddings.empty() || !batch.last_keys.empty()) {
    Tensor out = r > 0 ? be_.scratch(DType::F32, {r, V}) : Tensor();
    compute(batch, kv, out);
    deliver(out, r, logits, ids, picks);
    return;
  }
  if (step_logits_.empty() || step_logits_.dim(0) < r) {
    be_.forget_recordings();
    step_logits_ = Tensor();
    step_logits_ = be_.alloc(DType::F32, {std::max<int64_t>(r, 8), V});
  }
  Tensor out = step_logits_.slice_rows(0, r);
  if (!be_.replay_step(in.record_key)) {
    be_.begin_recording(in.record_key);
    compute(batch, kv, out);
    be_.end_recording(in.record_key);
  }
  deliver(out, r, logits, ids, picks);
}

void Gemma4Model::compute(const Batch& batch, KVMemory& kv, Tensor& out) {
  const int64_t n = int64_t(batch.tokens.size()), H = cfg_.hidden_size;
  Tensor x = be_.scratch(DType::F32, {n, H});
  be_.embed(embed_tokens, batch.tokens.data(), n, embed_scale, x);  // [n, H]
  for (const EmbeddingRows& e : batch.embeddings) {  // soft tokens over their placeholders' rows
    Tensor rows = x.slice_rows(e.row, e.count);
    be_.upload(e.data, rows);
  }
  Tensor ple;
  if (cfg_.ple_dim > 0) ple = per_layer_inputs(batch, x);          // [L, n, P]

  const bool has_ple = cfg_.ple_dim > 0;
  Tensor h = be_.scratch(DType::F32, {n, H});
  be_.rms_norm(x, &layers_[0].attn_norm, cfg_.rms_eps, cfg_.norm_adds_one, h);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    Gemma4Layer& w = layers_[size_t(l)];
    const Tensor* next_attn_norm = l + 1 < cfg_.n_layers ? &layers_[size_t(l) + 1].attn_norm : nullptr;
    Tensor h_ffn, h_next;
    attention_block(l, x, h, batch, kv, h_ffn);
    h = Tensor();
    ffn_block(l, x, h_ffn, has_ple ? 1.f : w.layer_scalar, has_ple ? nullptr : next_attn_norm, h_next);
    h_ffn = Tensor();
    if (has_ple) {
      const int64_t P = cfg_.ple_dim;
      Tensor g = be_.scratch(DType::F32, {n, P});
      be_.matmul_gelu_times(x, w.ple_gate, ple.slice_rows(l, 1).reshaped({n, P}), g);
      Tensor p = be_.scratch(DType::F32, {n, H});
      be_.matmul(g, w.ple_proj, p);
      if (next_attn_norm) {
        h_next = be_.scratch(DType::F32, {n, H});
        be_.add_rms_norm_norm(x, p, &w.ple_post_norm, cfg_.rms_eps, cfg_.norm_adds_one, w.layer_scalar,
                              next_attn_norm, h_next);
      } else {
        be_.add_rms_norm(x, p, &w.ple_post_norm, cfg_.rms_eps, cfg_.norm_adds_one, w.layer_scalar);
      }
    }
    h = std::move(h_next);
  }

  // Only the rows whose logits are wanted go through the final norm and the LM head.
  const int64_t r = int64_t(batch.logit_rows.size());
  if (r == 0) return;
  Tensor xr = be_.scratch(DType::F32, {r, H});
  be_.gather_rows(x, batch.logit_rows.data(), r, xr);
  be_.rms_norm(xr, &final_norm, cfg_.rms_eps, cfg_.norm_adds_one, xr);
  be_.matmul(xr, lm_head, out);
  if (cfg_.final_logit_softcap > 0) be_.softcap(out, cfg_.final_logit_softcap);
}

}  // namespace

namespace gemma4 {

std::unique_ptr<Model> make_decoder(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                    const ModelLoadOptions& opts) {
  return std::make_unique<Gemma4Model>(std::move(ck), backend, opts);
}

}  // namespace gemma4

}  // namespace mb
