// Chat rendering and Gemma 4 output parsing against transformers' behaviour. The fixtures in
// tests/fixtures/chat/ come from tools/reference/make_chat_cases.py, which renders each case with
// apply_chat_template(tokenize=False) and parses each output with transformers' Gemma 4 response
// parser.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "models/architecture.h"
#include "tokenizer/chat.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

const fs::path kFixtures = fs::path(MARKBASE_SOURCE_DIR) / "tests" / "fixtures" / "chat";

Json load(const std::string& name) {
  std::ifstream f(kFixtures / name);
  if (!f) return Json::object();
  std::stringstream ss;
  ss << f.rdbuf();
  return Json::parse(ss.str());
}

const Json& render_cases() {
  static const Json cases = load("render_cases.json").value("cases", Json::array());
  return cases;
}

const mb::ChatTemplate& fixture_template(const std::string& name) {
  static std::map<std::string, mb::ChatTemplate> cache;
  auto it = cache.find(name);
  if (it == cache.end())
    it = cache.emplace(name, mb::ChatTemplate::from_file((kFixtures / "templates" / name).string())).first;
  return it->second;
}

mb::ChatTemplateInputs inputs_of(const Json& c) {
  mb::ChatTemplateInputs in;
  in.messages = c["messages"];
  in.tools = c["tools"];
  in.add_generation_prompt = c["add_generation_prompt"].get<bool>();
  in.enable_thinking = c["enable_thinking"].get<bool>();
  in.bos_token = c["bos_token"].get<std::string>();
  in.eos_token = c["eos_token"].get<std::string>();
  return in;
}

class ChatRender : public testing::TestWithParam<size_t> {};

TEST_P(ChatRender, MatchesTransformers) {
  const Json& c = render_cases()[GetParam()];
  SCOPED_TRACE(c["name"].get<std::string>());
  const mb::ChatTemplate& t = fixture_template(c["template"].get<std::string>());
  if (c.contains("expected")) {
    EXPECT_EQ(t.render(inputs_of(c)), c["expected"].get<std::string>());
    return;
  }
  // transformers raised; we must too, with the template's own message for raise_exception().
  std::string expected = c["error"].get<std::string>();
  try {
    t.render(inputs_of(c));
    ADD_FAILURE() << "expected an error like: " << expected;
  } catch (const mb::Error& e) {
    const std::string prefix = "TemplateError: ";
    if (expected.rfind(prefix, 0) == 0) {
      EXPECT_NE(std::string(e.what()).find(expected.substr(prefix.size())), std::string::npos) << e.what();
    }
  }
}

std::string case_name(const testing::TestParamInfo<size_t>& info) {
  std::string n = render_cases()[info.param]["name"].get<std::string>();
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(ChatFixtures, ChatRender, testing::Range<size_t>(0, render_cases().size()), case_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ChatRender);

TEST(ChatFixtures, CoverAllTemplatesAndSettings) {
  std::map<std::string, int> per_template;
  int thinking_on = 0, thinking_off = 0, with_tools = 0, multimodal = 0;
  for (const Json& c : render_cases()) {
    ++per_template[c["template"].get<std::string>()];
    (c["enable_thinking"].get<bool>() ? thinking_on : thinking_off)++;
    with_tools += !c["tools"].is_null();
    multimodal += c["messages"].dump().find("\"type\":\"image\"") != std::string::npos;
  }
  EXPECT_GE(render_cases().size(), 40u);
  EXPECT_EQ(per_template.size(), 3u);
  EXPECT_GT(thinking_on, 10);
  EXPECT_GT(thinking_off, 10);
  EXPECT_GT(with_tools, 10);
  EXPECT_GT(multimodal, 3);
}

// The templates write bos_token themselves, so the tokenizer must not add another.
TEST(ChatTemplate, TemplatesEmitBosOnce) {
  mb::ChatTemplateInputs in;
  in.messages = Json::parse(R"([{"role": "user", "content": "Hi"}])");
  in.add_generation_prompt = true;
  for (const char* name : {"gemma-4-31B-it.jinja", "gemma-4-31B-it-interleaved.jinja", "gemma-3-it.jinja"}) {
    std::string out = fixture_template(name).render(in);
    EXPECT_EQ(out.rfind("<bos>", 0), 0u) << name;
    EXPECT_EQ(out.find("<bos>", 1), std::string::npos) << name;
  }
}

TEST(ChatTemplate, ExtraKwargsReachTheTemplate) {
  mb::ChatTemplate t("{{ bos_token }}{{ greeting }}{{ messages | length }}{{ tools is none }}{{ enable_thinking }}");
  mb::ChatTemplateInputs in;
  in.messages = Json::parse(R"([{"role": "user", "content": "x"}])");
  in.extra = {{"greeting", "hello"}, {"bos_token", "<s>"}};
  EXPECT_EQ(t.render(in), "<s>hello1TrueFalse");
  in.extra = {{"messages", Json::array()}};
  EXPECT_THROW(t.render(in), mb::Error);
}

TEST(ChatTemplate, RejectsEmptyConversation) {
  mb::ChatTemplate t("{{ messages }}");
  EXPECT_THROW(t.render(mb::ChatTemplateInputs{}), mb::Error);
}

TEST(ChatTemplate, TemplateErrorsNameOriginAndLine) {
  try {
    mb::ChatTemplate("ok\n{% include 'x' %}");
    FAIL();
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
}

class ChatCheckpointDir : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("markbase_chat_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    fs::create_directories((dir_ / name).parent_path());
    std::ofstream(dir_ / name) << text;
  }
  std::string render(bool with_tools) {
    mb::ChatTemplateInputs in;
    in.messages = Json::parse(R"([{"role": "user", "content": "x"}])");
    if (with_tools) in.tools = Json::array();
    return mb::ChatTemplate::from_checkpoint_dir(dir_.string()).render(in);
  }
  fs::path dir_;
};

TEST_F(ChatCheckpointDir, JinjaFileWinsOverConfig) {
  write("tokenizer_config.json", R"({"chat_template": "config"})");
  write("chat_template.jinja", "file");
  EXPECT_EQ(render(false), "file");
}

TEST_F(ChatCheckpointDir, ConfigString) {
  write("tokenizer_config.json", R"({"chat_template": "{{ bos_token }}cfg"})");
  EXPECT_EQ(render(false), "<bos>cfg");
}

TEST_F(ChatCheckpointDir, ConfigListPicksToolUseWhenToolsGiven) {
  write("tokenizer_config.json",
        R"({"chat_template": [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]})");
  EXPECT_EQ(render(false), "plain");
  EXPECT_EQ(render(true), "tools");
}

TEST_F(ChatCheckpointDir, AdditionalTemplatesDir) {
  write("chat_template.jinja", "plain");
  write("additional_chat_templates/tool_use.jinja", "tools");
  EXPECT_EQ(render(true), "tools");
}

TEST_F(ChatCheckpointDir, ProcessorChatTemplateJson) {
  write("chat_template.json", R"({"chat_template": "proc"})");
  EXPECT_EQ(render(false), "proc");
}

TEST_F(ChatCheckpointDir, MissingTemplateIsAnError) {
  write("tokenizer_config.json", R"({"bos_token": "<bos>"})");
  EXPECT_THROW(render(false), mb::Error);
}

TEST(ChatStopTokens, Gemma) {
  EXPECT_EQ(std::vector<std::string_view>(mb::kGemma4StopTokens.begin(), mb::kGemma4StopTokens.end()),
            (std::vector<std::string_view>{"<turn|>", "<eos>", "<|tool_response>"}));
  const auto g3 = mb::architecture_named("gemma3").stop_tokens();
  EXPECT_EQ(std::vector<std::string_view>(g3.begin(), g3.end()), (std::vector<std::string_view>{"<end_of_turn>", "<eos>"}));
  const auto g4 = mb::architecture_named("gemma4").stop_tokens();
  EXPECT_EQ(std::vector<std::string_view>(g4.begin(), g4.end()),
            (std::vector<std::string_view>{"<turn|>", "<eos>", "<|tool_response>"}));
}

TEST(ChatParse, MatchesTransformersResponseParser) {
  Json cases = load("parse_cases.json").value("cases", Json::array());
  ASSERT_GE(cases.size(), 8u);
  for (const Json& c : cases) {
    SCOPED_TRACE(c["name"].get<std::string>());
    mb::ParsedOutput p = mb::parse_gemma4_output(c["text"].get<std::string>());
    EXPECT_EQ(p.thinking, c["thinking"].get<std::string>());
    EXPECT_EQ(p.content, c["content"].get<std::string>());
    ASSERT_EQ(p.tool_calls.size(), c["tool_calls"].size());
    for (size_t i = 0; i < p.tool_calls.size(); ++i) {
      EXPECT_EQ(p.tool_calls[i].name, c["tool_calls"][i]["name"].get<std::string>());
      EXPECT_EQ(p.tool_calls[i].arguments, c["tool_calls"][i]["arguments"]);  // same key order too
    }
  }
}

// Render an assistant tool call with the real template, cut out what the model would have
// generated, and parse it back: the parser must be the exact inverse of format_argument.
TEST(ChatParse, RoundTripThroughTemplate) {
  const Json arguments_sets = Json::parse(R"([
    {"city": "Tokyo"},
    {},
    {"b": 1, "A": -2, "c": 0.5, "d": 1e-05, "e": 1e20, "f": 1.0, "g": true, "h": false, "i": null},
    {"route": {"from": "CDG", "to": "NRT", "via": ["HEL", "ARN"]}, "passengers": [{"name": "Émile", "age": 36}, {"name": "Ada"}]},
    {"text": "commas, colons: {braces} [brackets]\nnewline and \"quotes\" — ünïcode 🙂", "empty": {"list": [], "obj": {}}},
    {"nested": [[1, [2, [3]]], {"deep": {"deeper": {"deepest": "x"}}}], "first-name": "hyphen key"}
  ])");
  const auto& t = fixture_template("gemma-4-31B-it.jinja");
  for (const Json& args : arguments_sets) {
    SCOPED_TRACE(args.dump());
    mb::ChatTemplateInputs in;
    in.messages = Json::array(
        {{{"role", "user"}, {"content", "go"}},
         {{"role", "assistant"},
          {"content", ""},
          {"tool_calls",
           Json::array({{{"type", "function"}, {"function", {{"name", "do_it"}, {"arguments", args}}}}})}}});
    std::string prompt = t.render(in);
    const std::string header = "<|turn>model\n";
    size_t start = prompt.rfind(header);
    ASSERT_NE(start, std::string::npos) << prompt;
    std::string generated = prompt.substr(start + header.size());
    ASSERT_EQ(generated.rfind("<|tool_call>call:do_it{", 0), 0u) << generated;

    mb::ParsedOutput p = mb::parse_gemma4_output(generated);
    ASSERT_EQ(p.tool_calls.size(), 1u) << generated;
    EXPECT_EQ(p.tool_calls[0].name, "do_it");
    // The template sorts keys, so compare as unordered JSON.
    EXPECT_EQ(nlohmann::json(p.tool_calls[0].arguments), nlohmann::json(args)) << generated;
    EXPECT_EQ(p.content, "");
    EXPECT_EQ(p.thinking, "");
  }
}

// Where this parser departs from transformers' response parser, on purpose:
// - text after a stop token is dropped (transformers returns "ignored" as the content here):
//   generation ends at the stop token, and a server that streams past it must not show it;
TEST(ChatParse, StopTokenEndsTheTurn) {
  mb::ParsedOutput p =
      mb::parse_gemma4_output("<|channel>thought\nStep 1.\nStep 2.\n<channel|>\n\nDone.<turn|>ignored");
  EXPECT_EQ(p.thinking, "Step 1.\nStep 2.");
  EXPECT_EQ(p.content, "Done.");
  EXPECT_TRUE(p.tool_calls.empty());
}

// - a malformed tool call is an error (transformers raises for the first and last, and keeps
//   the second as content): a client asked for a call, and should learn that it broke.
TEST(ChatParse, MalformedToolCallsThrow) {
  EXPECT_THROW(mb::parse_gemma4_output("<|tool_call>call:f{a:<|\"|>unterminated}<tool_call|>"), mb::Error);
  EXPECT_THROW(mb::parse_gemma4_output("<|tool_call>f{}<tool_call|>"), mb::Error);
  EXPECT_THROW(mb::parse_gemma4_output("<|tool_call>call:f{a:1<tool_call|>"), mb::Error);
  EXPECT_THROW(mb::parse_gemma4_tool_call("call:{}"), mb::Error);
}

// - values are the inverse of the template's format_argument, which writes None for null (see
//   RoundTripThroughTemplate; transformers cannot parse None), nested at most 512 levels (deeper
//   was a stack overflow found by tools/fuzz.sh).
TEST(ChatParse, DeepValuesAreAnErrorNotAStackOverflow) {
  for (const char* open : {"[", "{a:"}) {
    std::string deep;
    for (int i = 0; i < 100000; ++i) deep += open;
    EXPECT_THROW(mb::parse_gemma4_value(deep), mb::Error) << open;
    EXPECT_THROW(mb::parse_gemma4_output("<|tool_call>call:f{a:" + deep + "<tool_call|>"), mb::Error) << open;
  }
  std::string ok = "{a:", close = "}";
  for (int i = 0; i < 500; ++i) ok += "[", close = "]" + close;
  EXPECT_EQ(nlohmann::json(mb::parse_gemma4_value(ok + close)).dump().size(), 1000u + 6u);
}

// A conversation nested deeper than a render accepts is refused before anything copies it.
TEST(ChatTemplate, DeepMessagesAreAnError) {
  Json deep = "x";
  for (int i = 0; i < 1000; ++i) deep = Json::array({deep});
  mb::ChatTemplateInputs in;
  in.messages = Json::array({{{"role", "user"}, {"content", deep}}});
  try {
    fixture_template("gemma-4-31B-it.jinja").render(in);
    ADD_FAILURE() << "rendered";
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested more than 512 levels"), std::string::npos) << e.what();
  }
}

}  // namespace
