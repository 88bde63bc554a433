// Tokenizer exactness against the Hugging Face `tokenizers` package: llama.cpp's Gemma 4 vocab
// vectors (shared data) and the generated cases of tools/reference/make_tokenizer_cases.py.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace {

using mb::StreamingDecoder;
using mb::Tokenizer;
using Ids = std::vector<int32_t>;

const std::string kShared = MARKBASE_SOURCE_DIR "/../shared/data/tokenizer/";
const std::string kFixtures = MARKBASE_SOURCE_DIR "/tests/fixtures/tokenizer/";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool have_shared() { return std::filesystem::exists(kShared + "gemma4-tokenizer.json"); }

#define REQUIRE_SHARED() \
  if (!have_shared()) GTEST_SKIP() << "shared tokenizer data not found at " << kShared

const Tokenizer& gemma4() {
  static const Tokenizer tok = Tokenizer::from_hf_json_file(kShared + "gemma4-tokenizer.json");
  return tok;
}
const Tokenizer& gemma3() {
  static const Tokenizer tok = Tokenizer::from_hf_json_file(kShared + "gemma3-tokenizer.json");
  return tok;
}
const Tokenizer& synthetic() {
  static const Tokenizer tok = Tokenizer::from_hf_json_file(kFixtures + "synthetic-tokenizer.json");
  return tok;
}

std::string ids_str(const Ids& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    int n = c < 0x80 ? 1 : c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (int k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    if (n == 3 && ((c == 0xE0 && (unsigned char)s[i + 1] < 0xA0) || (c == 0xED && (unsigned char)s[i + 1] > 0x9F)))
      return false;
    if (n == 4 && ((c == 0xF0 && (unsigned char)s[i + 1] < 0x90) || (c == 0xF4 && (unsigned char)s[i + 1] > 0x8F)))
      return false;
    i += n;
  }
  return true;
}

std::string stream_decode(const Tokenizer& tok, const Ids& ids, bool* pieces_valid = nullptr) {
  StreamingDecoder dec(tok);
  std::string out;
  bool ok = true;
  for (int32_t id : ids) {
    std::string piece = dec.push(id);
    ok = ok && valid_utf8(piece);
    out += piece;
  }
  std::string tail = dec.flush();
  ok = ok && valid_utf8(tail);
  if (pieces_valid) *pieces_valid = ok;
  return out + tail;
}

// ---------------------------------------------------------------------------------------------
// llama.cpp's ggml-vocab test vectors: strings separated by "\n__ggml_vocab_test__\n" (the last
// one runs to the end of the file, without a trailing newline); one line of ids per string.

TEST(TokenizerGemma4, VocabTestVectors) {
  REQUIRE_SHARED();
  const std::string inp = read_file(kShared + "gemma4-vocab-tests.inp");
  const std::string out = read_file(kShared + "gemma4-vocab-tests.out");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  size_t pos = 0;
  for (size_t hit; (hit = inp.find(sep, pos)) != std::string::npos; pos = hit + sep.size())
    texts.push_back(inp.substr(pos, hit - pos));
  if (pos < inp.size()) texts.push_back(inp.substr(pos));
  std::vector<std::string> expected;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) expected.push_back(line);
  ASSERT_GT(texts.size(), 40u);
  ASSERT_EQ(expected.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    Ids ids = gemma4().encode(texts[i]);
    EXPECT_EQ(ids_str(ids), expected[i]) << "vector " << i << ": '" << texts[i] << "'";
    EXPECT_EQ(gemma4().decode(ids), texts[i]) << "vector " << i;
  }
}

// What HF `tokenizers` reads from the same files (tools/reference/make_vocab_facts.py).
const nlohmann::json& vocab_facts(const std::string& family) {
  static const nlohmann::json f = [] {
    std::ifstream in(MARKBASE_SOURCE_DIR "/tests/fixtures/tokenizer/vocab_facts.json");
    return nlohmann::json::parse(in);
  }();
  return f[family];
}

void expect_vocabulary_as_hf_reads_it(const Tokenizer& tok, const nlohmann::json& facts) {
  EXPECT_EQ(tok.vocab_size(), facts["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok.post_processor_adds_bos(), facts["adds_bos"].get<bool>());
  const auto& pieces = facts["piece_ids"];
  auto id_of = [&](const std::string& piece) { return pieces[piece].is_null() ? -1 : pieces[piece].get<int32_t>(); };
  for (auto& [piece, id] : pieces.items()) EXPECT_EQ(tok.find_token(piece), id_of(piece)) << piece;
  EXPECT_EQ(tok.pad_id(), id_of("<pad>"));
  EXPECT_EQ(tok.eos_id(), id_of("<eos>"));
  EXPECT_EQ(tok.bos_id(), id_of("<bos>"));
  EXPECT_EQ(tok.unk_id(), id_of("<unk>"));
  for (auto& [key, want] : facts["ids"].items()) {
    const int32_t id = std::stoi(key);
    EXPECT_EQ(tok.token_text(id), want["text"].get<std::string>()) << id;
    EXPECT_EQ(tok.is_added(id), want["added"].get<bool>()) << id;
    EXPECT_EQ(tok.is_special(id), want["special"].get<bool>()) << id;
    EXPECT_EQ(tok.find_token(tok.token_text(id)), id);
  }
  for (const auto& c : facts["encode"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok.encode(text), c["ids"].get<Ids>()) << text;
    EXPECT_EQ(tok.encode(text, /*parse_special=*/false), c["ids_without_special"].get<Ids>()) << text;
    EXPECT_EQ(tok.decode(c["ids_without_special"].get<Ids>()), text);  // special text kept as text
  }
  for (const auto& c : facts["decode"]) {
    const Ids ids = c["ids"].get<Ids>();
    EXPECT_EQ(tok.decode(ids), c["text"].get<std::string>()) << ids_str(ids);
    EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), c["text_skip_special"].get<std::string>()) << ids_str(ids);
  }
  // Byte tokens, and ids outside the vocabulary: no text, not special, skipped by decode.
  ASSERT_GE(id_of("<0x41>"), 0);
  EXPECT_TRUE(tok.is_byte(id_of("<0x41>")));
  EXPECT_FALSE(tok.is_byte(id_of("Hello")));
  EXPECT_EQ(tok.token_text(-1), "");
  EXPECT_EQ(tok.token_text(tok.vocab_size()), "");
  EXPECT_FALSE(tok.is_special(-5));
  const int32_t hello = id_of("Hello");
  EXPECT_EQ(tok.decode(Ids{hello, -1, 999999999, hello}), tok.decode(Ids{hello, hello}));
}

TEST(TokenizerGemma4, VocabularyAndSpecialIds) {
  REQUIRE_SHARED();
  auto t0 = std::chrono::steady_clock::now();
  Tokenizer tok = Tokenizer::from_hf_json_file(kShared + "gemma4-tokenizer.json");
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("load_seconds", std::to_string(load_s));
  expect_vocabulary_as_hf_reads_it(tok, vocab_facts("gemma4"));
}

// Gemma 3's <image_soft_token> is an added token beyond the 262144-entry model vocabulary.
TEST(TokenizerGemma3, VocabularyAndSpecialIds) {
  REQUIRE_SHARED();
  expect_vocabulary_as_hf_reads_it(gemma3(), vocab_facts("gemma3"));
}

TEST(TokenizerGemma4, LongWordsAreExactAndFast) {
  REQUIRE_SHARED();
  const Tokenizer& tok = gemma4();
  // No space anywhere: the whole input is one BPE word, merged in O(n log n).
  std::string a(300000, 'a');
  auto t0 = std::chrono::steady_clock::now();
  Ids ids = tok.encode(a);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(tok.decode(ids), a);
  EXPECT_LT(ids.size(), a.size() / 4);
  EXPECT_LT(s, 5.0);
}

// ---------------------------------------------------------------------------------------------
// Generated cases (tools/reference/make_tokenizer_cases.py).

struct Case {
  std::string text;
  bool parse_special = true;
  bool invalid_utf8 = false;
  Ids g4, g3;
  std::optional<Ids> sy;
  std::string d4, d3, dsy;
};
struct DecodeCase {
  std::string tok;
  Ids ids;
  std::string expected;
};
struct Fixture {
  std::vector<Case> cases;
  std::vector<DecodeCase> decodes;
};

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

const Fixture& fixture() {
  static const Fixture fx = [] {
    Fixture f;
    std::ifstream in(kFixtures + "hf_cases.jsonl");
    EXPECT_TRUE(in.good()) << "missing " << kFixtures << "hf_cases.jsonl";
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("meta")) continue;
      if (j["k"] == "dec") {
        f.decodes.push_back({j["t"], j["ids"].get<Ids>(), j["d"]});
        continue;
      }
      Case c;
      if (j.contains("x")) {
        c.text = unhex(j["x"]);
        c.invalid_utf8 = true;
      } else {
        c.text = j["s"];
      }
      c.parse_special = j.value("ps", true);
      c.g4 = j["g4"].get<Ids>();
      c.g3 = j.contains("g3") ? j["g3"].get<Ids>() : c.g4;
      if (j.contains("sy")) c.sy = j["sy"].get<Ids>();
      c.d4 = j.value("d4", c.text);
      c.d3 = j.value("d3", c.text);
      c.dsy = j.value("dsy", c.text);
      f.cases.push_back(std::move(c));
    }
    return f;
  }();
  return fx;
}

// Runs every case through one tokenizer; reports the first mismatches with their text.
void check_cases(const Tokenizer& tok, const Ids Case::*ids_of, const std::string Case::*dec_of, size_t min_cases) {
  const Fixture& fx = fixture();
  size_t n = 0, enc_fail = 0, dec_fail = 0, stream_fail = 0;
  for (const Case& c : fx.cases) {
    ++n;
    Ids got = tok.encode(c.text, c.parse_special);
    const Ids& want = c.*ids_of;
    if (got != want && ++enc_fail <= 10)
      ADD_FAILURE() << "encode mismatch for " << nlohmann::json(c.invalid_utf8 ? "<invalid utf8>" : c.text).dump()
                    << "\n  got:  " << ids_str(got) << "\n  want: " << ids_str(want);
    std::string dec = tok.decode(want);
    if (dec != c.*dec_of && ++dec_fail <= 10)
      ADD_FAILURE() << "decode mismatch for ids " << ids_str(want);
    // Encoded text has no broken byte runs, so streaming must reproduce decode() exactly.
    bool pieces_valid = false;
    if ((stream_decode(tok, want, &pieces_valid) != dec || !pieces_valid) && ++stream_fail <= 10)
      ADD_FAILURE() << "streaming decode mismatch for ids " << ids_str(want);
  }
  EXPECT_GE(n, min_cases);
  EXPECT_EQ(enc_fail, 0u) << "of " << n;
  EXPECT_EQ(dec_fail, 0u) << "of " << n;
  EXPECT_EQ(stream_fail, 0u) << "of " << n;
}

TEST(TokenizerHfCases, Gemma4) {
  REQUIRE_SHARED();
  check_cases(gemma4(), &Case::g4, &Case::d4, 3000);
}

TEST(TokenizerHfCases, Gemma3) {
  REQUIRE_SHARED();
  check_cases(gemma3(), &Case::g3, &Case::d3, 3000);
}

TEST(TokenizerHfCases, SyntheticAddedTokenOptions) {
  const Tokenizer& tok = synthetic();
  size_t n = 0, fails = 0;
  for (const Case& c : fixture().cases) {
    if (!c.sy) continue;
    ++n;
    Ids got = tok.encode(c.text);
    if (got != *c.sy && ++fails <= 10)
      ADD_FAILURE() << "encode mismatch for " << nlohmann::json(c.text).dump() << "\n  got:  " << ids_str(got)
                    << "\n  want: " << ids_str(*c.sy);
    EXPECT_EQ(tok.decode(*c.sy), c.dsy);
    EXPECT_EQ(stream_decode(tok, *c.sy), c.dsy);
  }
  EXPECT_GE(n, 1000u);
  EXPECT_EQ(fails, 0u) << "of " << n;
}

TEST(TokenizerHfCases, DecodeArbitraryIds) {
  REQUIRE_SHARED();
  size_t n = 0;
  for (const DecodeCase& d : fixture().decodes) {
    const Tokenizer& tok = d.tok == "g4" ? gemma4() : gemma3();
    ++n;
    EXPECT_EQ(tok.decode(d.ids), d.expected) << d.tok << " ids " << ids_str(d.ids);
    bool pieces_valid = false;
    std::string streamed = stream_decode(tok, d.ids, &pieces_valid);
    EXPECT_TRUE(pieces_valid) << ids_str(d.ids);
    if (d.expected.find("\xEF\xBF\xBD") == std::string::npos) {
      EXPECT_EQ(streamed, d.expected);
    }
  }
  EXPECT_GE(n, 200u);
}

// ---------------------------------------------------------------------------------------------

TEST(TokenizerStreaming, HoldsSplitCharacterUntilComplete) {
  REQUIRE_SHARED();
  const Tokenizer& tok = gemma4();
  auto byte = [&](int b) { return tok.find_token(fmt::format("<0x{:02X}>", b)); };
  StreamingDecoder dec(tok);
  EXPECT_EQ(dec.push(9259), "Hello");
  EXPECT_EQ(dec.push(byte(0xF0)), "");
  EXPECT_EQ(dec.push(byte(0x9F)), "");
  EXPECT_EQ(dec.push(byte(0x98)), "");
  EXPECT_EQ(dec.push(byte(0x80)), "\xF0\x9F\x98\x80");
  EXPECT_EQ(dec.push(byte(0xE4)), "");
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");  // unfinished character at the end
  EXPECT_EQ(dec.flush(), "");
}

TEST(TokenizerStreaming, InvalidBytesBecomeReplacementCharacters) {
  REQUIRE_SHARED();
  const Tokenizer& tok = gemma4();
  auto byte = [&](int b) { return tok.find_token(fmt::format("<0x{:02X}>", b)); };
  const std::string fffd = "\xEF\xBF\xBD";
  {
    StreamingDecoder dec(tok);
    EXPECT_EQ(dec.push(byte(0xFF)), fffd);  // never valid: emitted at once
    EXPECT_EQ(dec.push(byte(0xE4)), "");
    EXPECT_EQ(dec.push(byte(0xB8)), "");
    EXPECT_EQ(dec.push(9259), fffd + fffd + "Hello");  // a normal token ends the byte run
  }
  // The documented difference: HF's decode turns a whole byte run that is not valid UTF-8 into
  // U+FFFDs, the streaming decoder keeps the complete characters it already emitted.
  Ids ids{byte(0xE4), byte(0xB8), byte(0xAD), byte(0xE4), 9259};
  EXPECT_EQ(tok.decode(ids), fffd + fffd + fffd + fffd + "Hello");
  EXPECT_EQ(stream_decode(tok, ids), "\xE4\xB8\xAD" + fffd + "Hello");
}

TEST(TokenizerStreaming, SkipSpecial) {
  REQUIRE_SHARED();
  StreamingDecoder dec(gemma4(), /*skip_special=*/true);
  EXPECT_EQ(dec.push(2), "");
  EXPECT_EQ(dec.push(9259), "Hello");
  EXPECT_EQ(dec.push(106), "");
}

// ---------------------------------------------------------------------------------------------
// Invalid UTF-8 is replaced by U+FFFD as CPython's decode("utf-8", "replace") does, then encoded
// (the generated cases check this against the Python package on many byte strings).

TEST(TokenizerInvalidUtf8, ReplacedLikePython) {
  REQUIRE_SHARED();
  const Tokenizer& tok = gemma4();
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(tok.encode("\xFF"), tok.encode(fffd));
  EXPECT_EQ(tok.encode("abc\xE4\xB8" "def"), tok.encode("abc" + fffd + "def"));  // one per maximal subpart
  EXPECT_EQ(tok.encode("\xED\xA0\x80"), tok.encode(fffd + fffd + fffd));       // encoded surrogate
  EXPECT_EQ(tok.encode("\xC0\xAF"), tok.encode(fffd + fffd));                  // overlong
  EXPECT_EQ(tok.encode("\xF0\x9F\x98"), tok.encode(fffd));                     // truncated at the end
  EXPECT_EQ(tok.encode("<bos>\xC3"), tok.encode("<bos>" + fffd));
}

TEST(TokenizerInvalidUtf8, RandomBytesNeverCrash) {
  REQUIRE_SHARED();
  const Tokenizer& tok = gemma4();
  std::mt19937 rng(7);
  for (int i = 0; i < 3000; ++i) {
    std::string s(rng() % 64, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    Ids ids = tok.encode(s);
    std::string back = tok.decode(ids);
    ASSERT_TRUE(valid_utf8(back));
    if (valid_utf8(s)) {
      ASSERT_EQ(back, s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The GGUF path: the same vocabulary given as arrays must tokenize identically.

TEST(TokenizerFromVocab, MatchesTokenizerJson) {
  REQUIRE_SHARED();
  const auto j = nlohmann::json::parse(read_file(kShared + "gemma4-tokenizer.json"));
  const auto& vocab = j["model"]["vocab"];
  std::vector<std::string> tokens(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) tokens[it.value().get<size_t>()] = it.key();
  std::vector<int32_t> types(tokens.size(), static_cast<int32_t>(mb::TokenType::Normal));
  for (const auto& a : j["added_tokens"])
    types[a["id"].get<size_t>()] = static_cast<int32_t>(a["special"].get<bool>() ? mb::TokenType::Control
                                                                                 : mb::TokenType::UserDefined);
  for (size_t id = 0; id < tokens.size(); ++id)
    if (tokens[id].size() == 6 && tokens[id].rfind("<0x", 0) == 0) types[id] = static_cast<int32_t>(mb::TokenType::Byte);
  std::vector<std::string> merges;
  for (const auto& m : j["model"]["merges"]) merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());

  mb::VocabOptions opt;
  opt.bos_id = 2;
  opt.eos_id = 1;
  Tokenizer from_gguf = Tokenizer::from_vocab(tokens, merges, types, opt);
  Tokenizer from_dom = Tokenizer::from_hf_json(j);
  EXPECT_EQ(from_gguf.vocab_size(), 262144);
  EXPECT_EQ(from_gguf.bos_id(), 2);
  EXPECT_EQ(from_gguf.eos_id(), 1);
  EXPECT_EQ(from_gguf.pad_id(), 0);
  EXPECT_TRUE(from_gguf.is_special(105));
  EXPECT_FALSE(from_gguf.is_special(107));
  size_t n = 0, fails = 0;
  for (const Case& c : fixture().cases) {
    if (!c.parse_special) continue;
    ++n;
    Ids a = from_gguf.encode(c.text), b = from_dom.encode(c.text);
    if ((a != c.g4 || b != c.g4) && ++fails <= 5)
      ADD_FAILURE() << nlohmann::json(c.text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (from_gguf.decode(c.g4) != c.d4 && ++fails <= 5) ADD_FAILURE() << "decode " << ids_str(c.g4);
  }
  EXPECT_GE(n, 3000u);
  EXPECT_EQ(fails, 0u);
}

TEST(TokenizerFromVocab, ScoresGiveSentencePieceOrder) {
  // No merges: the pair whose concatenation scores highest merges first, ties leftmost.
  std::vector<std::string> tokens{"<unk>", "a", "b", "c", "ab", "bc", "aa", "\xE2\x96\x81", "\xE2\x96\x81" "a"};
  std::vector<float> scores{0, -10, -10, -10, -2, -1, -1, -10, -0.5f};
  mb::VocabOptions opt;
  opt.scores = scores;
  opt.byte_fallback = false;
  Tokenizer tok = Tokenizer::from_vocab(tokens, {}, {}, opt);
  EXPECT_EQ(tok.encode("abc"), (Ids{1, 5}));  // bc (-1) beats ab (-2)
  EXPECT_EQ(tok.encode("aaa"), (Ids{6, 1}));  // equal pairs: leftmost first
  EXPECT_EQ(tok.encode("ab"), (Ids{4}));
  EXPECT_EQ(tok.encode(" a"), (Ids{8}));      // space becomes U+2581
  EXPECT_EQ(tok.encode("xxa"), (Ids{0, 1}));  // unknown characters fuse into one <unk>
  EXPECT_EQ(tok.decode(Ids{8, 5}), " abc");
}

TEST(TokenizerErrors, RefusesBadInput) {
  EXPECT_THROW(Tokenizer::from_hf_json_file("/nonexistent/tokenizer.json"), mb::Error);
  EXPECT_THROW(Tokenizer::from_hf_json_text("{\"model\": {\"vocab\": {\"a\": 0"), mb::Error);
  EXPECT_THROW(Tokenizer::from_hf_json_text("not json"), mb::Error);
  const std::string ok_model = R"("model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]})";
  EXPECT_NO_THROW(Tokenizer::from_hf_json_text("{" + ok_model + "}"));
  EXPECT_THROW(Tokenizer::from_hf_json_text(R"({"normalizer": {"type": "NFKC"}, )" + ok_model + "}"), mb::Error);
  EXPECT_THROW(Tokenizer::from_hf_json_text(R"({"decoder": {"type": "WordPiece"}, )" + ok_model + "}"), mb::Error);
  EXPECT_THROW(Tokenizer::from_hf_json_text(
                   R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [["a", "b"]]}})"),
               mb::Error);  // merge result missing from the vocabulary
  EXPECT_THROW(Tokenizer::from_hf_json_text(R"({"model": {"type": "Unigram", "vocab": {"a": 0}}})"), mb::Error);
  Tokenizer tiny = Tokenizer::from_hf_json_text("{" + ok_model + "}");
  EXPECT_EQ(tiny.encode("abab"), (Ids{2, 2}));
  EXPECT_EQ(tiny.decode(Ids{2, 0}), "ab a");  // no decoder: HF joins tokens with spaces
}

}  // namespace
