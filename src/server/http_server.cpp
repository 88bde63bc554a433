// The one file that includes cpp-httplib (src/CMakeLists.txt keeps its flags here). Requests are
// served by a pool of threads, one connection each; a generation request submits to the engine
// and then waits on its RequestStream, writing SSE chunks as events arrive.
#include "server/http_server.h"

#include <atomic>
#include <chrono>
#include <mutex>

#include <fmt/format.h>
#include <httplib.h>

#include "core/error.h"
#include "models/model_config.h"
#include "runtime/async_engine.h"
#include "runtime/text.h"
#include "server/openai.h"

namespace mb::server {

extern const char* const kChatPageHtml;  // generated from chat_page.html (src/CMakeLists.txt)

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// How long a stream may stay silent (a long prefill, a queue) before a keep-alive comment goes
// out; writing is also how a client that went away is noticed, so this bounds how long its
// request runs on after it left.
constexpr auto kKeepAlive = 500ms;
constexpr auto kPoll = 100ms;

// What the request log line says past the method, path and status; the handler fills it and the
// logger, which httplib calls on the same thread once the response is written, prints it.
thread_local std::string t_log_detail;
thread_local std::chrono::steady_clock::time_point t_request_start;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void send_json(httplib::Response& res, int status, const Json& j) {
  res.status = status;
  res.set_content(j.dump(-1, ' ', false, Json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, e.body());
  if (e.status == 429) res.set_header("Retry-After", "1");
  if (e.status == 401) res.set_header("WWW-Authenticate", "Bearer");
  t_log_detail = e.what();
}

std::string sse(const Json& j) {
  return "data: " + j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

std::string usage_detail(const RequestUsage& u, const std::string& finish) {
  const double gen_s = u.total_seconds - u.ttft_seconds;
  std::string rate;
  if (gen_s > 0 && u.completion_tokens > 1)
    rate = fmt::format(" ({:.1f} tok/s)", double(u.completion_tokens - 1) / gen_s);
  return fmt::format("prompt={} cached={} completion={} queue={:.3f}s ttft={:.3f}s total={:.3f}s{} finish={}",
                     u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens, u.queue_seconds, u.ttft_seconds,
                     u.total_seconds, rate, finish);
}

// The constant-time comparison API keys want.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= uint8_t(a[i]) ^ uint8_t(i < b.size() ? b[i] : 0);
  return diff == 0;
}

// One generation request as its handler and, for a stream, the content provider share it.
struct Generation {
  ParsedRequest req;
  std::string id;
  int64_t created = 0;
  std::shared_ptr<RequestStream> stream;
  std::vector<ChoiceOutput> choices;
  bool client_gone = false;

  void add(const StreamEvent& e) {
    if (e.index >= 0 && size_t(e.index) < choices.size()) choices[size_t(e.index)].add(e);
  }
  std::string finish_summary() const {
    std::string out;
    for (const ChoiceOutput& c : choices) {
      if (!out.empty()) out += ',';
      out += client_gone && c.engine_finish_reason().empty() ? "cancelled" : c.engine_finish_reason();
    }
    return out;
  }
  const char* object() const { return req.endpoint == Endpoint::Chat ? "chat.completion" : "text_completion"; }
};

}  // namespace

struct HttpServer::Impl {
  AsyncEngine& engine;
  ServerOptions opts;
  ModelInfo model;
  httplib::Server http;
  int port = 0;
  int64_t created = unix_time();
  std::atomic<bool> stopping{false};
  std::mutex stop_mu;
  bool stop_sent = false;  // httplib's stop() may run once per listen (it asserts on a second call)

  Impl(AsyncEngine& e, ServerOptions o) : engine(e), opts(std::move(o)) {
    const std::string name = opts.served_model_name.empty() ? engine.model_name() : opts.served_model_name;
    model = describe_model(engine.text(), name, engine.max_context(), int32_t(engine.config().vocab_size),
                           opts.default_timeout_seconds);
    model.allowed_media_dir = opts.allowed_media_dir;
    setup();
  }

  void log(const std::string& line) const {
    if (opts.log) opts.log(line);
  }

  // Runs a handler, turning its ApiError (or anything else) into OpenAI's error shape.
  template <class F>
  httplib::Server::Handler guarded(F f) {
    return [this, f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, fmt::format("internal error: {}", e.what())));
      }
    };
  }

  void setup() {
    const size_t threads = opts.http_threads > 0 ? opts.http_threads : 64;
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    http.set_payload_max_length(opts.max_body_bytes);
    http.set_tcp_nodelay(true);  // stream chunks leave at once, not after Nagle's delay
    http.set_keep_alive_timeout(2);

    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      t_log_detail.clear();
      t_request_start = Clock::now();
      if (opts.api_key.empty() || req.path == "/" || req.path == "/health" || req.path == "/metrics")
        return httplib::Server::HandlerResponse::Unhandled;
      std::string key = req.get_header_value("Authorization");
      if (key.rfind("Bearer ", 0) == 0) key = key.substr(7);
      else key = req.get_header_value("x-api-key");
      if (same_secret(key, opts.api_key)) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, ApiError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'", "",
                               "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    });
    // Statuses httplib sets itself (404 for an unknown path, 413, 400 for a request it cannot
    // read) get a body in the same shape as every other error.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string message = fmt::format("HTTP {}", res.status);
      if (res.status == 404) message = fmt::format("no route for {} {}", req.method, req.path);
      if (res.status == 413) message = "the request body is too large";
      if (res.status == 400) message = "the request could not be read";
      send_error(res, ApiError(res.status, message));
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown exception";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, ApiError(500, fmt::format("internal error: {}", what)));
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      log(fmt::format("{} {} {} {:.3f}s{}{}", req.method, req.path, res.status, seconds_since(t_request_start),
                      t_log_detail.empty() ? "" : " ", t_log_detail));
      t_log_detail.clear();
    });

    http.Get("/", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(kChatPageHtml, "text/html; charset=utf-8");
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (stopping) send_json(res, 503, Json{{"status", "stopping"}});
      else send_json(res, 200, Json{{"status", "ok"}});
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(prometheus_text(engine.metrics(), model.name), "text/plain; version=0.0.4; charset=utf-8");
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      send_json(res, 200, model_list(model, created));
    });
    http.Get(R"(/v1/models/(.+))", guarded([this](const httplib::Request& req, httplib::Response& res) {
      if (req.matches[1] != model.name)
        throw ApiError(404, fmt::format("The model '{}' does not exist", std::string(req.matches[1])), "model",
                       "model_not_found");
      send_json(res, 200, model_list(model, created)["data"][0]);
    }));
    http.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
      send_json(res, 200, tokenize(parse_body(req.body), model));
    }));
    http.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
      send_json(res, 200, detokenize(parse_body(req.body), model));
    }));
    http.Post("/v1/chat/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
      generate(parse_chat_request(parse_body(req.body), model), res);
    }));
    http.Post("/v1/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
      generate(parse_completion_request(parse_body(req.body), model), res);
    }));
  }

  void generate(ParsedRequest parsed, httplib::Response& res) {
    if (stopping) throw ApiError(503, "the server is shutting down");
    auto g = std::make_shared<Generation>();
    g->req = std::move(parsed);
    g->id = new_id(g->req.endpoint == Endpoint::Chat ? "chatcmpl-" : "cmpl-");
    g->created = unix_time();
    for (int i = 0; i < g->req.gen.n; ++i) g->choices.emplace_back(g->req.parse_markup);
    try {
      g->stream = engine.submit(g->req.prompt, g->req.gen, g->id, std::move(g->req.media));
    } catch (const QueueFullError& e) {
      throw ApiError(429, fmt::format("the server is busy: {}; retry later", e.what()), "", "queue_full");
    } catch (const Error& e) {
      // submit() checked the request against the model and refused it before queueing it.
      throw ApiError(400, e.what());
    }
    res.set_header("X-Request-Id", g->id);
    if (g->req.stream) {
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");  // nginx: pass chunks through as they come
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, g](size_t, httplib::DataSink& sink) {
            if (write_stream(*g, sink)) sink.done();
            t_log_detail = fmt::format("{} stream {}", g->id, usage_detail(g->stream->usage(), g->finish_summary()));
            return !g->client_gone;
          },
          [g](bool) {
            // However the response ended, a request still running has nobody to answer.
            if (!g->stream->done()) g->stream->cancel();
          });
      return;
    }
    while (!g->stream->done())
      if (auto e = g->stream->next(kPoll)) g->add(*e);
    t_log_detail = fmt::format("{} {}", g->id, usage_detail(g->stream->usage(), g->finish_summary()));
    for (const ChoiceOutput& c : g->choices)
      if (c.engine_finish_reason() == "error") throw ApiError(500, "generation failed: " + c.error());
    Json choices = Json::array();
    for (ChoiceOutput& c : g->choices) {
      Json ch = {{"index", choices.size()}};
      if (g->req.endpoint == Endpoint::Chat) {
        ch["message"] = c.message();
        ch["logprobs"] = g->req.gen.logprobs ? c.chat_logprobs(model.text, false) : Json(nullptr);
      } else {
        ch["text"] = g->req.echo + c.text();
        ch["logprobs"] = g->req.completion_logprobs >= 0 ? c.completion_logprobs(model.text, false, 0) : Json(nullptr);
      }
      ch["finish_reason"] = c.finish_reason();
      choices.push_back(ch);
    }
    send_json(res, 200,
              Json{{"id", g->id}, {"object", g->object()}, {"created", g->created}, {"model", model.name},
                   {"choices", choices}, {"usage", usage_json(g->stream->usage())}});
  }

  Json chunk(const Generation& g, Json choices) const {
    Json j = {{"id", g.id},
              {"object", g.req.endpoint == Endpoint::Chat ? "chat.completion.chunk" : "text_completion"},
              {"created", g.created},
              {"model", model.name},
              {"choices", std::move(choices)}};
    if (g.req.include_usage) j["usage"] = nullptr;
    return j;
  }

  // The chunks one event releases for its choice (none when it released nothing visible).
  std::string event_chunks(Generation& g, const StreamEvent& e) {
    ChoiceOutput& c = g.choices[size_t(e.index)];
    const bool chat = g.req.endpoint == Endpoint::Chat;
    std::string out;
    if (c.finished() && c.engine_finish_reason() == "error")
      out += sse(ApiError(500, "generation failed: " + c.error()).body());
    Json choice = {{"index", e.index}};
    bool any = false;
    if (chat) {
      Json delta = c.chat_delta();
      any = !delta.empty();
      choice["delta"] = delta;
      if (g.req.gen.logprobs) {
        Json lp = c.chat_logprobs(model.text, true);
        any = any || !lp["content"].empty();
        choice["logprobs"] = lp;
      } else {
        choice["logprobs"] = nullptr;
      }
    } else {
      choice["text"] = e.text;
      any = !e.text.empty();
      choice["logprobs"] =
          g.req.completion_logprobs >= 0 ? c.completion_logprobs(model.text, true, g.req.echo.size()) : Json(nullptr);
      any = any || !e.tokens.empty();
    }
    choice["finish_reason"] = nullptr;
    if (any) out += sse(chunk(g, Json::array({choice})));
    if (c.finished()) {
      Json last = {{"index", e.index}};
      if (chat) last["delta"] = Json::object();
      else last["text"] = "";
      last["logprobs"] = nullptr;
      last["finish_reason"] = c.finish_reason();
      out += sse(chunk(g, Json::array({last})));
    }
    return out;
  }

  // Writes the whole SSE stream; false when the client went away (the request is then cancelled).
  bool write_stream(Generation& g, httplib::DataSink& sink) {
    auto write = [&](const std::string& s) {
      if (g.client_gone) return false;
      if (!sink.write(s.data(), s.size())) {
        g.client_gone = true;
        g.stream->cancel();
      }
      return !g.client_gone;
    };
    // Each choice opens with its role (chat) or the echoed prompt (completions), as OpenAI does;
    // the headers leave with it, so a client knows at once that the request was accepted.
    std::string opening;
    for (size_t i = 0; i < g.choices.size(); ++i) {
      Json choice = {{"index", i}};
      if (g.req.endpoint == Endpoint::Chat) choice["delta"] = {{"role", "assistant"}, {"content", ""}};
      else if (!g.req.echo.empty()) choice["text"] = g.req.echo;
      else continue;
      choice["logprobs"] = nullptr;
      choice["finish_reason"] = nullptr;
      opening += sse(chunk(g, Json::array({choice})));
    }
    if (!opening.empty() && !write(opening)) return false;
    auto last_write = Clock::now();
    while (!g.stream->done()) {
      std::optional<StreamEvent> e = g.stream->next(kPoll);
      if (!e) {
        if (Clock::now() - last_write >= kKeepAlive) {
          if (!write(": keep-alive\n\n")) return false;
          last_write = Clock::now();
        }
        continue;
      }
      if (e->index < 0 || size_t(e->index) >= g.choices.size()) continue;
      g.add(*e);
      std::string out = event_chunks(g, *e);
      if (!out.empty()) {
        if (!write(out)) return false;
        last_write = Clock::now();
      }
    }
    std::string tail;
    if (g.req.include_usage) {
      Json last = chunk(g, Json::array());
      last["usage"] = usage_json(g.stream->usage());
      tail += sse(last);
    }
    tail += "data: [DONE]\n\n";
    return write(tail);
  }
};

HttpServer::HttpServer(AsyncEngine& engine, ServerOptions opts)
    : impl_(std::make_unique<Impl>(engine, std::move(opts))) {
  Impl& s = *impl_;
  if (s.opts.port == 0) {
    s.port = s.http.bind_to_any_port(s.opts.host);
    MB_CHECK(s.port > 0, "serve: cannot listen on {} (any port)", s.opts.host);
  } else {
    MB_CHECK(s.http.bind_to_port(s.opts.host, s.opts.port),
             "serve: cannot listen on {}:{} (in use, or not an address here?)", s.opts.host, s.opts.port);
    s.port = s.opts.port;
  }
}

HttpServer::~HttpServer() = default;

int HttpServer::port() const { return impl_->port; }

void HttpServer::run() {
  if (impl_->stopping) return;
  MB_CHECK(impl_->http.listen_after_bind() || impl_->stopping, "serve: listening on {}:{} failed", impl_->opts.host,
           impl_->port);
}

void HttpServer::stop() {
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  impl_->stopping = true;
  if (impl_->stop_sent || !impl_->http.is_running()) return;
  impl_->http.stop();
  impl_->stop_sent = true;
}

}  // namespace mb::server
