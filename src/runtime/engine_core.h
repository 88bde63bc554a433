// The serving engine's core, on one thread: it owns the model, the KV pages, the scheduler and
// the model runner, and turns each step's logits into tokens, text and events for the requests'
// streams. AsyncEngine runs it on its own thread; markbase::Engine (generate, logits) runs it on
// the caller's, so every path of the program goes through the same steps.
#pragma once
#include <chrono>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "runtime/async_engine.h"
#include "runtime/kv_pages.h"
#include "runtime/media.h"
#include "runtime/model_runner.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"
#include "runtime/text.h"

namespace mb {

class EngineCore {
 public:
  explicit EngineCore(const EngineOptions& opts);
  ~EngineCore();

  // Throws mb::Error when the request cannot run: bad ids or settings, a prompt the context
  // cannot hold, stop strings without a tokenizer.
  // Media spans must lie inside the prompt in order, each with count × hidden floats.
  void validate(const std::vector<int32_t>& prompt, const GenerationOptions& opts,
                const std::vector<MediaSpan>& media = {}) const;
  // Queues a validated request; its events go to `stream`.
  void add(std::shared_ptr<RequestStream> stream, PendingRequest req);
  bool has_work() const { return !requests_.empty(); }
  // One scheduler step: cancellations and timeouts, the forward pass, sampling, events.
  void step();
  // Ends every request with `reason` ("cancelled", or "error" with `error` saying why).
  void finish_all(const std::string& reason, const std::string& error = "");
  EngineMetrics metrics() const;
  // With EngineOptions::profile_ops, the ProfilingBackend's table of every backend op so far; else "".
  std::string op_profile();

  const TextCodec* text() const { return text_ ? &*text_ : nullptr; }
  const ModelConfig& config() const { return model_->config(); }
  const Model& model() const { return *model_; }
  int64_t max_context() const { return max_context_; }
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  const KVPageManager& pages() const { return *pages_; }
  const EngineOptions& options() const { return opts_; }
  // The model's image/audio front-ends on this engine's backend (made on first use). Call it
  // on the thread that runs step(): encoders use the backend.
  PromptMedia& media();

 private:
  struct Choice;
  struct Request;
  void finish(Request& r, Choice& c, const std::string& reason, const std::string& error = "");
  void emit(Request& r, Choice& c, GeneratedToken token);

  EngineOptions opts_;
  std::shared_ptr<Checkpoint> ck_;
  // EngineOptions::profile_ops: the device's backend, wrapped by a ProfilingBackend in backend_.
  std::unique_ptr<Backend> profiled_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  std::optional<TextCodec> text_;
  std::vector<int32_t> stop_ids_;
  int64_t max_context_ = 0;
  std::unique_ptr<KVPageManager> pages_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<PromptMedia> media_;
  std::list<std::unique_ptr<Request>> requests_;
  int64_t next_seq_id_ = 0;
  ModelRunner::Output out_;
  std::vector<TokenPick> picks_;  // a step's picks, per chunk (ModelRunner::run)

  // Metrics.
  EngineMetrics m_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> recent_;  // (end of step, tokens so far)
};

}  // namespace mb
