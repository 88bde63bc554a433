// MarkBase public C++ API.
//
//   auto engine = markbase::Engine::open({.model_path = "path/to/checkpoint"});
//   markbase::Request req{.prompt_tokens = {2, 818, 5279}, .max_new_tokens = 32};
//   markbase::Result r = engine->generate(req);
//
// Every failure (bad model files, bad parameters, full context) throws markbase::Error with a
// message that names the file, tensor or parameter at fault.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "markbase/error.h"

namespace markbase {

struct SamplingParams {
  float temperature = 0.f;  // <= 0: greedy
  int top_k = 0;            // 0: off
  float top_p = 1.f;        // 1: off
  float min_p = 0.f;        // 0: off
  std::optional<uint64_t> seed;  // none: a random seed, drawn per request (Result::seed reports it)
};

struct EngineOptions {
  std::string model_path;
  std::string mmproj_path = {};  // a GGUF model's vision/audio towers: llama.cpp's mmproj GGUF ("" none)
  int image_tokens = 0;  // soft tokens an image may become: 70, 140, 280, 560, 1120 (0: the model's processor's)
  // The media towers' bf16 matmuls f32-accurate on the CPU, instead of on activations rounded to bf16
  // (as transformers' bf16 modules and GPU GEMMs take them; ~2x faster where AMX runs them).
  bool exact_media = false;
  std::string device = "cpu";  // cpu | cuda
  std::string dtype = "auto";  // auto (checkpoint's own) | f32 | bf16 | f16
  int threads = 0;             // 0: all cores
  int64_t max_context = 0;     // tokens a sequence may hold, prompt included; 0: the model's maximum
  bool profile_ops = false;    // time every backend op (device times on a GPU): Engine::op_profile
};

// An image (PNG, JPEG, GIF, BMP, WebP), an audio clip (WAV, FLAC, OGG, MP3) or a video (a file libavformat
// reads: MP4, MKV, WebM, MOV, AVI...; or a folder of frame images, in name order) for the prompt.
struct Media {
  enum class Kind { Image, Audio, Video };
  Kind kind = Kind::Image;
  std::string path;                          // a file (or a video's folder of frames) to read, or
  std::vector<uint8_t> bytes;                // its contents (then `path` only names it in errors), or
  std::vector<std::vector<uint8_t>> frames;  // a video's frames as image files' contents
};

struct Request {
  std::vector<int32_t> prompt_tokens;  // used as given: no BOS is added
  std::string prompt;  // used when prompt_tokens is empty: tokenized with BOS, or as a chat turn
  bool chat = false;   // wrap `prompt` as one user turn in the model's chat template
  // Images, audio and video, in order: with chat they come before the text in the user turn; otherwise
  // the k-th image fills the k-th run of image placeholders in the prompt (a single placeholder is
  // expanded to the image's soft-token count; a video's to its frames with their timestamps), or they
  // go right after BOS when it has none.
  std::vector<Media> media;
  std::string system_prompt;  // with chat: a system turn before the user turn (empty: none)
  bool enable_thinking = false;
  int max_new_tokens = 16;
  SamplingParams sampling;
  bool stop_at_eos = true;  // stop at the model's end-of-sequence / end-of-turn tokens
  // Stop strings: generation ends as soon as the generated text contains one (across token
  // boundaries); Result::text then ends before it. Needs a tokenizer; each must be non-empty.
  std::vector<std::string> stop;
  // Called with each new token and the complete UTF-8 text it releases (may be empty while a
  // character is split across byte tokens or while the text could be the start of a stop string;
  // empty when the model has no tokenizer). The pieces add up to Result::text. A last call with
  // token -1 may deliver text still held back at the end. Return false to stop early.
  std::function<bool(int32_t token, std::string_view text)> on_token;
};

struct Result {
  std::vector<int32_t> prompt_ids;  // the prompt as the model saw it
  std::vector<int32_t> tokens;  // new tokens only
  std::string text;             // the new tokens decoded (stop token and stop string excluded)
  // "length" (max_new_tokens), "stop" (an end-of-sequence token or a stop string), "context" (the
  // context is full: a prompt of n tokens gets at most max_context - n + 1 new ones) or "cancelled".
  std::string finish_reason;
  uint64_t seed = 0;  // the sampling seed used: SamplingParams::seed, or the one drawn for it
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

struct ModelInfo {
  std::string path, architecture, model_type, family;
  int64_t vocab_size = 0, hidden_size = 0, n_layers = 0, max_context = 0;
  std::string weight_dtype;
  size_t weight_bytes = 0;
  std::string details;  // multi-line human-readable description of every layer
};

class Engine {
 public:
  static std::unique_ptr<Engine> open(const EngineOptions& opts);
  virtual ~Engine() = default;

  virtual Result generate(const Request& req) = 0;
  // Logits [n, vocab] for every prompt position, row-major. chunk = tokens per forward step
  // (0: the whole prompt at once; 1: one token at a time through the KV cache).
  // `media` fills the prompt's placeholder runs as Request::media does.
  virtual std::vector<float> prompt_logits(std::span<const int32_t> tokens, int chunk = 0,
                                           const std::vector<Media>& media = {}) = 0;
  virtual const ModelInfo& info() const = 0;
  // With EngineOptions::profile_ops: a table of every backend op since open (time, share, calls,
  // weight bytes a second); "" otherwise.
  virtual std::string op_profile() = 0;

  // Text helpers; throw markbase::Error when the model carries no tokenizer.
  virtual bool has_tokenizer() const = 0;
  virtual std::vector<int32_t> tokenize(std::string_view text, bool add_bos) const = 0;
  virtual std::string detokenize(std::span<const int32_t> ids) const = 0;
};

}  // namespace markbase
