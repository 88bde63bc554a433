// Bad model files give a clear error naming the file/tensor and a non-zero exit, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "models/checkpoint.h"
#include "formats/safetensors.h"
#include "test_util.h"

#include <cmath>
#include <cstring>

#include "markbase/markbase.h"

namespace fs = std::filesystem;
using mbtest::run_cli;

namespace {

std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_file(const std::string& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// A copy of a fixture checkpoint whose model.safetensors the test then damages.
std::string copy_fixture(const std::string& name, const std::string& tag) {
  std::string dir = mbtest::temp_dir(tag);
  for (auto& e : fs::directory_iterator(mbtest::fixture(name)))
    if (e.path().extension() == ".json" || e.path().extension() == ".safetensors")
      fs::copy_file(e.path(), fs::path(dir) / e.path().filename());
  return dir;
}

// Splits a safetensors file into (header json, data).
std::pair<nlohmann::json, std::string> split(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
}
std::string join(const nlohmann::json& h, const std::string& data) {
  std::string hs = h.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((hs.size() >> (8 * i)) & 0xff);
  return out + hs + data;
}

void expect_cli_error(const std::string& dir, const std::vector<std::string>& needles) {
  auto r = run_cli("logits -m " + dir + " --tokens 2,3,4 -o " + dir + "/out.bin");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("error:"), std::string::npos) << r.out;
  for (auto& n : needles) EXPECT_NE(r.out.find(n), std::string::npos) << "missing '" << n << "' in: " << r.out;
}

const char* kName = "dense_kv";

TEST(Loading, MissingPathAndFiles) {
  expect_cli_error("/nonexistent/model", {"does not exist"});
  std::string dir = mbtest::temp_dir("empty");
  expect_cli_error(dir, {"no config.json"});
  write_file(dir + "/config.json", read_file(mbtest::fixture(kName) + "/config.json"));
  expect_cli_error(dir, {"no model.safetensors"});
}

TEST(Loading, TruncatedFile) {
  std::string dir = copy_fixture(kName, "trunc");
  std::string f = dir + "/model.safetensors";
  std::string bytes = read_file(f);
  write_file(f, bytes.substr(0, bytes.size() - 1000));
  expect_cli_error(dir, {"model.safetensors", "outside the file", "truncated"});
  write_file(f, bytes.substr(0, 5));
  expect_cli_error(dir, {"truncated safetensors file"});
}

TEST(Loading, CorruptHeader) {
  std::string dir = copy_fixture(kName, "hdr");
  std::string f = dir + "/model.safetensors";
  std::string bytes = read_file(f);
  std::string big = bytes;
  big[7] = char(0x7f);  // header length far past the end
  write_file(f, big);
  expect_cli_error(dir, {"header length", "exceeds file size"});
  std::string garbage = bytes;
  garbage[8] = '#';  // not JSON any more
  write_file(f, garbage);
  expect_cli_error(dir, {"not valid JSON"});
}

TEST(Loading, OffsetsOutsideFileAndSizeMismatch) {
  std::string dir = copy_fixture(kName, "offs");
  std::string f = dir + "/model.safetensors";
  auto [h, data] = split(read_file(f));
  std::string victim = "model.norm.weight";
  ASSERT_TRUE(h.contains(victim));
  auto good = h[victim];
  h[victim]["data_offsets"][1] = data.size() + 4096;
  write_file(f, join(h, data));
  expect_cli_error(dir, {victim, "outside the file"});
  h[victim] = good;
  h[victim]["dtype"] = "BF16";  // same bytes, wrong dtype: sizes disagree
  write_file(f, join(h, data));
  expect_cli_error(dir, {victim, "need"});
  h[victim] = good;
  h[victim]["dtype"] = "F8_E4M3";
  write_file(f, join(h, data));
  expect_cli_error(dir, {victim, "unsupported dtype"});
}

TEST(Loading, WrongShapeAndMissingTensor) {
  std::string dir = copy_fixture(kName, "shape");
  std::string f = dir + "/model.safetensors";
  auto [h, data] = split(read_file(f));
  std::string victim = "model.layers.0.self_attn.q_proj.weight";
  ASSERT_TRUE(h.contains(victim));
  auto shape = h[victim]["shape"];
  auto orig = h[victim];
  h[victim]["shape"] = {shape[1], shape[0]};  // transposed: same bytes, wrong shape
  write_file(f, join(h, data));
  expect_cli_error(dir, {victim, "has shape", "expected"});
  h[victim] = orig;
  h.erase("model.layers.1.mlp.down_proj.weight");
  write_file(f, join(h, data));
  expect_cli_error(dir, {"missing tensor", "model.layers.1.mlp.down_proj.weight"});
}

TEST(Loading, UnknownArchitectureAndBadConfig) {
  std::string dir = copy_fixture(kName, "arch");
  auto cfg = mbtest::read_json(dir + "/config.json");
  auto good = cfg;
  cfg["architectures"] = {"LlamaForCausalLM"};
  cfg["model_type"] = "llama";
  write_file(dir + "/config.json", cfg.dump());
  expect_cli_error(dir, {"unknown architecture", "LlamaForCausalLM"});
  cfg = good;
  cfg["num_hidden_layers"] = "twelve";
  write_file(dir + "/config.json", cfg.dump());
  expect_cli_error(dir, {"num_hidden_layers", "wrong type"});
  write_file(dir + "/config.json", "{ not json");
  expect_cli_error(dir, {"config.json", "invalid JSON"});
}

TEST(Loading, BadTokensAndPrompts) {
  std::string m = mbtest::fixture(kName);
  auto r = run_cli("logits -m " + m + " --tokens 2,999999 -o /tmp/x.bin");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("outside the vocabulary"), std::string::npos) << r.out;
  r = run_cli("generate -m " + m + " --tokens 2,,3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("--tokens"), std::string::npos) << r.out;
  r = run_cli("generate -m " + m + " --tokens 2,abc");
  EXPECT_EQ(r.exit_code, 1);
  r = run_cli("generate -m " + m + " --tokens -5");
  EXPECT_NE(r.exit_code, 0);
  r = run_cli("generate -m " + m);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("-p TEXT or --tokens"), std::string::npos) << r.out;
}

TEST(Loading, OversizedPromptIsRejected) {
  auto cfg_dir = copy_fixture(kName, "ctx");
  auto cfg = mbtest::read_json(cfg_dir + "/config.json");
  cfg["max_position_embeddings"] = 8;
  write_file(cfg_dir + "/config.json", cfg.dump());
  auto r = run_cli("generate -m " + cfg_dir + " --tokens 2,3,4,5,6,7,8,9,10,11 -n 2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("context size"), std::string::npos) << r.out;
}

TEST(Loading, SkipsMultimodalTowersForText) {
  auto ck = mb::open_checkpoint(mbtest::fixture("e2b_like"));
  bool any_tower = false;
  for (auto& [name, e] : ck->tensors.entries())
    if (name.find("vision") != std::string::npos || name.find("audio") != std::string::npos) any_tower = true;
  EXPECT_FALSE(any_tower);
  EXPECT_EQ(ck->config.tensor_prefix, "model.language_model.");
}

TEST(Loading, ShardedCheckpoint) {
  auto ck = mb::open_checkpoint(mbtest::fixture("moe_like"));
  EXPECT_TRUE(ck->config.moe);
  EXPECT_NE(ck->tensors.describe_sources().find("more shard"), std::string::npos);
}

}  // namespace

namespace {

// An F16 copy of a checkpoint, converted here, runs and lands closer to the f32 reference than
// bf16 weights do (f16 keeps 3 more mantissa bits).
TEST(Loading, F16CheckpointRuns) {
  std::string dir = copy_fixture(kName, "f16");
  std::string f = dir + "/model.safetensors";
  auto [h, data] = split(read_file(f));
  nlohmann::json out_h = nlohmann::json::object();
  std::string out_data;
  for (auto& [name, info] : h.items()) {
    if (name == "__metadata__") continue;
    size_t b = info["data_offsets"][0], e = info["data_offsets"][1];
    std::string bytes = data.substr(b, e - b);
    std::string conv(bytes.size() / 2, '\0');
    for (size_t i = 0; i < bytes.size() / 4; ++i) {
      float v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      uint16_t hv = mb::f32_to_f16(v);
      std::memcpy(conv.data() + 2 * i, &hv, 2);
    }
    out_h[name] = {{"dtype", "F16"}, {"shape", info["shape"]},
                   {"data_offsets", {out_data.size(), out_data.size() + conv.size()}}};
    out_data += conv;
  }
  write_file(f, join(out_h, out_data));
  auto ref = mbtest::read_json(mbtest::fixture(kName) + "/reference.json");
  auto& p = ref["prompts"][1];
  markbase::EngineOptions o;
  o.model_path = dir;
  auto engine = markbase::Engine::open(o);
  auto logits = engine->prompt_logits(p["tokens"].get<std::vector<int32_t>>());
  auto want = mbtest::read_f32(mbtest::fixture(kName) + "/" + p["logits_file"].get<std::string>());
  auto bf16w = mbtest::read_f32(mbtest::fixture(kName) + "/exact_bf16w_" + p["logits_file"].get<std::string>());
  float err = 0, bf16_err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(logits[i]));
    err = std::max(err, std::fabs(logits[i] - want[i]));
    bf16_err = std::max(bf16_err, std::fabs(bf16w[i] - want[i]));
  }
  EXPECT_GT(err, 0.f);  // it really ran on the converted weights
  EXPECT_LT(err, bf16_err / 2);
}

}  // namespace
