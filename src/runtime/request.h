// What a client asks of the runtime for one request and what it gets back.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mb {

// Per-request generation settings, with OpenAI/vLLM meanings. Defaults are "off" (greedy).
struct GenerationOptions {
  int max_tokens = 16;  // new tokens per choice (further limited by the context)
  int n = 1;            // independent choices; choice i samples with seed + i
  float temperature = 0.f;  // <= 0: greedy
  int top_k = 0;            // 0: off
  float top_p = 1.f;        // 1: off
  float min_p = 0.f;        // 0: off
  std::optional<uint64_t> seed;  // none: drawn at random (RequestUsage::seed reports it)
  // OpenAI: logit -= presence * [count > 0] + frequency * count, counts over generated tokens.
  float presence_penalty = 0.f, frequency_penalty = 0.f;
  // HF/vLLM: a logit of a token seen in the prompt or output is divided by it (> 0) or, when
  // negative, multiplied. 1: off.
  float repetition_penalty = 1.f;
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logit before anything else
  std::vector<std::string> stop;   // stop strings (matched across token boundaries, excluded)
  std::vector<int32_t> stop_ids;   // further ids that end a choice (kept out of the text)
  bool ignore_eos = false;         // do not stop at the model's end-of-turn ids
  bool logprobs = false;           // report the chosen token's log-probability
  int top_logprobs = 0;            // and this many most likely alternatives (0..20)
  bool skip_special_tokens = false;  // leave special tokens (<|tool_call> ...) out of the text
  double timeout_seconds = 0;      // > 0: finish with reason "timeout" after this long
  // Logits of every prompt position into StreamEvent::prompt_logits (markbase logits), computed
  // `prompt_chunk` tokens per step (0: as the scheduler chooses). With max_tokens 0, nothing else.
  bool want_prompt_logits = false;
  int64_t prompt_chunk = 0;
};

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.f;
};

struct GeneratedToken {
  int32_t token = -1;
  float logprob = 0.f;                 // when GenerationOptions::logprobs
  std::vector<TokenLogprob> top;       // top_logprobs alternatives, most likely first
};

// A piece of one choice's output. Events of a choice come in order; the last has finish_reason.
struct StreamEvent {
  int index = 0;                        // the choice, 0 .. n - 1
  std::vector<GeneratedToken> tokens;   // tokens produced since the previous event of this choice
  std::string text;                     // the text they released (may be empty; see Engine)
  // "stop" (end-of-turn id or stop string), "length" (max_tokens), "context" (context full),
  // "cancelled", "timeout", "error" (then `error` says why). Empty while the choice runs.
  std::string finish_reason;
  std::string error;
  std::vector<float> prompt_logits;     // [n_prompt, vocab] once, when want_prompt_logits
};

struct RequestUsage {
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;     // prompt tokens whose KV came from the prefix cache
  int64_t completion_tokens = 0;        // over all choices
  uint64_t seed = 0;                    // the seed of choice 0
  double queue_seconds = 0;             // submit -> first scheduled
  double ttft_seconds = 0;              // submit -> first token
  double total_seconds = 0;             // submit -> last choice finished
  int preemptions = 0;
};

// An image's or an audio clip's soft tokens in a prompt: they replace the embeddings of prompt
// positions [pos, pos + count) (its placeholder run). `hash` identifies the media's content: the
// prefix cache keys those positions by it, so the same image in the same place reuses its KV.
struct MediaSpan {
  int64_t pos = 0, count = 0;
  std::shared_ptr<const std::vector<float>> embeddings;  // [count, hidden]
  uint64_t hash = 0;
  bool image = false;  // an image (which models with bidirectional image attention see whole)
};

// A request as the engine thread receives it.
struct PendingRequest {
  std::vector<int32_t> prompt;
  GenerationOptions opts;
  std::vector<MediaSpan> media = {};  // in prompt order, not overlapping
};

// Latency histogram: counts[i] = observations in (bounds[i - 1], bounds[i]], the last bucket
// above every bound (Prometheus' cumulative buckets are their running sums).
struct Histogram {
  static constexpr std::array<double, 12> kBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                     0.5,   1.0,  2.5,   5.0,  10.0, 30.0};
  std::array<uint64_t, kBounds.size() + 1> counts{};
  double sum = 0;
  uint64_t total = 0;
  void observe(double seconds);
};

struct EngineMetrics {
  int64_t waiting = 0, running = 0;     // requests' sequences now
  int64_t preempted_total = 0;          // preemptions since start
  int64_t pages_total = 0, pages_used = 0, pages_cached = 0;  // cached: free but holding reusable KV
  int64_t page_tokens = 0;
  int64_t kv_bytes = 0;                 // the page pools' memory
  int64_t prefix_query_tokens = 0, prefix_hit_tokens = 0;  // prompt tokens looked up / found
  int64_t prompt_tokens_total = 0, generated_tokens_total = 0;
  int64_t requests_finished = 0;
  double tokens_per_second = 0;         // generated tokens over the last few seconds
  Histogram ttft, itl;                  // time to first token, inter-token latency
};

}  // namespace mb
