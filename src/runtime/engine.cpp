// Single-process engine: model + backend + KV cache + sampler. One request at a time for now;
// the Batch/KV-slot interfaces it drives already carry several sequences per step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include <fmt/ranges.h>

#include "backends/backend.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "models/checkpoint.h"
#include "markbase/markbase.h"
#include "models/model.h"
#include "runtime/kv_cache.h"
#include "runtime/sampler.h"
#include "runtime/text.h"

namespace markbase {

namespace {

using mb::DType;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string describe_config(const mb::ModelConfig& c) {
  std::string s = fmt::format(
      "hidden {} | layers {} | heads {} | vocab {} | sliding window {} | max context {}\n"
      "per-layer embeddings {} | KV-shared layers {} | MoE {} | final softcap {}\n",
      c.hidden_size, c.n_layers, c.n_heads, c.vocab_size, c.sliding_window, c.max_position,
      c.ple_dim ? fmt::format("{} wide", c.ple_dim) : "no", c.n_kv_shared_layers,
      c.moe ? fmt::format("{} experts, top {}, width {}", c.n_experts, c.top_k_experts, c.moe_ffn_dim) : "no",
      c.final_logit_softcap);
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& L = c.layers[size_t(l)];
    s += fmt::format("  layer {:>3}: {:<7} head_dim {:>3} kv_heads {:>2} {} ffn {:>6} rope theta {:g}{}{}\n", l,
                     L.kind == mb::AttnKind::Full ? "full" : "sliding", L.head_dim, L.n_kv_heads,
                     L.has_v_proj ? "    " : "K=V ", L.ffn_dim, L.rope.theta,
                     L.rope.partial_rotary_factor < 1 ? fmt::format(" partial {:g}", L.rope.partial_rotary_factor) : "",
                     L.kv_source != l ? fmt::format(" (KV from layer {})", L.kv_source) : "");
  }
  return s;
}

class LocalEngine final : public Engine {
 public:
  explicit LocalEngine(const EngineOptions& opts) : opts_(opts) {
    if (opts.threads > 0) mb::ThreadPool::set_global_threads(opts.threads);
    MB_CHECK(opts.device == "cpu" || opts.device == "cuda", "unknown device '{}' (expected cpu or cuda)", opts.device);
    MB_CHECK(opts.device == "cpu", "device 'cuda' is not available in this build yet; use --device cpu");
    ck_ = mb::open_checkpoint(opts.model_path);
    backend_ = mb::make_cpu_backend();
    mb::ModelLoadOptions mo;
    if (opts.dtype == "auto") mo.keep_checkpoint_dtype = true;
    else {
      mo.keep_checkpoint_dtype = false;
      const std::optional<DType> t = mb::weight_dtype_from_name(opts.dtype);
      MB_CHECK(t.has_value(), "unsupported --dtype '{}' (supported: auto, {})", opts.dtype,
               fmt::join(mb::weight_dtype_names(), ", "));
      mo.weight_dtype = *t;
    }
    model_ = mb::load_model(ck_, *backend_, mo);
    // The GGUF metadata (mostly token strings, several MB) has served the config; the tokenizer
    // is read on its own below.
    ck_->gguf.reset();
    const auto& c = model_->config();
    max_context_ = c.max_position > 0 ? c.max_position : 8192;
    if (opts.max_context > 0) max_context_ = std::min<int64_t>(max_context_, opts.max_context);
    info_.path = opts.model_path;
    info_.architecture = c.architecture;
    info_.model_type = c.model_type;
    info_.family = c.family;
    info_.vocab_size = c.vocab_size;
    info_.hidden_size = c.hidden_size;
    info_.n_layers = c.n_layers;
    info_.max_context = max_context_;
    info_.weight_dtype = opts.dtype == "auto" ? std::string(mb::dtype_name(c.checkpoint_dtype)) + " (checkpoint)" : opts.dtype;
    info_.weight_bytes = model_->weight_bytes();
    info_.details = describe_config(c);
    stop_ids_.assign(c.eos_ids.begin(), c.eos_ids.end());
    try {
      text_.emplace(mb::TextCodec::load(opts.model_path, ck_->architecture()));
      stop_ids_ = text_->stop_ids(stop_ids_);
      MB_CHECK(text_->tokenizer().vocab_size() <= c.vocab_size,
               "{}: the tokenizer has {} ids but the model only {}", opts.model_path, text_->tokenizer().vocab_size(),
               c.vocab_size);
    } catch (const Error& e) {
      if (std::string(e.what()).find("no tokenizer") == std::string::npos) throw;
      // A checkpoint without a tokenizer still runs from token ids.
    }
  }

  bool has_tokenizer() const override { return text_.has_value(); }

  std::vector<int32_t> tokenize(std::string_view text, bool add_bos) const override {
    return codec().encode(text, add_bos);
  }

  std::string detokenize(std::span<const int32_t> ids) const override { return codec().tokenizer().decode(ids); }

  const ModelInfo& info() const override { return info_; }

  std::vector<float> prompt_logits(std::span<const int32_t> tokens, int chunk) override {
    MB_CHECK(!tokens.empty(), "no tokens given");
    check_tokens(tokens);
    const int64_t n = int64_t(tokens.size());
    MB_CHECK(n <= max_context_, "prompt of {} tokens exceeds the context size {}", n, max_context_);
    const int64_t step = chunk > 0 ? std::min<int64_t>(chunk, kMaxStep) : kMaxStep;
    mb::KVCache kv(model_->config(), *backend_, {1, n, step});
    std::vector<float> all, part;
    all.reserve(size_t(n) * size_t(info_.vocab_size));
    for (int64_t b = 0; b < n; b += step) {
      const int64_t cnt = std::min(step, n - b);
      mb::Batch batch = single_sequence(tokens.subspan(size_t(b), size_t(cnt)), b, /*all_logits=*/true);
      model_->forward(batch, kv, part);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }

  Result generate(const Request& req) override {
    Result res;
    if (!req.prompt_tokens.empty()) res.prompt_ids = req.prompt_tokens;
    else if (req.chat) res.prompt_ids = codec().encode_user_prompt(req.prompt, req.enable_thinking);
    else if (!req.prompt.empty()) res.prompt_ids = codec().encode(req.prompt, /*add_bos=*/true);
    MB_CHECK(!res.prompt_ids.empty(), "empty prompt: give text or at least one token");
    MB_CHECK(req.max_new_tokens >= 0, "max_new_tokens must be >= 0");
    check_tokens(res.prompt_ids);
    const std::vector<int32_t>& prompt_ids = res.prompt_ids;
    const int64_t n = int64_t(prompt_ids.size());
    MB_CHECK(n < max_context_, "prompt of {} tokens does not fit the context size {}", n, max_context_);
    const int64_t ctx = std::min<int64_t>(max_context_, n + req.max_new_tokens);
    mb::KVCache kv(model_->config(), *backend_, {1, ctx, kMaxStep});
    mb::Sampler sampler({req.sampling.temperature, req.sampling.top_k, req.sampling.top_p, req.sampling.min_p,
                         req.sampling.seed});
    res.prompt_tokens = n;
    std::vector<float> logits;
    auto t0 = std::chrono::steady_clock::now();
    std::span<const int32_t> prompt(prompt_ids);
    for (int64_t b = 0; b < n; b += kMaxStep) {
      const int64_t cnt = std::min<int64_t>(kMaxStep, n - b);
      mb::Batch batch = single_sequence(prompt.subspan(size_t(b), size_t(cnt)), b, false);
      model_->forward(batch, kv, logits);
    }
    res.prefill_seconds = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    res.finish_reason = "length";
    int64_t pos = n;
    std::optional<mb::StreamingDecoder> detok;
    if (text_) detok.emplace(text_->tokenizer());
    for (int i = 0; i < req.max_new_tokens; ++i) {
      check_finite(logits);
      int32_t tok = sampler.sample(logits);
      res.tokens.push_back(tok);
      const bool stop = req.stop_at_eos && std::find(stop_ids_.begin(), stop_ids_.end(), tok) != stop_ids_.end();
      std::string piece = detok && !stop ? detok->push(tok) : std::string();
      res.text += piece;
      if (req.on_token && !req.on_token(tok, piece)) {
        res.finish_reason = "cancelled";
        break;
      }
      if (stop) {
        res.finish_reason = "stop";
        break;
      }
      if (i + 1 == req.max_new_tokens) break;
      if (pos >= ctx) break;
      mb::Batch batch = single_sequence(std::span<const int32_t>(&tok, 1), pos, false);
      model_->forward(batch, kv, logits);
      ++pos;
    }
    if (detok) {
      std::string tail = detok->flush();
      res.text += tail;
      if (!tail.empty() && req.on_token) req.on_token(-1, tail);
    }
    res.decode_seconds = seconds_since(t0);
    return res;
  }

 private:
  static constexpr int64_t kMaxStep = mb::kMaxStepTokens;

  void check_tokens(std::span<const int32_t> tokens) const {
    for (int32_t t : tokens)
      MB_CHECK(t >= 0 && t < info_.vocab_size, "token id {} is outside the vocabulary [0, {})", t, info_.vocab_size);
  }

  static void check_finite(const std::vector<float>& v) {
    for (float f : v) MB_CHECK(std::isfinite(f), "model produced a non-finite logit");
  }

  static mb::Batch single_sequence(std::span<const int32_t> toks, int64_t start, bool all_logits) {
    mb::Batch b;
    b.tokens.assign(toks.begin(), toks.end());
    const int64_t cnt = int64_t(toks.size());
    for (int64_t i = 0; i < cnt; ++i) b.positions.push_back(int32_t(start + i));
    b.seqs.push_back({0, 0, cnt});
    if (all_logits)
      for (int64_t i = 0; i < cnt; ++i) b.logit_rows.push_back(int32_t(i));
    else
      b.logit_rows.push_back(int32_t(cnt - 1));
    return b;
  }

  const mb::TextCodec& codec() const {
    MB_CHECK(text_.has_value(), "{}: this model has no tokenizer (tokenizer.json); pass token ids instead",
             opts_.model_path);
    return *text_;
  }

  EngineOptions opts_;
  std::optional<mb::TextCodec> text_;
  std::vector<int32_t> stop_ids_;
  std::shared_ptr<mb::Checkpoint> ck_;
  std::unique_ptr<mb::Backend> backend_;
  std::unique_ptr<mb::Model> model_;
  int64_t max_context_ = 0;
  ModelInfo info_;
};

}  // namespace

std::unique_ptr<Engine> Engine::open(const EngineOptions& opts) { return std::make_unique<LocalEngine>(opts); }

}  // namespace markbase
