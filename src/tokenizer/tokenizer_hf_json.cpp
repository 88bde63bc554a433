// tokenizer.json reader. nlohmann::json needs ~0.4 s to build a DOM of Gemma's 16 MB file,
// almost all of it for model.vocab (262k entries) and model.merges (515k pairs). Those two are
// read by a small scanner straight into string views over the file buffer; every other value
// is small and goes through nlohmann.
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_impl.h"

namespace mb {
namespace tok_detail {
namespace {

using nlohmann::json;

class Scanner {
 public:
  Scanner(std::string_view s, std::deque<std::string>& arena) : s_(s), arena_(arena) {}

  char peek() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
    return i_ < s_.size() ? s_[i_] : '\0';
  }
  void expect(char c) {
    if (peek() != c) error(fmt::format("expected '{}'", c));
    ++i_;
  }
  bool consume(char c) {
    if (peek() != c) return false;
    ++i_;
    return true;
  }

  // A view into the source when the string has no escapes, else into the arena.
  std::string_view string() {
    expect('"');
    const size_t b = i_;
    while (i_ < s_.size() && s_[i_] != '"' && s_[i_] != '\\') ++i_;
    if (i_ >= s_.size()) error("unterminated string");
    if (s_[i_] == '"') return s_.substr(b, i_++ - b);
    std::string out(s_.substr(b, i_ - b));
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) break;
      char e = s_[i_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.substr(i_, 2) == "\\u") {
            i_ += 2;
            uint32_t lo = hex4();
            cp = (lo >= 0xDC00 && lo < 0xE000) ? 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00) : 0xFFFD;
          } else if (cp >= 0xD800 && cp < 0xE000) {
            cp = 0xFFFD;
          }
          utf8_append(out, cp);
          break;
        }
        default: out += e;  // '"', '\\', '/'
      }
    }
    if (i_ >= s_.size()) error("unterminated string");
    ++i_;
    arena_.push_back(std::move(out));
    return arena_.back();
  }

  int64_t integer() {
    peek();
    bool neg = i_ < s_.size() && s_[i_] == '-';
    if (neg) ++i_;
    if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') error("expected an integer");
    int64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9' && v < (int64_t(1) << 40))
      v = v * 10 + (s_[i_++] - '0');
    return neg ? -v : v;
  }

  // Skips one value and returns its source text.
  std::string_view skip_value() {
    peek();
    const size_t b = i_;
    int depth = 0;
    while (i_ < s_.size()) {
      const char c = s_[i_];
      if (c == '"') {
        skip_string();
        if (depth == 0) break;
        continue;
      }
      if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        if (depth == 0) break;  // a scalar ended at its container's end
        if (--depth == 0) {
          ++i_;
          break;
        }
      } else if (c == ',' && depth == 0) {
        break;
      }
      ++i_;
    }
    return s_.substr(b, i_ - b);
  }

  [[noreturn]] void error(const std::string& what) const {
    fail("tokenizer.json: {} at byte {}", what, i_);
  }

 private:
  void skip_string() {
    for (++i_; i_ < s_.size() && s_[i_] != '"'; ++i_)
      if (s_[i_] == '\\') ++i_;
    if (i_ >= s_.size()) error("unterminated string");
    ++i_;
  }

  uint32_t hex4() {
    if (i_ + 4 > s_.size()) error("bad \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else error("bad \\u escape");
    }
    return v;
  }

  std::string_view s_;
  size_t i_ = 0;
  std::deque<std::string>& arena_;
};

std::string pattern_string(const json& j, const char* what) {
  if (j.contains("pattern")) {
    const json& p = j["pattern"];
    if (p.contains("String")) return p["String"].get<std::string>();
    fail("tokenizer.json: {} with a regex pattern is not supported", what);
  }
  fail("tokenizer.json: {} without a pattern", what);
}

void parse_normalizer(const json& j, BuildSpec& spec) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& n : j["normalizers"]) parse_normalizer(n, spec);
  } else if (type == "Replace") {
    spec.normalizer.push_back(NormStep{NormStep::Replace, pattern_string(j, "Replace normalizer"),
                                       j["content"].get<std::string>()});
  } else if (type == "Prepend") {
    spec.normalizer.push_back(NormStep{NormStep::Prepend, "", j["prepend"].get<std::string>()});
  } else {
    fail("tokenizer.json: normalizer '{}' is not supported", type);
  }
}

void parse_pre_tokenizer(const json& j, BuildSpec& spec) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& p : j["pretokenizers"]) parse_pre_tokenizer(p, spec);
    return;
  }
  if (type != "Split") fail("tokenizer.json: pre-tokenizer '{}' is not supported", type);
  MB_CHECK(!spec.has_split, "tokenizer.json: more than one Split pre-tokenizer is not supported");
  MB_CHECK(!j.value("invert", false), "tokenizer.json: inverted Split is not supported");
  spec.has_split = true;
  spec.split_pattern = pattern_string(j, "Split pre-tokenizer");
  const std::string b = j.value("behavior", "Removed");
  if (b == "Removed") spec.split_behavior = SplitBehavior::Removed;
  else if (b == "Isolated") spec.split_behavior = SplitBehavior::Isolated;
  else if (b == "MergedWithPrevious") spec.split_behavior = SplitBehavior::MergedWithPrevious;
  else if (b == "MergedWithNext") spec.split_behavior = SplitBehavior::MergedWithNext;
  else if (b == "Contiguous") spec.split_behavior = SplitBehavior::Contiguous;
  else fail("tokenizer.json: Split behavior '{}' is not supported", b);
}

void parse_decoder(const json& j, BuildSpec& spec) {
  if (j.is_null()) return;
  spec.has_decoder = true;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& d : j["decoders"]) parse_decoder(d, spec);
  } else if (type == "Replace") {
    spec.decoder.push_back(DecoderStep{DecoderStep::Replace, pattern_string(j, "Replace decoder"),
                                       j["content"].get<std::string>()});
  } else if (type == "ByteFallback") {
    spec.decoder.push_back(DecoderStep{DecoderStep::ByteFallback});
  } else if (type == "Fuse") {
    spec.decoder.push_back(DecoderStep{DecoderStep::Fuse});
  } else if (type == "Strip") {
    spec.decoder.push_back(DecoderStep{DecoderStep::Strip, "", j["content"].get<std::string>(),
                                       j.value("start", 0), j.value("stop", 0)});
  } else {
    fail("tokenizer.json: decoder '{}' is not supported", type);
  }
}

// Everything except model.vocab and model.merges.
void parse_config(const json& root, const json& model, BuildSpec& spec) {
  const std::string type = model.value("type", "BPE");
  MB_CHECK(type == "BPE", "tokenizer.json: model type '{}' is not supported (BPE only)", type);
  if (model.contains("dropout") && !model["dropout"].is_null())
    MB_CHECK(model["dropout"].get<double>() == 0.0, "tokenizer.json: BPE dropout is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null())
      MB_CHECK(model[k].get<std::string>().empty(), "tokenizer.json: BPE {} is not supported", k);
  if (model.contains("unk_token") && model["unk_token"].is_string())
    spec.unk_token = model["unk_token"].get<std::string>();
  auto flag = [&](const char* k) { return model.contains(k) && model[k].is_boolean() && model[k].get<bool>(); };
  spec.byte_fallback = flag("byte_fallback");
  spec.fuse_unk = flag("fuse_unk");
  spec.ignore_merges = flag("ignore_merges");

  if (root.contains("added_tokens")) {
    for (const json& a : root["added_tokens"]) {
      AddedToken t;
      t.id = a.at("id").get<int32_t>();
      t.content = a.at("content").get<std::string>();
      t.special = a.value("special", false);
      t.normalized = a.value("normalized", !t.special);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.single_word = a.value("single_word", false);
      spec.added.push_back(std::move(t));
    }
  }
  parse_normalizer(root.value("normalizer", json()), spec);
  parse_pre_tokenizer(root.value("pre_tokenizer", json()), spec);
  parse_decoder(root.value("decoder", json()), spec);
  const json post = root.value("post_processor", json());
  if (post.is_object() && post.value("type", "") == "TemplateProcessing" && post.contains("single")) {
    const json& single = post["single"];
    spec.post_adds_bos = !single.empty() && single[0].contains("SpecialToken");
  }
}

void set_vocab(BuildSpec& spec, const std::vector<std::pair<std::string_view, int64_t>>& vocab) {
  int64_t n = 0;
  for (auto& [piece, id] : vocab) {
    MB_CHECK(id >= 0 && id < (int64_t(1) << 30), "tokenizer.json: vocabulary id {} out of range", id);
    n = std::max(n, id + 1);
  }
  spec.vocab.assign(n, std::string_view());
  spec.present.assign(n, false);
  for (auto& [piece, id] : vocab) {
    spec.vocab[id] = piece;
    spec.present[id] = true;
  }
}

std::pair<std::string_view, std::string_view> split_legacy_merge(std::string_view m) {
  size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
  MB_CHECK(sp != std::string_view::npos, "tokenizer.json: merge '{}' has no space", m);
  return {m.substr(0, sp), m.substr(sp + 1)};
}

}  // namespace
}  // namespace tok_detail

Tokenizer Tokenizer::from_hf_json_text(std::string_view text) {
  using namespace tok_detail;
  std::deque<std::string> arena;
  Scanner sc(text, arena);
  BuildSpec spec;
  json root = json::object(), model = json::object();
  std::vector<std::pair<std::string_view, int64_t>> vocab;
  bool have_model = false;

  auto parse_rest = [&](std::string_view v) {
    try {
      return json::parse(v);
    } catch (const json::exception& e) {
      fail("tokenizer.json: {}", e.what());
    }
  };
  sc.expect('{');
  if (!sc.consume('}')) {
    do {
      std::string key(sc.string());
      sc.expect(':');
      if (key != "model" || sc.peek() != '{') {
        root[key] = parse_rest(sc.skip_value());
        continue;
      }
      have_model = true;
      sc.expect('{');
      if (sc.consume('}')) continue;
      do {
        std::string mkey(sc.string());
        sc.expect(':');
        if (mkey == "vocab" && sc.peek() == '{') {
          sc.expect('{');
          vocab.reserve(1 << 18);
          if (!sc.consume('}')) {
            do {
              std::string_view piece = sc.string();
              sc.expect(':');
              vocab.emplace_back(piece, sc.integer());
            } while (sc.consume(','));
            sc.expect('}');
          }
        } else if (mkey == "merges" && sc.peek() == '[') {
          sc.expect('[');
          spec.merges.reserve(1 << 19);
          if (!sc.consume(']')) {
            do {
              if (sc.consume('[')) {
                std::string_view a = sc.string();
                sc.expect(',');
                std::string_view b = sc.string();
                sc.expect(']');
                spec.merges.emplace_back(a, b);
              } else {
                spec.merges.push_back(split_legacy_merge(sc.string()));
              }
            } while (sc.consume(','));
            sc.expect(']');
          }
        } else {
          model[mkey] = parse_rest(sc.skip_value());
        }
      } while (sc.consume(','));
      sc.expect('}');
    } while (sc.consume(','));
    sc.expect('}');
  }
  MB_CHECK(have_model, "tokenizer.json: no model section");
  MB_CHECK(!vocab.empty(), "tokenizer.json: empty model.vocab");
  set_vocab(spec, vocab);
  parse_config(root, model, spec);
  return Tokenizer(build(std::move(spec)));
}

Tokenizer Tokenizer::from_hf_json_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MB_CHECK(f.good(), "tokenizer: cannot open '{}'", path);
  f.seekg(0, std::ios::end);
  std::string text(static_cast<size_t>(f.tellg()), '\0');
  f.seekg(0);
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  MB_CHECK(f.good(), "tokenizer: cannot read '{}'", path);
  try {
    return from_hf_json_text(text);
  } catch (const Error& e) {
    fail("{} ({})", e.what(), path);
  }
}

Tokenizer Tokenizer::from_hf_json(const nlohmann::json& j) {
  using namespace tok_detail;
  MB_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), "tokenizer.json: no model section");
  const json& model = j["model"];
  BuildSpec spec;
  std::vector<std::pair<std::string_view, int64_t>> vocab;
  for (auto it = model.at("vocab").begin(); it != model.at("vocab").end(); ++it)
    vocab.emplace_back(it.key(), it.value().get<int64_t>());
  set_vocab(spec, vocab);
  if (model.contains("merges")) {
    for (const json& m : model["merges"]) {
      if (m.is_array()) {
        MB_CHECK(m.size() == 2, "tokenizer.json: a merge must have two parts");
        spec.merges.emplace_back(m[0].get_ref<const std::string&>(), m[1].get_ref<const std::string&>());
      } else {
        spec.merges.push_back(split_legacy_merge(m.get_ref<const std::string&>()));
      }
    }
  }
  json model_rest = model;
  model_rest.erase("vocab");
  model_rest.erase("merges");
  parse_config(j, model_rest, spec);
  return Tokenizer(build(std::move(spec)));
}

}  // namespace mb
