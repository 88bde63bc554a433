// `markbase serve`: the OpenAI-compatible server (src/server) on the serving runtime, with the
// process-level parts a library should not own: flags, signals and the log on stderr.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/flags.h"
#include "core/error.h"
#include "runtime/async_engine.h"
#include "server/http_server.h"

namespace mb::cli {

namespace {

// How long SIGINT/SIGTERM lets running requests finish before cancelling them (a second signal
// cancels at once).
constexpr auto kShutdownGrace = std::chrono::seconds(30);

void log_line(const std::string& line) {
  static std::mutex mu;
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%s %s\n", stamp, line.c_str());
  std::fflush(stderr);
}

// The signal that arrived within `wait`, 0 when none did.
int wait_signal(const sigset_t& set, std::chrono::milliseconds wait) {
  timespec ts{time_t(wait.count() / 1000), long(wait.count() % 1000) * 1000000L};
  const int s = sigtimedwait(&set, nullptr, &ts);
  return s > 0 ? s : 0;
}

}  // namespace

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "serve the model over an OpenAI-compatible HTTP API (docs/server.md)");
  struct Args {
    std::string model, mmproj, host = "127.0.0.1", name, api_key, kv_mem, device = "cpu";
    int port = 8080, max_seqs = 16, threads = 0, max_queue = 256;
    int64_t ctx = 0;
    int image_tokens = 0;
    bool exact_media = false;
    double timeout = 0;
    bool no_prefix_cache = false;
    std::string max_body = "16M";
    std::string allowed_media_dir;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("-m,--model", a->model,
                  "checkpoint folder or .gguf file (default: $MARKBASE_MODEL, else Gemma 3 270M)");
  add_media_model_options(cmd, a->mmproj, a->image_tokens, a->exact_media);
  cmd->add_option("--host", a->host, "address to listen on (0.0.0.0: every interface)");
  cmd->add_option("--port", a->port, "TCP port (0: any free one, printed at start)")->check(whole_number(0, 65535));
  cmd->add_option("--served-model-name", a->name, "the model's name in the API (default: its file or folder name)");
  cmd->add_option("--api-key", a->api_key,
                  "require 'Authorization: Bearer KEY' (default: $MARKBASE_API_KEY, else none)")
      ->envname("MARKBASE_API_KEY");
  cmd->add_option("--max-seqs", a->max_seqs, "sequences in the running batch at once")->check(whole_number(1, 4096));
  cmd->add_option("--max-queue", a->max_queue, "requests waiting beyond the batch; more are refused with 429")
      ->check(whole_number(1, 65536));
  cmd->add_option("-c,--ctx", a->ctx, "context size per sequence in tokens, prompt included (0: the model's maximum)")
      ->check(whole_number(0));
  cmd->add_option("--kv-mem", a->kv_mem, "KV cache memory, such as 512M or 4G (default: enough for --max-seqs full "
                                         "contexts, capped)")
      ->check(size_value());
  cmd->add_flag("--no-prefix-cache", a->no_prefix_cache,
                "compute every prompt from its first token (for comparisons; the cache changes no result)");
  add_threads_option(cmd, a->threads);
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--timeout", a->timeout, "seconds a request may run before it ends with finish_reason \"timeout\" "
                                           "(0: no limit; a request's own \"timeout\" field overrides it)")
      ->check(real_number(0, 1e7));
  cmd->add_option("--max-body", a->max_body, "largest request body; larger ones get 413")->check(size_value());
  cmd->add_option("--allowed-media-dir", a->allowed_media_dir,
                  "clients may name image/audio files under DIR (default: none; data: URLs always work, other "
                  "URLs are never fetched)")
      ->type_name("DIR")
      ->check(CLI::ExistingDirectory);
  cmd->callback([a] {
    if (const std::string w = threads_warning(a->threads); !w.empty()) log_line(w);
    // The engine's and the HTTP server's threads inherit this mask, so SIGINT and SIGTERM reach
    // only the sigtimedwait below and shutdown runs as ordinary code, not in a signal handler.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    signal(SIGPIPE, SIG_IGN);  // a client gone mid-response is a failed write, not the end of the process

    mb::EngineOptions eo;
    eo.model_path = a->model.empty() ? default_model_path() : a->model;
    eo.mmproj_path = a->mmproj;
    eo.image_tokens = a->image_tokens;
    eo.exact_media = a->exact_media;
    eo.device = a->device;
    eo.threads = a->threads;
    eo.max_context = a->ctx;
    eo.max_seqs = a->max_seqs;
    eo.max_queue = size_t(a->max_queue);
    if (!a->kv_mem.empty()) eo.kv_bytes = parse_size(a->kv_mem, "--kv-mem");
    eo.prefix_cache = !a->no_prefix_cache;
    eo.resident_kv = true;
    eo.profile_ops = profile_ops_requested();
    mb::AsyncEngine engine(eo);

    mb::server::ServerOptions so;
    so.host = a->host;
    so.port = a->port;
    so.served_model_name = a->name;
    so.api_key = a->api_key;
    so.max_body_bytes = parse_size(a->max_body, "--max-body");
    so.default_timeout_seconds = a->timeout;
    so.allowed_media_dir = a->allowed_media_dir;
    // A thread per connection: every request the engine may hold (running and queued) has one, so
    // a full queue is answered with 429 rather than left waiting for a thread.
    so.http_threads = size_t(a->max_seqs) + size_t(a->max_queue) + 16;
    so.log = log_line;
    mb::server::HttpServer server(engine, so);
    const mb::EngineMetrics m = engine.metrics();
    log_line(fmt::format("serving {} at http://{}:{} (context {} tokens, {} sequences at once, KV {} MiB in {} pages "
                         "of {} tokens{}{})",
                         eo.model_path, a->host, server.port(), engine.max_context(), a->max_seqs, m.kv_bytes >> 20,
                         m.pages_total, m.page_tokens, eo.prefix_cache ? "" : ", no prefix cache",
                         a->api_key.empty() ? "" : ", API key required"));

    std::atomic<bool> served{false};
    std::thread signals([&] {
      int s = 0;
      while (!served && !(s = wait_signal(stop_signals, std::chrono::milliseconds(100)))) {
      }
      if (served) return;
      log_line(fmt::format("{}: no new connections; finishing the requests in flight ({} s at most; again to cancel "
                           "them now)",
                           s == SIGINT ? "SIGINT" : "SIGTERM", kShutdownGrace.count()));
      server.stop();
      const auto deadline = std::chrono::steady_clock::now() + kShutdownGrace;
      while (!served) {
        server.stop();  // again, in case the signal came before the server was listening
        if (wait_signal(stop_signals, std::chrono::milliseconds(100)) || std::chrono::steady_clock::now() > deadline) {
          log_line("cancelling the requests in flight");
          engine.shutdown(/*drain=*/false);
          return;
        }
      }
    });
    server.run();
    served = true;
    signals.join();
    engine.shutdown(/*drain=*/false);
    print_op_profile(engine.op_profile());
    log_line("stopped");
  });
}

}  // namespace mb::cli
