// markbase::Engine, the public C++ API: one request at a time on the caller's thread, through
// the same engine core (scheduler, paged KV, sampler) that serves many users at once.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "core/error.h"
#include "markbase/markbase.h"
#include "media/file.h"
#include "media/video.h"
#include "models/model.h"
#include "runtime/engine_core.h"
#include "runtime/text.h"

namespace markbase {

namespace {


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
  explicit LocalEngine(const EngineOptions& opts) : core_(core_options(opts)) {
    const mb::ModelConfig& c = core_.config();
    info_.path = opts.model_path;
    info_.architecture = c.architecture;
    info_.model_type = c.model_type;
    info_.family = c.family;
    info_.vocab_size = c.vocab_size;
    info_.hidden_size = c.hidden_size;
    info_.n_layers = c.n_layers;
    info_.max_context = core_.max_context();
    info_.weight_dtype = opts.dtype == "auto" ? std::string(mb::dtype_name(c.checkpoint_dtype)) + " (checkpoint)" : opts.dtype;
    info_.weight_bytes = core_.model().weight_bytes();
    info_.details = describe_config(c);
  }

  bool has_tokenizer() const override { return core_.text() != nullptr; }

  std::vector<int32_t> tokenize(std::string_view text, bool add_bos) const override {
    return codec().encode(text, add_bos);
  }

  std::string detokenize(std::span<const int32_t> ids) const override { return codec().tokenizer().decode(ids); }

  const ModelInfo& info() const override { return info_; }

  std::string op_profile() override { return core_.op_profile(); }

  std::vector<float> prompt_logits(std::span<const int32_t> tokens, int chunk,
                                   const std::vector<Media>& media) override {
    mb::GenerationOptions o;
    o.max_tokens = 0;
    o.want_prompt_logits = true;
    o.prompt_chunk = std::max(chunk, 0);
    std::vector<float> logits;
    std::vector<int32_t> prompt(tokens.begin(), tokens.end());
    std::vector<mb::MediaSpan> spans = place_media(prompt, media);
    if (prompt.size() != tokens.size()) {
      // A single placeholder was expanded (what generate wants), but logits writes a row per given id.
      std::string runs;
      for (const mb::MediaSpan& s : spans) runs += (runs.empty() ? "" : ", ") + std::to_string(s.count);
      mb::fail("logits: the media's soft tokens do not fill the placeholder runs of the given ids ({} ids, {} with "
               "the media expanded): logits writes one row per given id, so give each placeholder run at its full "
               "length (soft tokens, in order: {}), with the begin/end tokens around it",
               tokens.size(), prompt.size(), runs);
    }
    run(std::move(prompt), o, std::move(spans), [&](mb::StreamEvent& e) {
      if (!e.prompt_logits.empty()) logits = std::move(e.prompt_logits);
      return true;
    });
    return logits;
  }

  Result generate(const Request& req) override {
    Result res;
    if (!req.prompt_tokens.empty()) res.prompt_ids = req.prompt_tokens;
    else if (req.chat)
      res.prompt_ids = codec().encode_user_prompt(req.prompt, req.enable_thinking, req.system_prompt,
                                                  media_parts(req.media));
    else if (!req.prompt.empty()) res.prompt_ids = codec().encode(req.prompt, /*add_bos=*/true);
    const auto t0 = std::chrono::steady_clock::now();  // time to the first token includes encoding media
    std::vector<mb::MediaSpan> spans = place_media(res.prompt_ids, req.media, req.chat && req.prompt_tokens.empty());
    MB_CHECK(!res.prompt_ids.empty(), "empty prompt: give text or at least one token");
    MB_CHECK(req.system_prompt.empty() || (req.chat && req.prompt_tokens.empty()),
             "a system prompt needs chat and a text prompt (not token ids)");
    mb::GenerationOptions o;
    o.max_tokens = req.max_new_tokens;
    o.temperature = req.sampling.temperature;
    o.top_k = req.sampling.top_k;
    o.top_p = req.sampling.top_p;
    o.min_p = req.sampling.min_p;
    o.seed = req.sampling.seed;
    o.stop = req.stop;
    o.ignore_eos = !req.stop_at_eos;
    res.prompt_tokens = int64_t(res.prompt_ids.size());
    res.finish_reason = "length";
    auto first = t0;
    bool cancelled = false;
    const mb::RequestUsage usage = run(res.prompt_ids, o, std::move(spans), [&](mb::StreamEvent& e) {
      for (const mb::GeneratedToken& g : e.tokens) {
        if (res.tokens.empty()) first = std::chrono::steady_clock::now();
        res.tokens.push_back(g.token);
      }
      res.text += e.text;
      if (!e.finish_reason.empty()) {
        res.finish_reason = e.finish_reason;
        MB_CHECK(e.finish_reason != "error", "{}", e.error);
      }
      if (!req.on_token || cancelled) return true;
      for (size_t i = 0; i < e.tokens.size(); ++i)  // the text comes with the event's last token
        if (!req.on_token(e.tokens[i].token, i + 1 == e.tokens.size() ? std::string_view(e.text) : "")) {
          cancelled = true;
          return false;
        }
      if (e.tokens.empty() && !e.text.empty()) req.on_token(-1, e.text);
      return true;
    });
    res.seed = usage.seed;
    if (res.tokens.empty()) first = std::chrono::steady_clock::now();
    res.prefill_seconds = std::chrono::duration<double>(first - t0).count();
    res.decode_seconds = seconds_since(first);
    return res;
  }

 private:
  static mb::EngineOptions core_options(const EngineOptions& o) {
    mb::EngineOptions c;
    c.model_path = o.model_path;
    c.mmproj_path = o.mmproj_path;
    c.image_tokens = o.image_tokens;
    c.exact_media = o.exact_media;
    c.device = o.device;
    c.dtype = o.dtype;
    c.threads = o.threads;
    c.max_context = o.max_context;
    c.max_seqs = 1;
    c.profile_ops = o.profile_ops;
    return c;
  }

  // Runs one request to its end on this thread; `on_event` returning false cancels it.
  template <typename F>
  mb::RequestUsage run(std::vector<int32_t> prompt, const mb::GenerationOptions& o, std::vector<mb::MediaSpan> media,
                       F&& on_event) {
    core_.validate(prompt, o, media);
    auto stream = std::make_shared<mb::RequestStream>("local", o.n);
    core_.add(stream, mb::PendingRequest{std::move(prompt), o, std::move(media)});
    while (!stream->done()) {
      if (core_.has_work()) core_.step();
      while (auto e = stream->next(std::chrono::milliseconds(0)))
        if (!on_event(*e)) stream->cancel();
    }
    return stream->usage();
  }

  // The chat template's parts for the media, which it prints as one placeholder each.
  static std::vector<std::string> media_parts(const std::vector<Media>& media) {
    std::vector<std::string> parts;
    for (const Media& m : media)
      parts.push_back(m.kind == Media::Kind::Image ? "image" : m.kind == Media::Kind::Audio ? "audio" : "video");
    return parts;
  }

  std::vector<mb::MediaSpan> place_media(std::vector<int32_t>& prompt, const std::vector<Media>& media,
                                         bool rendered = false) {
    if (media.empty()) return {};
    std::vector<mb::MediaItem> items;
    for (size_t i = 0; i < media.size(); ++i) items.push_back(media_item(media[i], i));
    mb::PromptMedia::Tokenize tokenize;
    if (core_.text()) tokenize = [this](const std::string& s) { return core_.text()->encode(s, /*add_bos=*/false); };
    return core_.media().place(prompt, items, core_.config().bos_id, rendered, tokenize);
  }

  static mb::MediaItem media_item(const Media& m, size_t i) {
    static constexpr const char* kNames[] = {"image", "audio clip", "video"};
    mb::MediaItem it;
    it.kind = m.kind == Media::Kind::Image   ? mb::MediaItem::Kind::Image
              : m.kind == Media::Kind::Audio ? mb::MediaItem::Kind::Audio
                                             : mb::MediaItem::Kind::Video;
    it.what = !m.path.empty() ? m.path : fmt::format("{} {} of the request", kNames[int(m.kind)], i + 1);
    if (!m.bytes.empty() || !m.frames.empty()) {
      it.bytes = m.bytes;
      it.frames = m.frames;
    } else if (m.kind == Media::Kind::Video && std::filesystem::is_directory(m.path)) {
      for (const std::string& f : mb::list_frame_files(m.path)) it.frames.push_back(mb::read_media_file(f));
    } else if (!m.path.empty()) {
      it.bytes = mb::read_media_file(m.path);
    }
    return it;
  }

  const mb::TextCodec& codec() const {
    MB_CHECK(core_.text() != nullptr, "{}: this model has no tokenizer (tokenizer.json); pass token ids instead",
             info_.path);
    return *core_.text();
  }

  mb::EngineCore core_;
  ModelInfo info_;
};

}  // namespace

std::unique_ptr<Engine> Engine::open(const EngineOptions& opts) { return std::make_unique<LocalEngine>(opts); }

}  // namespace markbase
