// `markbase serve`: the OpenAI-compatible HTTP server over an AsyncEngine. The HTTP library stays
// inside http_server.cpp; this header is all its users see.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace mb {
class AsyncEngine;
}

namespace mb::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                 // 0: any free port (port() says which)
  std::string served_model_name;   // empty: the engine's model name
  std::string api_key;             // empty: no key needed
  size_t max_body_bytes = 16u << 20;  // larger request bodies get 413
  double default_timeout_seconds = 0;  // per request, for requests that give no "timeout"; 0: none
  std::string allowed_media_dir;       // clients' media files may lie under it; empty: none
  size_t http_threads = 0;         // connections served at once; 0: enough for the engine's queue
  // One line per request and the server's own messages; the library never prints (the command
  // line passes a function that writes to stderr).
  std::function<void(const std::string&)> log;
};

class HttpServer {
 public:
  // Binds the port (throws mb::Error when it cannot) but serves nothing until run().
  HttpServer(AsyncEngine& engine, ServerOptions opts);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // Serves until stop(); returns once every connection's request has been answered.
  void run();
  // From any thread: stop accepting connections; requests in flight go on (cancel them through
  // the engine to end them sooner). /health answers 503 from now on for load balancers. A call
  // that comes before run() has started listening may leave it listening: call again until
  // run() returns.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mb::server
