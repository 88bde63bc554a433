// `markbase chat`: a multi-turn conversation in the terminal on the serving runtime. Each turn is
// the whole conversation rendered through the chat template again; the runtime's prefix cache
// finds the pages of the previous turns, so only the new text is prefilled.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <optional>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/flags.h"
#include "core/error.h"
#include "runtime/async_engine.h"
#include "runtime/text.h"
#include "server/openai.h"

namespace mb::cli {

namespace {

volatile sig_atomic_t g_interrupted = 0;

extern "C" void note_interrupt(int) { g_interrupted = 1; }

enum class LineStatus { Line, Interrupted, End };

// A line of stdin without its newline. Read with read(2) so that Ctrl-C (a handler installed
// without SA_RESTART) returns at once instead of waiting for Enter.
LineStatus read_line(std::string& line) {
  line.clear();
  for (;;) {
    char c = 0;
    const ssize_t n = read(0, &c, 1);
    if (n == 1) {
      if (c == '\n') return LineStatus::Line;
      line += c;
      continue;
    }
    if (n < 0 && errno == EINTR) {
      if (g_interrupted) return LineStatus::Interrupted;
      continue;
    }
    return line.empty() ? LineStatus::End : LineStatus::Line;  // the last line may lack its newline
  }
}

void out(std::string_view s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

void register_chat(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat", "talk with the model in the terminal (several turns; Ctrl-C stops a reply)");
  struct Args {
    std::string model, system, seed, kv_mem, device = "cpu";
    bool think = false;
    int n = 0, threads = 0;
    int64_t ctx = 0;
    float temperature = 0.f, top_p = 1.f, min_p = 0.f;
    int top_k = 0;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("-m,--model", a->model,
                  "checkpoint folder or .gguf file (default: $MARKBASE_MODEL, else Gemma 3 270M)");
  cmd->add_option("--system", a->system, "system prompt");
  cmd->add_flag("--think", a->think, "let the model think before it answers (shown apart, dimmed)");
  cmd->add_option("-n,--n-predict", a->n, "tokens per reply, at most (0: up to the context's end)")
      ->check(whole_number(0, INT_MAX));
  cmd->add_option("--temperature", a->temperature, "0 = greedy")->check(real_number(0, 1e4));
  cmd->add_option("--top-k", a->top_k, "0 = off")->check(whole_number(0, INT_MAX));
  cmd->add_option("--top-p", a->top_p, "1 = off")->check(real_number(0, 1, /*lo_open=*/true));
  cmd->add_option("--min-p", a->min_p, "0 = off")->check(real_number(0, 1));
  cmd->add_option("--seed", a->seed, "sampling seed (-1: random)")->type_name("INT")->check(seed_value());
  cmd->add_option("-c,--ctx", a->ctx, "context size in tokens, the whole conversation (0: the model's maximum)")
      ->check(whole_number(0));
  cmd->add_option("--kv-mem", a->kv_mem, "KV cache memory, such as 512M or 4G")->check(size_value());
  add_threads_option(cmd, a->threads);
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->callback([a] {
    if (const std::string w = threads_warning(a->threads); !w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
    mb::EngineOptions eo;
    eo.model_path = a->model.empty() ? default_model_path() : a->model;
    eo.device = a->device;
    eo.threads = a->threads;
    eo.max_context = a->ctx;
    eo.max_seqs = 1;
    if (!a->kv_mem.empty()) eo.kv_bytes = parse_size(a->kv_mem, "--kv-mem");
    eo.profile_ops = profile_ops_requested();
    mb::AsyncEngine engine(eo);
    const mb::TextCodec* text = engine.text();
    MB_CHECK(text && text->has_chat_template(), "chat: {} has no tokenizer or no chat template", eo.model_path);
    const bool markup = server::describe_model(text, "", 0, 0, 0).gemma4_markup;

    struct sigaction sa {};
    sa.sa_handler = note_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);  // no SA_RESTART: a read waiting for input returns
    const bool tty_in = isatty(0), tty_out = isatty(1);
    const std::string dim = tty_out ? "\x1b[2m" : "", plain = tty_out ? "\x1b[0m" : "";
    std::fprintf(stderr, "%s: context %lld tokens. Ctrl-C stops a reply; /reset starts over; /exit or Ctrl-D ends.\n",
                 engine.model_name().c_str(), (long long)engine.max_context());

    server::Json history = server::Json::array();
    if (!a->system.empty()) history.push_back({{"role", "system"}, {"content", a->system}});
    const size_t base = history.size();
    std::string line;
    for (;;) {
      if (tty_in) std::fputs("> ", stderr);
      g_interrupted = 0;
      const LineStatus status = read_line(line);
      if (status == LineStatus::End) break;
      if (status == LineStatus::Interrupted) {  // Ctrl-C at the prompt: a fresh prompt, not the end
        std::fputs("\n", stderr);
        continue;
      }
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        history.erase(history.begin() + std::ptrdiff_t(base), history.end());
        std::fputs("(a new conversation)\n", stderr);
        continue;
      }
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      history.push_back({{"role", "user"}, {"content", line}});
      mb::ChatTemplateInputs in;
      in.messages = history;
      in.add_generation_prompt = true;
      in.enable_thinking = a->think;
      const std::vector<int32_t> prompt = text->encode_chat(in);
      const int64_t room = engine.max_context() - int64_t(prompt.size());
      if (room <= 0) {
        std::fprintf(stderr, "the conversation (%zu tokens) fills the context: /reset starts over\n", prompt.size());
        history.erase(history.end() - 1);
        continue;
      }
      mb::GenerationOptions g;
      g.max_tokens = int(a->n > 0 ? std::min<int64_t>(a->n, room) : room);
      g.temperature = a->temperature;
      g.top_k = a->top_k;
      g.top_p = a->top_p;
      g.min_p = a->min_p;
      g.seed = parse_seed(a->seed);
      g.skip_special_tokens = !markup;  // the parser needs Gemma 4's markup; a reader does not
      auto stream = engine.submit(prompt, g);
      server::ChoiceOutput reply(markup);
      enum { None, Thinking, Answer } part = None;
      while (!stream->done()) {
        if (g_interrupted) stream->cancel();  // the reply ends at the next step; the program goes on
        std::optional<mb::StreamEvent> e = stream->next(std::chrono::milliseconds(50));
        if (!e) continue;
        reply.add(*e);
        const server::Json d = reply.chat_delta();
        if (d.contains("reasoning_content")) {
          if (part != Thinking) out(dim + (part == None ? "" : "\n") + (tty_out ? "" : "[thinking] "));
          part = Thinking;
          out(d["reasoning_content"].get<std::string>());
        }
        if (d.contains("content")) {
          if (part == Thinking) out(plain + "\n");
          part = Answer;
          out(d["content"].get<std::string>());
        }
        for (const auto& call : d.value("tool_calls", server::Json::array())) {
          if (part == Thinking) out(plain);
          out(fmt::format("\n[tool call] {}({})", call["function"]["name"].get<std::string>(),
                          call["function"]["arguments"].get<std::string>()));
          part = Answer;
        }
      }
      if (part == Thinking) out(plain);
      out("\n");
      const mb::RequestUsage u = stream->usage();
      const double gen_s = u.total_seconds - u.ttft_seconds;
      std::fprintf(stderr, "(%lld tokens%s | prompt %lld tokens, %lld cached, first token in %.2f s | %s)\n",
                   (long long)u.completion_tokens,
                   gen_s > 0 && u.completion_tokens > 1
                       ? fmt::format(", {:.1f} tok/s", double(u.completion_tokens - 1) / gen_s).c_str()
                       : "",
                   (long long)u.prompt_tokens, (long long)u.cached_prompt_tokens, u.ttft_seconds,
                   reply.finish_reason() == "cancelled" ? "stopped" : reply.finish_reason().c_str());
      server::Json message = reply.message();
      if (message["content"].is_null()) message["content"] = "";
      message.erase("reasoning_content");  // the templates leave earlier turns' thinking out anyway
      history.push_back(message);
    }
    print_op_profile(engine.op_profile());
  });
}

}  // namespace mb::cli
