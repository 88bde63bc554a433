// Gemma 3 / Gemma 4 tokenizer: a byte-fallback BPE that reproduces the Hugging Face `tokenizers`
// package token for token (checked against it by tests/test_tokenizer.cpp).
//
// Pipeline, as in HF: added tokens are cut out of the raw text first (leftmost-longest match,
// honouring special / normalized / lstrip / rstrip / single_word), the remaining text is
// normalized (Gemma: ' ' -> U+2581), pre-tokenized (Gemma: a Split on ' ' that never fires
// after that normalization, so a whole segment between added tokens, at most a line since
// "\n" is one, is one BPE word) and BPE-merged by merge rank, lowest first, leftmost on ties.
// The word is cut only where no merge can cross, which keeps the result exact (tokenizer.cpp).
//
// Invalid UTF-8 in the input of encode(): every ill-formed subsequence becomes U+FFFD, exactly
// as Python's `bytes.decode("utf-8", errors="replace")` does (one U+FFFD per maximal subpart),
// and the result is then tokenized like any other text. So encode(bytes) equals Python's
// `tok.encode(bytes.decode("utf-8", "replace"))`; raw bytes are not preserved by a round trip.
//
// Thread safety: a Tokenizer is immutable after construction; concurrent encode/decode calls
// are safe. Copies share the same tables.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace mb {

namespace tok_detail {
struct Impl;
}

// llama.cpp's tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  Undefined = 0,
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,
};

// Everything from_vocab() needs besides the three GGUF arrays. Defaults describe Gemma 3/4.
struct VocabOptions {
  // Only used when `merges` is empty: SentencePiece-style BPE, where the adjacent pair whose
  // concatenation has the highest score merges first (ties: leftmost), like llama.cpp's SPM.
  std::vector<float> scores;
  int32_t bos_id = -1;  // -1: look up "<bos>" / "<s>"
  int32_t eos_id = -1;  // -1: look up "<eos>" / "</s>"
  int32_t pad_id = -1;  // -1: look up "<pad>"
  int32_t unk_id = -1;  // -1: look up "<unk>"
  bool byte_fallback = true;
  std::string space_replacement = "\xE2\x96\x81";  // U+2581; empty: spaces stay spaces
};

class Tokenizer {
 public:
  // Loads a Hugging Face tokenizer.json (BPE model). Throws mb::Error on I/O or unsupported
  // configuration (an unknown normalizer, pre-tokenizer or decoder is refused, not ignored).
  static Tokenizer from_hf_json_file(const std::string& path);
  static Tokenizer from_hf_json_text(std::string_view json_text);
  static Tokenizer from_hf_json(const nlohmann::json& j);

  // Builds the tokenizer from GGUF metadata arrays: tokenizer.ggml.tokens (index = id),
  // tokenizer.ggml.merges ("left right", split at the first space after the first byte) and
  // tokenizer.ggml.token_type. Control and Unknown tokens become special added tokens,
  // UserDefined and Unused tokens non-special added tokens (HF lists Gemma's <unusedN>, the
  // "\n"/"\t"/"▁" runs and the HTML tags as added tokens), all matched whole before BPE.
  // token_types may be empty (then nothing is an added token).
  static Tokenizer from_vocab(std::vector<std::string> tokens, std::vector<std::string> merges,
                              std::vector<int32_t> token_types, const VocabOptions& options = {});

  // Never adds BOS. With parse_special == false, special added tokens written in the text are
  // tokenized as plain text (HF's `encode_special_tokens = True`); non-special added tokens
  // such as "\n\n" are still matched, as in HF.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;

  // HF `decode(ids, skip_special_tokens=...)`: ids outside the vocabulary are skipped; a run
  // of <0xXX> byte tokens that is not valid UTF-8 as a whole becomes one U+FFFD per byte.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // Raw vocabulary piece as HF's id_to_token gives it ("▁Hello", "<0x0A>"; a normalized added
  // token in normalized form); "" if out of range.
  std::string_view token_text(int32_t id) const;
  int32_t find_token(std::string_view piece) const;  // -1 if absent
  int32_t vocab_size() const;  // one past the largest id (model vocabulary plus added tokens)
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;
  int32_t unk_id() const;
  bool is_special(int32_t id) const;  // a special added token (<bos>, <|turn>, ...)
  bool is_added(int32_t id) const;    // any added token, special or not
  bool is_byte(int32_t id) const;     // a <0xXX> byte-fallback token
  // True when the json's post-processor prepends BOS (Gemma 3's does, Gemma 4's has none);
  // encode() itself never adds it, callers decide.
  bool post_processor_adds_bos() const;

 private:
  friend class StreamingDecoder;
  explicit Tokenizer(std::shared_ptr<const tok_detail::Impl> impl);
  std::shared_ptr<const tok_detail::Impl> impl_;
};

// Turns generated ids into text as they arrive. Output pieces are always complete UTF-8:
// byte-fallback tokens are held until they form a character. The concatenation of all push()
// results and flush() equals Tokenizer::decode() of the same ids whenever the byte tokens form
// valid UTF-8. For invalid byte runs it differs on purpose, so that output is never delayed:
// complete characters are emitted at once and only the invalid bytes become U+FFFD (one each),
// whereas decode() turns the whole run into U+FFFDs as HF does.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  std::string push(int32_t id);
  std::string flush();  // emits U+FFFD for each byte of an unfinished character; resets

 private:
  void drain(std::string& out, bool final);
  std::shared_ptr<const tok_detail::Impl> impl_;
  bool skip_special_;
  bool at_start_ = true;
  int strip_left_ = 0;   // leading characters a final Strip decoder step still removes
  std::string pending_;  // bytes from <0xXX> tokens not yet forming a whole character
};

}  // namespace mb
