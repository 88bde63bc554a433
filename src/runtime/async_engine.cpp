#include "runtime/async_engine.h"

#include <atomic>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "runtime/engine_core.h"

namespace mb {

std::optional<StreamEvent> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty() || open_choices_ == 0; });
  if (events_.empty()) return std::nullopt;
  StreamEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void RequestStream::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
}

bool RequestStream::cancel_requested() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_;
}

bool RequestStream::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_choices_ == 0 && events_.empty();
}

RequestUsage RequestStream::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

void RequestStream::push(StreamEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!e.finish_reason.empty() && open_choices_ > 0) --open_choices_;
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

void RequestStream::set_usage(const RequestUsage& u) {
  std::lock_guard<std::mutex> lock(mu_);
  usage_ = u;
}

namespace {
std::atomic<uint64_t> g_request_counter{0};
}

AsyncEngine::AsyncEngine(const EngineOptions& opts) : core_(std::make_unique<EngineCore>(opts)) {
  metrics_ = core_->metrics();
  thread_ = std::thread([this] { loop(); });
}

AsyncEngine::~AsyncEngine() {
  shutdown(/*drain=*/false);
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<RequestStream> AsyncEngine::submit(std::vector<int32_t> prompt, const GenerationOptions& opts,
                                                   std::string request_id, std::vector<MediaItem> media) {
  std::vector<MediaSpan> spans;
  if (!media.empty()) {
    std::lock_guard<std::mutex> lock(step_mu_);
    PromptMedia::Tokenize tokenize;
    if (core_->text()) tokenize = [this](const std::string& s) { return core_->text()->encode(s, /*add_bos=*/false); };
    spans = core_->media().place(prompt, media, core_->config().bos_id, /*rendered=*/true, tokenize);
  }
  core_->validate(prompt, opts, spans);  // reads only what loading fixed: safe beside the engine thread
  if (request_id.empty()) request_id = fmt::format("req-{}", ++g_request_counter);
  auto stream = std::make_shared<RequestStream>(std::move(request_id), opts.n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    MB_CHECK(!stopping_, "the server is shutting down");
    if (inbox_.size() + size_t(std::max<int64_t>(0, metrics_.waiting)) >= core_->options().max_queue)
      throw QueueFullError(fmt::format("the queue is full ({} requests waiting)", core_->options().max_queue));
    inbox_.push_back({stream, PendingRequest{std::move(prompt), opts, std::move(spans)}});
  }
  cv_.notify_all();
  return stream;
}

void AsyncEngine::shutdown(bool drain) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !drain) drain_ = false;
    if (!stopping_) drain_ = drain;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void AsyncEngine::loop() {
  for (;;) {
    std::deque<std::pair<std::shared_ptr<RequestStream>, PendingRequest>> incoming;
    bool stop = false, drain = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!core_->has_work() && inbox_.empty() && !stopping_)
        cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return !inbox_.empty() || stopping_; });
      incoming.swap(inbox_);
      stop = stopping_;
      drain = drain_;
    }
    for (auto& [stream, req] : incoming) {
      if (stop && !drain) {
        StreamEvent e;
        e.finish_reason = "cancelled";
        for (int i = 0; i < req.opts.n; ++i) {
          e.index = i;
          stream->push(e);
        }
        continue;
      }
      core_->add(stream, std::move(req));
    }
    if (stop && !drain) core_->finish_all("cancelled");
    try {
      std::lock_guard<std::mutex> lock(step_mu_);
      core_->step();
    } catch (const std::exception& e) {
      // A failure inside a step ends what was running with the reason; the engine carries on.
      core_->finish_all("error", e.what());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      metrics_ = core_->metrics();
      if (stopping_ && !core_->has_work() && inbox_.empty()) return;
    }
  }
}

const TextCodec* AsyncEngine::text() const { return core_->text(); }

std::string AsyncEngine::op_profile() {
  std::lock_guard<std::mutex> lock(step_mu_);
  return core_->op_profile();
}
const ModelConfig& AsyncEngine::config() const { return core_->config(); }
int64_t AsyncEngine::max_context() const { return core_->max_context(); }

std::string AsyncEngine::model_name() const {
  std::filesystem::path p(core_->options().model_path);
  if (!p.has_filename()) p = p.parent_path();
  return p.filename().string();
}

EngineMetrics AsyncEngine::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  return metrics_;
}

}  // namespace mb
