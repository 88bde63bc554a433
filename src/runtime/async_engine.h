// The serving runtime as its clients see it (the HTTP server, `markbase chat`, `generate` through
// markbase::Engine): requests go in from any thread and come out as streams of events, while one
// engine thread runs the scheduler's steps (runtime/engine_core.h) over every running request.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "models/media_encoder.h"
#include "runtime/request.h"

namespace mb {

class EngineCore;
class TextCodec;
struct ModelConfig;

struct EngineOptions {
  std::string model_path;
  std::string mmproj_path;  // a GGUF model's vision/audio towers (llama.cpp's mmproj GGUF); "" none
  int image_tokens = 0;     // an image's soft-token budget (70 ... 1120); 0: the model's processor's
  bool exact_media = false;  // markbase::EngineOptions::exact_media
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;             // 0: all cores
  int64_t max_context = 0;     // tokens per sequence, prompt included; 0: the model's maximum
  int max_seqs = 16;           // sequences in the running batch at once
  size_t kv_bytes = 0;         // KV page memory; 0: enough for max_seqs full contexts, capped
  int64_t page_tokens = 0;     // tokens per KV page; 0: the default
  int64_t step_tokens = 0;     // token budget of one step (chunked prefill); 0: the default
  size_t max_queue = 256;      // waiting requests beyond this are refused (QueueFullError)
  bool prefix_cache = true;
  // Write the whole KV pool once at start, so its memory is taken then (as a server should: it
  // fails at start, not under load, and its resident size stays flat); otherwise pages cost
  // memory only once used.
  bool resident_kv = false;
  // Time every backend op (ProfilingBackend: device times on a GPU); op_profile() reads the table.
  bool profile_ops = false;
};

// Thrown by submit() when the waiting queue is full; the server answers 429.
struct QueueFullError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One request's events, in order. Filled by the engine thread, drained by the client.
class RequestStream {
 public:
  // The next event; nullopt when `timeout` passed first or the stream has ended (see done()).
  std::optional<StreamEvent> next(std::chrono::milliseconds timeout);
  // Stops the request at the next step and frees its KV pages; a final event with finish
  // reason "cancelled" follows for each choice still running.
  void cancel();
  // Every choice has finished and every event was taken.
  bool done() const;
  const std::string& id() const { return id_; }
  // Complete once done(); before that, what is known so far.
  RequestUsage usage() const;

  // Engine side.
  RequestStream(std::string id, int choices) : id_(std::move(id)), open_choices_(choices) {}
  void push(StreamEvent e);
  void set_usage(const RequestUsage& u);
  bool cancel_requested() const;

 private:
  std::string id_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamEvent> events_;
  RequestUsage usage_;
  int open_choices_;  // choices without their final event yet
  bool cancelled_ = false;
};

class AsyncEngine {
 public:
  // Loads the model and starts the engine thread. Throws mb::Error with the reason on failure.
  explicit AsyncEngine(const EngineOptions& opts);
  ~AsyncEngine();  // cancels what is still running, then joins the engine thread
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  // Queues a request whose prompt is `prompt` (used as given: BOS already included where the
  // model wants one). Validates everything first: mb::Error (bad ids, bad sampling values, a
  // prompt that cannot fit the context) or QueueFullError; nothing is queued then.
  // `media` fill the placeholders of a chat template's rendering (PromptMedia::place), encoded here
  // between two steps.
  std::shared_ptr<RequestStream> submit(std::vector<int32_t> prompt, const GenerationOptions& opts,
                                        std::string request_id = "", std::vector<MediaItem> media = {});

  // Stop admitting; with `drain`, wait for what is queued and running to finish, else cancel it.
  void shutdown(bool drain);

  const TextCodec* text() const;  // nullptr when the model has no tokenizer
  const ModelConfig& config() const;
  int64_t max_context() const;
  std::string model_name() const;  // the checkpoint's folder or file name
  EngineMetrics metrics() const;
  // EngineCore::op_profile, between steps.
  std::string op_profile();

 private:
  void loop();

  std::unique_ptr<EngineCore> core_;
  // Held by the engine thread around a step, and by submit() while it encodes media: the encoders
  // run on the engine's backend, never beside a step.
  std::mutex step_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<RequestStream>, PendingRequest>> inbox_;
  bool stopping_ = false, drain_ = false;
  EngineMetrics metrics_;  // as of the last step
  std::thread thread_;
};

}  // namespace mb
