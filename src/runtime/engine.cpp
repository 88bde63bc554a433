// Single-process engine: model + backend + KV cache + sampler. One request at a time for now;
// the Batch/KV-slot interfaces it drives already carry several sequences per step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>

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

// A seed for a request that names none: from the OS's entropy, so that two runs differ.
uint64_t random_seed() {
  std::random_device rd;
  return uint64_t(rd()) << 32 | rd();
}

// The generated text and how much of it the caller has been given. While stop strings are
// watched for, text that could still become one is held back until a later token decides.
class StreamedText {
 public:
  explicit StreamedText(const std::vector<std::string>& stops) : stops_(stops) {
    for (const std::string& s : stops) longest_ = std::max(longest_, s.size());
  }

  // Appends `piece`; true when the text now contains a stop string (it is then cut before it).
  bool append(std::string_view piece) {
    // A stop string that was not there before ends inside the piece.
    const size_t from = text_.size() >= longest_ ? text_.size() - longest_ + 1 : 0;
    text_ += piece;
    size_t cut = std::string::npos;
    for (const std::string& s : stops_) cut = std::min(cut, text_.find(s, from));
    if (cut == std::string::npos) return false;
    text_.resize(cut);  // never before released_: the held-back suffix starts at or before `cut`
    return true;
  }

  // The text not given yet that may be given now (all of it when `final`), marked as given.
  std::string_view release(bool final) {
    size_t end = text_.size();
    if (!final)
      for (const std::string& s : stops_)  // the longest end of the text that begins a stop string
        for (size_t len = std::min(s.size() - 1, text_.size() - released_); len > 0; --len)
          if (std::string_view(text_).substr(text_.size() - len) == std::string_view(s).substr(0, len)) {
            end = std::min(end, text_.size() - len);
            break;
          }
    const std::string_view out = std::string_view(text_).substr(released_, end - released_);
    released_ = end;
    return out;
  }

  std::string take() { return std::move(text_); }

 private:
  const std::vector<std::string>& stops_;
  size_t longest_ = 1;
  std::string text_;
  size_t released_ = 0;
};

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
    MB_CHECK(opts.max_context >= 0 && opts.max_context <= max_context_,
             "context size {} is out of range: the model holds at most {} tokens (0: that maximum)", opts.max_context,
             max_context_);
    if (opts.max_context > 0) max_context_ = opts.max_context;
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
    check_fits(n);
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
    else if (req.chat)
      res.prompt_ids = codec().encode_user_prompt(req.prompt, req.enable_thinking, req.system_prompt);
    else if (!req.prompt.empty()) res.prompt_ids = codec().encode(req.prompt, /*add_bos=*/true);
    MB_CHECK(!res.prompt_ids.empty(), "empty prompt: give text or at least one token");
    MB_CHECK(req.system_prompt.empty() || (req.chat && req.prompt_tokens.empty()),
             "a system prompt needs chat and a text prompt (not token ids)");
    MB_CHECK(req.max_new_tokens >= 0, "max_new_tokens must be >= 0");
    for (const std::string& s : req.stop) MB_CHECK(!s.empty(), "a stop string must not be empty");
    if (!req.stop.empty()) codec();  // stop strings are text: throws when there is no tokenizer
    check_tokens(res.prompt_ids);
    const std::vector<int32_t>& prompt_ids = res.prompt_ids;
    const int64_t n = int64_t(prompt_ids.size());
    check_fits(n);
    // Positions n .. ctx - 1 take the tokens sampled before the last; the last one needs no row.
    const int64_t ctx = std::min<int64_t>(max_context_, n + req.max_new_tokens);
    mb::KVCache kv(model_->config(), *backend_, {1, ctx, kMaxStep});
    res.seed = req.sampling.seed ? *req.sampling.seed : random_seed();
    mb::Sampler sampler(
        {req.sampling.temperature, req.sampling.top_k, req.sampling.top_p, req.sampling.min_p, res.seed});
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
    StreamedText text(req.stop);
    bool cut = false;  // a stop string ended the text: what the decoder still holds came after it
    for (int i = 0; i < req.max_new_tokens; ++i) {
      check_finite(logits);
      int32_t tok = sampler.sample(logits);
      res.tokens.push_back(tok);
      const bool eos = req.stop_at_eos && std::find(stop_ids_.begin(), stop_ids_.end(), tok) != stop_ids_.end();
      cut = text.append(detok && !eos ? detok->push(tok) : std::string());
      const bool stop = cut || eos;
      if (req.on_token && !req.on_token(tok, text.release(stop))) {
        res.finish_reason = "cancelled";
        break;
      }
      if (stop) {
        res.finish_reason = "stop";
        break;
      }
      if (i + 1 == req.max_new_tokens) break;
      if (pos >= ctx) {
        res.finish_reason = "context";
        break;
      }
      mb::Batch batch = single_sequence(std::span<const int32_t>(&tok, 1), pos, false);
      model_->forward(batch, kv, logits);
      ++pos;
    }
    if (detok && !cut && text.append(detok->flush()) && res.finish_reason != "cancelled") res.finish_reason = "stop";
    const std::string_view rest = text.release(/*final=*/true);
    if (!rest.empty() && req.on_token) req.on_token(-1, rest);
    res.text = text.take();
    res.decode_seconds = seconds_since(t0);
    return res;
  }

 private:
  static constexpr int64_t kMaxStep = mb::kMaxStepTokens;

  // generate and prompt_logits take the same prompts: up to max_context_ tokens.
  void check_fits(int64_t n) const {
    MB_CHECK(n <= max_context_, "prompt of {} tokens exceeds the context size {}", n, max_context_);
  }

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
