// The architecture registry (src/models/architecture.h): configs find their architecture, files
// are told apart by content rather than by name, and text conventions come from the architecture.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "formats/gguf.h"
#include "models/architecture.h"
#include "models/checkpoint.h"
#include "models/gguf_export.h"
#include "runtime/text.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;

TEST(Registry, EveryFixtureFindsItsArchitecture) {
  for (auto [fixture, arch] : {std::pair{"e2b_like", "gemma4"}, {"moe_like", "gemma4"}, {"dense_kv", "gemma4"},
                               {"unified_like", "gemma4"}, {"gemma3_like", "gemma3"}}) {
    EXPECT_EQ(mb::model_architecture(mbtest::fixture(fixture)).name(), arch) << fixture;
    EXPECT_EQ(mb::open_checkpoint(mbtest::fixture(fixture))->config.family, arch) << fixture;
  }
  nlohmann::json unknown = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}};
  try {
    mb::architecture_for_hf_config(unknown, "config.json");
    FAIL() << "no error";
  } catch (const mb::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("LlamaForCausalLM"), std::string::npos) << m;
    EXPECT_NE(m.find("Gemma4ForConditionalGeneration"), std::string::npos) << m;
    EXPECT_NE(m.find("Gemma3ForCausalLM"), std::string::npos) << m;
  }
  EXPECT_THROW(mb::architecture_named("llama"), mb::Error);
}

TEST(Registry, GgufFilesAreRecognisedByContentNotByName) {
  const std::string dir = mbtest::temp_dir("by_content");
  const std::string gguf = dir + "/model.gguf";
  mb::export_gguf(*mb::open_checkpoint(mbtest::fixture("e2b_like")), gguf, mb::QuantType::Keep);
  for (const char* name : {"out.bin", "UPPER.GGUF", "no_extension"}) {
    const std::string p = dir + "/" + name;
    fs::copy_file(gguf, p);
    EXPECT_TRUE(mb::is_gguf_file(p));
    EXPECT_EQ(mb::open_checkpoint(p)->config.family, "gemma4") << name;
    auto r = mbtest::run_cli("info -m " + p);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.out;
    r = mbtest::run_cli("tokenize -m " + p + " --text hello");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.out;
  }
  // A file named .gguf that is not one, and a file inside a checkpoint folder, say what they are.
  const std::string fake = dir + "/fake.gguf";
  std::ofstream(fake) << "not a model";
  EXPECT_FALSE(mb::is_gguf_file(fake));
  EXPECT_FALSE(mb::is_gguf_file(dir));
  try {
    mb::open_checkpoint(fake);
    FAIL() << "no error";
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a GGUF file"), std::string::npos) << e.what();
  }
  try {
    mb::open_checkpoint(mbtest::fixture("e2b_like") + "/config.json");
    FAIL() << "no error";
  } catch (const mb::Error& e) {
    EXPECT_NE(std::string(e.what()).find("give the checkpoint folder"), std::string::npos) << e.what();
  }
}

// Stop tokens come from the model's architecture, not from guessing by the vocabulary.
TEST(Registry, StopTokensFollowTheArchitecture) {
  const auto g4 = mb::TextCodec::load(mbtest::fixture("e2b_like"));
  const auto g3 = mb::TextCodec::load(mbtest::fixture("gemma3_like"));
  auto has = [](const mb::TextCodec& c, std::string_view tok) {
    const int32_t id = c.tokenizer().find_token(tok);
    const auto ids = c.stop_ids({});
    return id >= 0 && std::find(ids.begin(), ids.end(), id) != ids.end();
  };
  EXPECT_TRUE(has(g4, "<turn|>"));
  EXPECT_TRUE(has(g3, "<end_of_turn>"));
  // The same tokenizer under the other architecture stops where that architecture says.
  const auto g4_as_g3 = mb::TextCodec::load(mbtest::fixture("e2b_like"), mb::architecture_named("gemma3"));
  EXPECT_FALSE(has(g4_as_g3, "<turn|>"));
}

}  // namespace
