// The OpenAI adapter without HTTP (src/server/openai.h): request checking and how a reply's text,
// arriving in pieces cut anywhere, becomes chat deltas. The HTTP side is tests/server (Python).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "server/openai.h"

namespace {

using mb::server::ChoiceOutput;
using mb::server::Json;

struct Streamed {
  std::string content, reasoning;
  std::vector<Json> tool_calls;
};

// Feeds `text` to a choice in pieces of `step` bytes and collects every delta.
Streamed stream(const std::string& text, size_t step, Json* final_message = nullptr) {
  ChoiceOutput c(/*parse_markup=*/true);
  Streamed s;
  auto take = [&](const Json& d) {
    for (const auto& [k, v] : d.items()) {
      if (k == "content") s.content += v.get<std::string>();
      else if (k == "reasoning_content") s.reasoning += v.get<std::string>();
      else if (k == "tool_calls") s.tool_calls.insert(s.tool_calls.end(), v.begin(), v.end());
      else ADD_FAILURE() << "unexpected delta field " << k;
    }
  };
  for (size_t i = 0; i < text.size(); i += step) {
    mb::StreamEvent e;
    e.text = text.substr(i, step);
    c.add(e);
    take(c.chat_delta());
  }
  mb::StreamEvent last;
  last.finish_reason = "stop";
  c.add(last);
  take(c.chat_delta());
  if (final_message) *final_message = c.message();
  return s;
}

TEST(ServerStream, DeltasAddUpToTheParsedReplyWhereverTheTextIsCut) {
  const std::string reply =
      "<|channel>thought\nThe user wants the time.<channel|>Let me check <|tool_call>call:get_time{tz:<|\"|>UTC"
      "<|\"|>}<tool_call|> and <|tool_call>call:get_date{}<tool_call|>done.<turn|>";
  for (size_t step = 1; step <= reply.size(); ++step) {
    Json message;
    const Streamed s = stream(reply, step, &message);
    SCOPED_TRACE(step);
    EXPECT_EQ(s.reasoning, "The user wants the time.");
    EXPECT_EQ(s.content, "Let me check  and done.");  // no markup ever reaches the content
    ASSERT_EQ(s.tool_calls.size(), 2u);
    EXPECT_EQ(s.tool_calls[0]["index"], 0);
    EXPECT_EQ(s.tool_calls[0]["function"]["name"], "get_time");
    EXPECT_EQ(Json::parse(s.tool_calls[0]["function"]["arguments"].get<std::string>()), Json({{"tz", "UTC"}}));
    EXPECT_EQ(s.tool_calls[1]["function"]["name"], "get_date");
    // The whole message says the same, with the same call ids.
    EXPECT_EQ(message["content"], s.content);
    EXPECT_EQ(message["reasoning_content"], s.reasoning);
    EXPECT_EQ(message["tool_calls"][1]["id"], s.tool_calls[1]["id"]);
  }
}

TEST(ServerStream, PlainTextAndAMalformedCall) {
  EXPECT_EQ(stream("Just an answer, with < and <| in it.", 3).content, "Just an answer, with < and <| in it.");
  // A tool call the parser cannot read is returned as written, not dropped.
  Json message;
  stream("<|tool_call>call:broken{x:<tool_call|>", 4, &message);
  EXPECT_EQ(message["content"], "<|tool_call>call:broken{x:<tool_call|>");
  EXPECT_FALSE(message.contains("tool_calls"));
}

TEST(ServerRequest, BodiesAndFieldsAreChecked) {
  using mb::server::ApiError;
  EXPECT_THROW(mb::server::parse_body("{\"a\": \"\xff\"}"), ApiError);
  EXPECT_THROW(mb::server::parse_body("[1]"), ApiError);
  EXPECT_EQ(mb::server::parse_body("{\"a\": 1}")["a"], 1);
  mb::server::ModelInfo m;
  m.name = "m";
  m.max_context = 64;
  m.vocab_size = 100;
  try {
    mb::server::parse_completion_request(Json{{"prompt", {1, 2, 3}}, {"top_p", 0}}, m);
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.body()["error"]["param"], "top_p");
  }
  try {
    mb::server::parse_completion_request(Json{{"prompt", {1}}, {"model", "other"}}, m);
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 404);
    EXPECT_EQ(e.body()["error"]["code"], "model_not_found");
  }
  const auto r = mb::server::parse_completion_request(
      Json{{"prompt", {1, 2}}, {"max_tokens", 500}, {"seed", -1}, {"stop", "x"}, {"logit_bias", {{"7", -100}}}}, m);
  EXPECT_EQ(r.gen.max_tokens, 62);  // capped by the context
  EXPECT_EQ(*r.gen.seed, ~uint64_t(0));
  EXPECT_EQ(r.gen.stop, std::vector<std::string>{"x"});
  ASSERT_EQ(r.gen.logit_bias.size(), 1u);
  EXPECT_EQ(r.gen.logit_bias[0].first, 7);
  // A prompt with no room left to generate in is refused, naming OpenAI's code.
  try {
    mb::server::parse_completion_request(Json{{"prompt", std::vector<int>(64, 1)}}, m);
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.body()["error"]["code"], "context_length_exceeded");
  }
}

TEST(ServerMetrics, PrometheusBucketsAreCumulative) {
  mb::EngineMetrics m;
  m.ttft.observe(0.003);
  m.ttft.observe(0.2);
  m.ttft.observe(100);
  const std::string text = mb::server::prometheus_text(m, "a \"quoted\" name");
  const std::string labels = "{model_name=\"a \\\"quoted\\\" name\"";
  EXPECT_NE(text.find("markbase_time_to_first_token_seconds_bucket" + labels + ",le=\"0.005\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("le=\"0.25\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("markbase_time_to_first_token_seconds_count" + labels + "} 3\n"), std::string::npos);
}

}  // namespace
