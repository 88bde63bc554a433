#include "runtime/engine_core.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include <fmt/ranges.h>

#include "backends/profiling_backend.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "runtime/kv_cache.h"
#include "runtime/sampler.h"

namespace mb {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// A seed for a request that names none: from the OS's entropy, so that two runs differ.
uint64_t random_seed() {
  std::random_device rd;
  return uint64_t(rd()) << 32 | rd();
}

constexpr int64_t kDefaultPageTokens = 16;

// No NaN or infinity among x[0, n): on the exponent bits, so that the loop vectorizes.
bool all_finite(const float* x, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    bad |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

// The generated text and how much of it the client has been given. While stop strings are
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
  std::string release(bool final) {
    size_t end = text_.size();
    if (!final)
      for (const std::string& s : stops_)  // the longest end of the text that begins a stop string
        for (size_t len = std::min(s.size() - 1, text_.size() - released_); len > 0; --len)
          if (std::string_view(text_).substr(text_.size() - len) == std::string_view(s).substr(0, len)) {
            end = std::min(end, text_.size() - len);
            break;
          }
    std::string out = text_.substr(released_, end - released_);
    released_ = end;
    return out;
  }

 private:
  std::vector<std::string> stops_;
  size_t longest_ = 1;
  std::string text_;
  size_t released_ = 0;
};

}  // namespace

void Histogram::observe(double seconds) {
  size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i]) ++i;
  ++counts[i];
  sum += seconds;
  ++total;
}

struct EngineCore::Choice : Sequence {
  Request* request = nullptr;
  int index = 0;
  std::unique_ptr<Sampler> sampler;
  TokenHistory history;
  std::optional<StreamingDecoder> detok;
  std::unique_ptr<StreamedText> text;
  int64_t generated = 0;
  bool done = false;
  bool cut = false;  // a stop string ended the text: what the decoder still holds came after it
  Clock::time_point last_token;
};

struct EngineCore::Request {
  std::shared_ptr<RequestStream> stream;
  GenerationOptions opts;
  LogitAdjustments adjust;
  std::vector<std::unique_ptr<Choice>> choices;
  Clock::time_point submitted;
  bool scheduled = false, first_token = false, prompt_logits_sent = false;
  std::vector<float> prompt_logits;
  int64_t prompt_rows = 0;  // prompt positions whose logits are in prompt_logits
  RequestUsage usage;
  int open = 0;
};

EngineCore::EngineCore(const EngineOptions& opts) : opts_(opts) {
  if (opts.threads > 0) ThreadPool::set_global_threads(opts.threads);
  MB_CHECK(opts.device == "cpu" || opts.device == "cuda", "unknown device '{}' (expected cpu or cuda)", opts.device);
  MB_CHECK(opts.max_seqs > 0, "the number of sequences must be at least 1, got {}", opts.max_seqs);
  check_image_tokens(opts.image_tokens);
  ck_ = open_checkpoint(opts.model_path);
  // An mmproj file is read when the first media item comes; what it is, and that it goes with this
  // model, is checked now.
  if (!opts.mmproj_path.empty()) check_mmproj(*ck_, opts.mmproj_path);
  backend_ = make_backend(opts.device);
  if (opts.profile_ops) {
    profiled_ = std::move(backend_);
    auto profiler = std::make_unique<ProfilingBackend>(*profiled_);
    profiler->set_enabled(true);
    backend_ = std::move(profiler);
  }
  ModelLoadOptions mo;
  if (opts.dtype == "auto") {
    mo.keep_checkpoint_dtype = true;
  } else {
    mo.keep_checkpoint_dtype = false;
    const std::optional<DType> t = weight_dtype_from_name(opts.dtype);
    MB_CHECK(t.has_value(), "unsupported --dtype '{}' (supported: auto, {})", opts.dtype,
             fmt::join(weight_dtype_names(), ", "));
    mo.weight_dtype = *t;
  }
  model_ = load_model(ck_, *backend_, mo);
  // The GGUF metadata (mostly token strings, several MB) has served the config; the tokenizer
  // is read on its own below.
  ck_->gguf.reset();
  const ModelConfig& c = model_->config();
  max_context_ = c.max_position > 0 ? c.max_position : 8192;
  MB_CHECK(opts.max_context >= 0 && opts.max_context <= max_context_,
           "context size {} is out of range: the model holds at most {} tokens (0: that maximum)", opts.max_context,
           max_context_);
  if (opts.max_context > 0) max_context_ = opts.max_context;
  stop_ids_.assign(c.eos_ids.begin(), c.eos_ids.end());
  try {
    text_.emplace(TextCodec::load(opts.model_path, ck_->architecture()));
    stop_ids_ = text_->stop_ids(stop_ids_);
    MB_CHECK(text_->tokenizer().vocab_size() <= c.vocab_size, "{}: the tokenizer has {} ids but the model only {}",
             opts.model_path, text_->tokenizer().vocab_size(), c.vocab_size);
  } catch (const Error& e) {
    if (std::string(e.what()).find("no tokenizer") == std::string::npos) throw;
    // A checkpoint without a tokenizer still runs from token ids.
  }

  KVPageOptions po;
  po.page_tokens = opts.page_tokens > 0 ? opts.page_tokens : kDefaultPageTokens;
  po.max_context = max_context_;
  // An image a model attends bidirectionally is computed in one step: up to 1120 soft tokens.
  const int64_t max_step = c.bidirectional_images ? kMaxMediaStepTokens : kMaxStepTokens;
  po.max_step = max_step;
  po.max_seqs = opts.max_seqs;
  po.prefix_cache = opts.prefix_cache;
  po.resident = opts.resident_kv;
  po.kv_dtype = backend_->kv_dtype();
  const size_t one = KVPageManager::min_bytes(c, po);
  if (opts.kv_bytes > 0) {
    po.bytes = opts.kv_bytes;
  } else {
    // Room for every sequence at full context, up to a quarter of the machine's memory or 8 GiB,
    // and never less than one sequence needs.
    // On a GPU: up to 70% of its memory left after the weights.
    const size_t ram = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
    const size_t device_free = backend_->device_free_bytes();
    const size_t cap = device_free ? device_free / 10 * 7 : std::min(ram / 4, size_t(8) << 30);
    po.bytes = std::max(one, std::min(one * size_t(opts.max_seqs), cap));
  }
  pages_ = std::make_unique<KVPageManager>(c, *backend_, po);
  SchedulerOptions so;
  so.max_seqs = opts.max_seqs;
  so.max_step = kMaxStepTokens;
  // Every running sequence gets at least its decode position in every step.
  so.step_tokens = std::max<int64_t>(opts.step_tokens > 0 ? opts.step_tokens : kMaxStepTokens, opts.max_seqs);
  scheduler_ = std::make_unique<Scheduler>(*pages_, so);
  runner_ = std::make_unique<ModelRunner>(*model_, *pages_, max_context_, max_step);
  m_.page_tokens = po.page_tokens;
}

EngineCore::~EngineCore() = default;

std::string EngineCore::op_profile() {
  if (!profiled_) return {};
  return static_cast<ProfilingBackend&>(*backend_).table(profiled_->name() +
                                                         " backend, every op since the model was opened");
}

PromptMedia& EngineCore::media() {
  if (!media_)
    media_ = std::make_unique<PromptMedia>(
        opts_.model_path,
        CheckpointOptions{.load_multimodal = true, .mmproj = opts_.mmproj_path, .image_tokens = opts_.image_tokens,
                          .exact_media = opts_.exact_media},
        *backend_);
  return *media_;
}

void EngineCore::validate(const std::vector<int32_t>& prompt, const GenerationOptions& o,
                          const std::vector<MediaSpan>& media) const {
  const int64_t vocab = model_->config().vocab_size;
  MB_CHECK(!prompt.empty(), "empty prompt: give text or at least one token");
  int64_t media_end = 0;
  for (const MediaSpan& m : media) {
    MB_CHECK(m.pos >= media_end && m.count > 0 && m.pos + m.count <= int64_t(prompt.size()),
             "media soft tokens at prompt positions [{}, {}) overlap another or leave the {}-token prompt", m.pos,
             m.pos + m.count, prompt.size());
    MB_CHECK(m.embeddings && int64_t(m.embeddings->size()) == m.count * model_->config().hidden_size,
             "media soft tokens: {} values for {} tokens of width {}", m.embeddings ? m.embeddings->size() : 0,
             m.count, model_->config().hidden_size);
    MB_CHECK(!m.image || !model_->config().bidirectional_images || m.count <= kMaxMediaStepTokens,
             "an image of {} soft tokens exceeds the {} one step computes", m.count, kMaxMediaStepTokens);
    media_end = m.pos + m.count;
  }
  for (int32_t t : prompt) MB_CHECK(t >= 0 && t < vocab, "token id {} is outside the vocabulary [0, {})", t, vocab);
  MB_CHECK(int64_t(prompt.size()) <= max_context_, "prompt of {} tokens exceeds the context size {}", prompt.size(),
           max_context_);
  MB_CHECK(o.max_tokens >= 0, "max_tokens must be >= 0, got {}", o.max_tokens);
  MB_CHECK(o.n >= 1 && o.n <= 128, "n must be in [1, 128], got {}", o.n);
  MB_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "temperature must be >= 0, got {}", o.temperature);
  MB_CHECK(o.top_k >= 0, "top_k must be >= 0, got {}", o.top_k);
  MB_CHECK(o.top_p > 0 && o.top_p <= 1, "top_p must be in (0, 1], got {}", o.top_p);
  MB_CHECK(o.min_p >= 0 && o.min_p <= 1, "min_p must be in [0, 1], got {}", o.min_p);
  MB_CHECK(std::isfinite(o.presence_penalty) && std::fabs(o.presence_penalty) <= 2,
           "presence_penalty must be in [-2, 2], got {}", o.presence_penalty);
  MB_CHECK(std::isfinite(o.frequency_penalty) && std::fabs(o.frequency_penalty) <= 2,
           "frequency_penalty must be in [-2, 2], got {}", o.frequency_penalty);
  MB_CHECK(std::isfinite(o.repetition_penalty) && o.repetition_penalty > 0 && o.repetition_penalty <= 10,
           "repetition_penalty must be in (0, 10], got {}", o.repetition_penalty);
  for (const auto& [id, b] : o.logit_bias) {
    MB_CHECK(id >= 0 && id < vocab, "logit_bias: token id {} is outside the vocabulary [0, {})", id, vocab);
    MB_CHECK(std::isfinite(b) && std::fabs(b) <= 100, "logit_bias: {} for token {} is not in [-100, 100]", b, id);
  }
  for (int32_t id : o.stop_ids) MB_CHECK(id >= 0 && id < vocab, "stop id {} is outside the vocabulary", id);
  for (const std::string& s : o.stop) MB_CHECK(!s.empty(), "a stop string must not be empty");
  MB_CHECK(o.stop.empty() || text_, "{}: stop strings need a tokenizer, and this model has none", opts_.model_path);
  MB_CHECK(o.top_logprobs >= 0 && o.top_logprobs <= 20, "top_logprobs must be in [0, 20], got {}", o.top_logprobs);
  MB_CHECK(o.timeout_seconds >= 0 && std::isfinite(o.timeout_seconds), "timeout must be >= 0");
  MB_CHECK(o.prompt_chunk >= 0, "prompt chunk must be >= 0");
}

void EngineCore::add(std::shared_ptr<RequestStream> stream, PendingRequest req) {
  auto r = std::make_unique<Request>();
  r->stream = std::move(stream);
  r->opts = std::move(req.opts);
  const GenerationOptions& o = r->opts;
  r->adjust = {o.logit_bias, o.repetition_penalty, o.frequency_penalty, o.presence_penalty};
  r->submitted = Clock::now();
  r->usage.prompt_tokens = int64_t(req.prompt.size());
  r->usage.seed = o.seed ? *o.seed : random_seed();
  r->open = o.n;
  for (int i = 0; i < o.n; ++i) {
    auto c = std::make_unique<Choice>();
    c->request = r.get();
    c->index = i;
    c->id = next_seq_id_++;
    c->tokens = req.prompt;
    c->media = req.media;
    if (model_->config().bidirectional_images)
      for (const MediaSpan& m : req.media)
        if (m.image) c->unsplit.push_back({m.pos, m.pos + m.count});
    for (const MediaSpan& m : req.media)
      for (int64_t j = 0; j < m.count; ++j) c->tokens[size_t(m.pos + j)] = media_token(m.hash, j);
    c->n_prompt = int64_t(req.prompt.size());
    c->max_chunk = o.prompt_chunk;
    c->prefix_cache = !o.want_prompt_logits;
    if (i > 0) c->after = r->choices[0].get();
    c->sampler = std::make_unique<Sampler>(
        SamplerParams{o.temperature, o.top_k, o.top_p, o.min_p, r->usage.seed + uint64_t(i)});
    if (r->adjust.repetition_penalty != 1.f) c->history.add_prompt(req.prompt);
    if (text_) c->detok.emplace(text_->tokenizer(), o.skip_special_tokens);
    c->text = std::make_unique<StreamedText>(o.stop);
    scheduler_->add(c.get());
    r->choices.push_back(std::move(c));
  }
  m_.prompt_tokens_total += int64_t(req.prompt.size());
  requests_.push_back(std::move(r));
}

void EngineCore::finish(Request& r, Choice& c, const std::string& reason_in, const std::string& error) {
  if (c.done) return;
  std::string reason = reason_in;
  if (c.detok && !c.cut && c.text->append(c.detok->flush()) && reason != "cancelled" && reason != "error")
    reason = "stop";
  StreamEvent e;
  e.index = c.index;
  e.text = c.text->release(/*final=*/true);
  e.finish_reason = reason;
  e.error = error;
  c.done = true;
  scheduler_->finish(&c);
  if (--r.open == 0) {
    const auto now = Clock::now();
    r.usage.total_seconds = seconds_between(r.submitted, now);
    r.usage.cached_prompt_tokens = r.choices[0]->n_prompt_cached;
    for (const auto& ch : r.choices) r.usage.preemptions += ch->preemptions;
    r.stream->set_usage(r.usage);
    ++m_.requests_finished;
  }
  r.stream->push(std::move(e));
}

void EngineCore::emit(Request& r, Choice& c, GeneratedToken g) {
  const auto now = Clock::now();
  const int32_t token = g.token;
  ++c.generated;
  ++r.usage.completion_tokens;
  ++m_.generated_tokens_total;
  if (!r.first_token) {
    r.first_token = true;
    r.usage.ttft_seconds = seconds_between(r.submitted, now);
    m_.ttft.observe(r.usage.ttft_seconds);
  } else if (c.generated > 1) {
    m_.itl.observe(seconds_between(c.last_token, now));
  }
  c.last_token = now;
  if (r.adjust.any()) c.history.add_output(token);  // only penalties read it
  const bool eos = (!r.opts.ignore_eos && std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end()) ||
                   std::find(r.opts.stop_ids.begin(), r.opts.stop_ids.end(), token) != r.opts.stop_ids.end();
  c.cut = c.text->append(c.detok && !eos ? c.detok->push(token) : std::string());
  const bool stop = eos || c.cut;
  StreamEvent e;
  e.index = c.index;
  e.tokens.push_back(std::move(g));
  e.text = c.text->release(/*final=*/false);
  r.stream->push(std::move(e));
  if (stop) return finish(r, c, "stop");
  if (c.generated >= r.opts.max_tokens) return finish(r, c, "length");
  c.tokens.push_back(token);
  // The new token needs a KV row at position tokens.size() - 1.
  if (int64_t(c.tokens.size()) > max_context_) return finish(r, c, "context");
}

void EngineCore::step() {
  const auto now = Clock::now();
  for (auto& r : requests_) {
    const bool cancel = r->stream->cancel_requested();
    const bool timeout = r->opts.timeout_seconds > 0 && seconds_between(r->submitted, now) > r->opts.timeout_seconds;
    if (cancel || timeout)
      for (auto& c : r->choices) finish(*r, *c, cancel ? "cancelled" : "timeout");
  }
  requests_.remove_if([](const std::unique_ptr<Request>& r) { return r->open == 0; });
  if (requests_.empty()) return;

  const std::vector<ScheduledChunk> chunks = scheduler_->schedule();
  if (chunks.empty()) return;
  std::vector<bool> all_rows(chunks.size());
  std::vector<Request*> owner(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    Choice* c = static_cast<Choice*>(chunks[i].seq);
    owner[i] = c->request;
    all_rows[i] = owner[i]->opts.want_prompt_logits && c->index == 0 && chunks[i].begin < c->n_prompt;
    if (!owner[i]->scheduled) {
      owner[i]->scheduled = true;
      owner[i]->usage.queue_seconds = seconds_between(owner[i]->submitted, now);
    }
  }
  // A step whose every pick needs the row alone (no logit adjustments, no logprobs, no prompt
  // logits) picks where the logits are (a GPU: 4 bytes a row cross to the host instead of 1 MB),
  // each sampler's draw taken here as its sample() would take it.
  bool pick = true;
  for (size_t i = 0; i < chunks.size() && pick; ++i) {
    const Choice& c = *static_cast<const Choice*>(chunks[i].seq);
    const Request& r = *owner[i];
    pick = !all_rows[i] &&
           (c.done || !chunks[i].samples || (!r.adjust.any() && !r.opts.logprobs && r.opts.top_logprobs == 0));
  }
  picks_.assign(pick ? chunks.size() : 0, TokenPick{});
  for (size_t i = 0; i < picks_.size(); ++i) {
    Choice& c = *static_cast<Choice*>(chunks[i].seq);
    if (!c.done && chunks[i].samples && owner[i]->opts.max_tokens > 0) picks_[i] = c.sampler->pick();
  }
  runner_->run(chunks, all_rows, out_, pick, picks_);
  scheduler_->computed(chunks);
  const size_t V = size_t(model_->config().vocab_size);
  // Picking the next tokens is independent per sequence and, at temperature > 0 over a 262k
  // vocabulary, costs about as much as a small forward pass: it runs on the pool, one sequence a
  // task; what touches streams and metrics runs after, in order.
  struct Pick {
    bool finite = true, sample = false;
    GeneratedToken token;
  };
  std::vector<Pick> picks(chunks.size());
  ThreadPool::global().parallel_for(int64_t(chunks.size()), 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> adjusted;
    for (int64_t i = b; i < e; ++i) {
      const ScheduledChunk& ch = chunks[size_t(i)];
      Choice& c = *static_cast<Choice*>(ch.seq);
      Pick& pk = picks[size_t(i)];
      if (c.done || out_.n_rows[size_t(i)] == 0) continue;
      if (pick) {  // the model's pick, -1 for a non-finite row
        const int32_t id = out_.ids[size_t(out_.first_row[size_t(i)] + out_.n_rows[size_t(i)] - 1)];
        pk.finite = id >= 0;
        pk.sample = pk.finite && ch.samples && owner[size_t(i)]->opts.max_tokens > 0;
        if (pk.sample) pk.token.token = id;
        continue;
      }
      const float* rows = out_.logits.data() + size_t(out_.first_row[size_t(i)]) * V;
      pk.finite = all_finite(rows, size_t(out_.n_rows[size_t(i)]) * V);
      pk.sample = pk.finite && ch.samples && owner[size_t(i)]->opts.max_tokens > 0;
      if (!pk.sample) continue;
      const Request& r = *owner[size_t(i)];
      const std::span<const float> raw(out_.logits.data() + size_t(out_.first_row[size_t(i)] + out_.n_rows[size_t(i)] - 1) * V, V);
      std::span<const float> logits = raw;
      if (r.adjust.any()) {
        adjusted.assign(raw.begin(), raw.end());
        c.history.adjust(adjusted, r.adjust);
        logits = adjusted;
      }
      pk.token.token = c.sampler->sample(logits);
      if (r.opts.logprobs || r.opts.top_logprobs > 0) {
        const Logprobs lp = logprobs(raw, pk.token.token, r.opts.top_logprobs);
        pk.token.logprob = lp.chosen;
        for (const auto& [id, p] : lp.top) pk.token.top.push_back({id, p});
      }
    }
  });
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ScheduledChunk& ch = chunks[i];
    Choice& c = *static_cast<Choice*>(ch.seq);
    Request& r = *owner[i];
    if (c.done) continue;
    if (!picks[i].finite) {  // a NaN would otherwise pass for a token
      finish(r, c, "error", "the model produced a non-finite logit");
      continue;
    }
    if (all_rows[i]) {  // rows already taken before a preemption are not taken twice
      const float* rows = out_.logits.data() + size_t(out_.first_row[i]) * V;
      const int64_t from = std::max(ch.begin, r.prompt_rows), to = std::min(ch.begin + ch.count, c.n_prompt);
      if (to > from) {
        r.prompt_logits.insert(r.prompt_logits.end(), rows + size_t(from - ch.begin) * V,
                               rows + size_t(to - ch.begin) * V);
        r.prompt_rows = to;
      }
      if (ch.begin + ch.count >= c.n_prompt && !r.prompt_logits_sent) {
        r.prompt_logits_sent = true;
        StreamEvent e;
        e.prompt_logits = std::move(r.prompt_logits);
        r.stream->push(std::move(e));
      }
    }
    if (!ch.samples) continue;
    if (r.opts.max_tokens == 0) {
      finish(r, c, "length");
      continue;
    }
    emit(r, c, std::move(picks[i].token));
  }
  requests_.remove_if([](const std::unique_ptr<Request>& r) { return r->open == 0; });
  recent_.push_back({Clock::now(), m_.generated_tokens_total});
  while (recent_.size() > 2 && seconds_between(recent_.front().first, recent_.back().first) > 10) recent_.pop_front();
}

void EngineCore::finish_all(const std::string& reason, const std::string& error) {
  for (auto& r : requests_)
    for (auto& c : r->choices) finish(*r, *c, reason, error);
  requests_.clear();
}

EngineMetrics EngineCore::metrics() const {
  EngineMetrics m = m_;
  // Tokens generated over the last ~10 s (0 once idle that long).
  const auto now = Clock::now();
  for (const auto& [t, total] : recent_)
    if (seconds_between(t, now) <= 10) {
      const double span = std::max(seconds_between(t, now), 1e-3);
      m.tokens_per_second = t == recent_.back().first ? 0 : double(m_.generated_tokens_total - total) / span;
      break;
    }
  m.waiting = scheduler_->waiting();
  m.running = scheduler_->running();
  m.preempted_total = scheduler_->preempted_total();
  m.pages_total = pages_->pages_total();
  m.pages_used = pages_->pages_used();
  m.pages_cached = pages_->pages_cached();
  m.kv_bytes = int64_t(pages_->bytes());
  m.prefix_query_tokens = scheduler_->prefix_query_tokens();
  m.prefix_hit_tokens = scheduler_->prefix_hit_tokens();
  return m;
}

}  // namespace mb
