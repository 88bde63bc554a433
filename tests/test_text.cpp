// Text in, text out through the CLI on fixtures that carry a (cut-down) real Gemma tokenizer and
// chat template; expected ids come from transformers (tools/reference/make_fixtures.py).
#include <gtest/gtest.h>

#include <fstream>

#include "markbase/markbase.h"
#include "test_util.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>

namespace {

std::string ids_line(const nlohmann::json& ids) {
  std::string s;
  for (auto& v : ids) s += (s.empty() ? "" : ",") + std::to_string(v.get<int>());
  return s + "\n";
}

class TextIO : public ::testing::TestWithParam<std::string> {};

TEST_P(TextIO, TokenizeMatchesTransformers) {
  const std::string m = mbtest::fixture(GetParam());
  auto cases = mbtest::read_json(m + "/tokenize_cases.json");
  const std::string dir = mbtest::temp_dir("text_" + GetParam());
  for (auto& c : cases["text"]) {
    std::ofstream(dir + "/t.txt") << c["text"].get<std::string>();
    // The text goes through a file and $(cat) so the shell passes it untouched.
    auto r = mbtest::run_cli("tokenize -m " + m + " --text \"$(cat " + dir + "/t.txt)\"");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    std::string want = ids_line(c["ids"]);
    if (c["text"].get<std::string>().back() == '\n') continue;  // $(cat) strips trailing newlines
    EXPECT_EQ(r.out, want) << c["text"];
  }
  int i = 0;
  for (auto& c : cases["chat"]) {
    std::string f = dir + "/m" + std::to_string(i++) + ".json";
    std::ofstream(f) << c["messages"].dump();
    auto r = mbtest::run_cli("tokenize -m " + m + " --messages " + f + " --add-generation-prompt" +
                             (c["enable_thinking"].get<bool>() ? " --enable-thinking" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(r.out, ids_line(c["ids"])) << c["rendered"];
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), ','), int(c["ids"].size()) - 1);
  }
}

TEST_P(TextIO, ApiTokenizeAndDecodeRoundTrip) {
  markbase::EngineOptions o;
  o.model_path = mbtest::fixture(GetParam());
  auto engine = markbase::Engine::open(o);
  ASSERT_TRUE(engine->has_tokenizer());
  auto cases = mbtest::read_json(o.model_path + "/tokenize_cases.json");
  for (auto& c : cases["text"]) {
    auto ids = engine->tokenize(c["text"].get<std::string>(), false);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(engine->detokenize(ids), c["decoded"].get<std::string>());  // as transformers decodes
    auto with_bos = engine->tokenize(c["text"].get<std::string>(), true);
    EXPECT_EQ(with_bos.front(), 2);
    EXPECT_EQ(with_bos.size(), ids.size() + 1);
  }
}

TEST_P(TextIO, GenerateFromTextAndChatStreamsText) {
  const std::string m = mbtest::fixture(GetParam());
  auto r = mbtest::run_cli("generate -m " + m + " -p \"Hello there\" -n 6 --print-ids");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  r = mbtest::run_cli("generate -m " + m + " -p \"Hello there\" -n 6 --chat --temperature 0.8 --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("new tokens"), std::string::npos) << r.out;

  markbase::EngineOptions o;
  o.model_path = m;
  auto engine = markbase::Engine::open(o);
  markbase::Request req;
  req.prompt = "Hello there";
  req.chat = true;
  req.max_new_tokens = 8;
  req.stop_at_eos = false;
  std::string streamed;
  req.on_token = [&](int32_t, std::string_view piece) {
    streamed += piece;
    return true;
  };
  auto res = engine->generate(req);
  EXPECT_EQ(res.prompt_ids.front(), 2);
  EXPECT_EQ(std::count(res.prompt_ids.begin(), res.prompt_ids.end(), 2), 1);  // exactly one <bos>
  EXPECT_EQ(streamed, res.text);
  EXPECT_EQ(res.text, engine->detokenize(res.tokens));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TextIO, ::testing::Values("e2b_like", "gemma3_like"));

TEST(TextIO, ModelsWithoutTokenizerSayWhy) {
  auto r = mbtest::run_cli("generate -m " + mbtest::fixture("dense_kv") + " -p hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("no tokenizer"), std::string::npos) << r.out;
  r = mbtest::run_cli("tokenize -m " + mbtest::fixture("dense_kv") + " --text hi");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("no tokenizer.json"), std::string::npos) << r.out;
}

}  // namespace

namespace {

// Every shared-template rendering, tokenized with the full Gemma tokenizer, gives transformers'
// apply_chat_template(tokenize=True) ids: exactly one <bos>, then the template's text.
TEST(TextIO, ChatIdsMatchTransformersOnSharedTemplates) {
  const std::string shared = mbtest::shared_dir() + "/data/tokenizer/";
  if (!std::filesystem::exists(shared)) GTEST_SKIP() << "no ../shared";
  auto g4 = mb::Tokenizer::from_hf_json_file(shared + "gemma4-tokenizer.json");
  auto g3 = mb::Tokenizer::from_hf_json_file(shared + "gemma3-tokenizer.json");
  // ordered: a template printing a dict shows its keys in the order the message gave them.
  std::ifstream in_file(mbtest::fixture("chat/render_cases.json"));
  auto cases = nlohmann::ordered_json::parse(in_file);
  int checked = 0;
  for (auto& c : cases["cases"]) {
    if (!c.contains("ids")) continue;
    const auto& tok = c["template"].get<std::string>().starts_with("gemma-4") ? g4 : g3;
    mb::ChatTemplate t = mb::ChatTemplate::from_file(mbtest::fixture("chat/templates/" + c["template"].get<std::string>()));
    mb::ChatTemplateInputs in;
    in.messages = c["messages"];
    in.tools = c["tools"];
    in.add_generation_prompt = c["add_generation_prompt"];
    in.enable_thinking = c["enable_thinking"];
    auto ids = tok.encode(t.render(in));
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << c["name"];
    EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.bos_id()), 1) << c["name"];
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

}  // namespace
