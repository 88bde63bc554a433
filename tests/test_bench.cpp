// `markbase bench`: synthetic weights built in block dtypes, --save writing them as a GGUF that
// loads back to the same weights and logits, the JSON keys, and -m with --dtype requantizing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include "backends/backend.h"
#include "core/quant.h"
#include "models/checkpoint.h"
#include "formats/gguf.h"
#include "markbase/markbase.h"
#include "models/model.h"
#include "models/gemma4/synthetic.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;

std::string shared_tokenizer() { return mbtest::shared_dir() + "/data/tokenizer/gemma4-tokenizer.json"; }

// The JSON lines of bench's output (stderr is mixed in by run_cli).
std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> rows;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') rows.push_back(nlohmann::json::parse(line));
  return rows;
}

std::vector<float> prompt_logits(const std::shared_ptr<const mb::Checkpoint>& ck, const std::vector<int32_t>& toks) {
  auto be = mb::make_cpu_backend();
  auto model = mb::load_model(ck, *be, {});  // keep each tensor's own dtype
  mb::KVCache kv(ck->config, *be, {1, 64, 16});
  mb::Batch b;
  b.tokens = toks;
  for (size_t i = 0; i < toks.size(); ++i) {
    b.positions.push_back(int32_t(i));
    b.logit_rows.push_back(int32_t(i));
  }
  b.seqs.push_back({0, 0, int64_t(toks.size())});
  std::vector<float> out;
  model->forward(b, kv, out);
  return out;
}

// The synthetic tensor's name under the GGUF loader's HF naming ("model." prefix).
std::string gguf_side_name(const mb::Checkpoint& synth, const std::string& name) {
  return "model." + name.substr(synth.config.tensor_prefix.size());
}

TEST(Synthetic, BlockDtypesQuantizeTheF32WeightsRowByRow) {
  auto f32 = mb::make_synthetic_checkpoint("tiny", mb::DType::F32);
  for (mb::DType dt : {mb::DType::Q8_0, mb::DType::Q4_0, mb::DType::Q4_K}) {
    auto q = mb::make_synthetic_checkpoint("tiny", dt);
    ASSERT_EQ(q->tensors.entries().size(), f32->tensors.entries().size());
    int quantized = 0, bf16 = 0;
    for (auto& [name, e] : q->tensors.entries()) {
      const mb::TensorEntry* ref = f32->tensors.find(name);
      ASSERT_NE(ref, nullptr) << name;
      ASSERT_EQ(e.shape, ref->shape) << name;
      const int64_t cols = e.shape.back(), rows = int64_t(ref->nbytes / 4) / cols;
      if (e.shape.size() == 1) {
        EXPECT_EQ(e.dtype, mb::DType::F32) << name;  // norms and scalars
        EXPECT_EQ(std::memcmp(e.data, ref->data, e.nbytes), 0) << name;
        continue;
      }
      // Rows that are not whole blocks stay BF16, as llama.cpp leaves them.
      const mb::DType want = cols % mb::dtype_block_size(dt) == 0 ? dt : mb::DType::BF16;
      ASSERT_EQ(e.dtype, want) << name << " " << mb::dtype_name(dt);
      ASSERT_EQ(e.dtype, mb::synthetic_matrix_dtype(dt, cols));
      (want == dt ? quantized : bf16)++;
      ASSERT_EQ(e.nbytes, mb::dtype_row_bytes(e.dtype, cols) * size_t(rows)) << name;
      // First, middle and last rows: exactly quantize_row of the f32 model's row.
      std::vector<uint8_t> expect(mb::dtype_row_bytes(e.dtype, cols));
      for (int64_t r : {int64_t(0), rows / 2, rows - 1}) {
        const float* src = reinterpret_cast<const float*>(ref->data) + r * cols;
        mb::quantize_row(e.dtype, src, expect.data(), cols);
        ASSERT_EQ(std::memcmp(e.data + size_t(r) * expect.size(), expect.data(), expect.size()), 0)
            << name << " row " << r << " " << mb::dtype_name(dt);
      }
    }
    EXPECT_GT(quantized, 0) << mb::dtype_name(dt);
    EXPECT_GT(bf16, 0) << mb::dtype_name(dt);  // tiny has PLE rows of 8 (and, for Q4_K, of 64)
  }
  // Embedding and PLE tables are in the block type too when their rows fit.
  auto q4 = mb::make_synthetic_checkpoint("tiny", mb::DType::Q4_0);
  const std::string p = q4->config.tensor_prefix;
  EXPECT_EQ(q4->tensors.find(p + "embed_tokens.weight")->dtype, mb::DType::Q4_0);
  EXPECT_EQ(q4->tensors.find(p + "embed_tokens_per_layer.weight")->dtype, mb::DType::Q4_0);
  EXPECT_EQ(q4->tensors.find(p + "layers.0.per_layer_projection.weight")->dtype, mb::DType::BF16);
  // The quantized models run and stay finite.
  for (mb::DType dt : {mb::DType::Q8_0, mb::DType::Q4_K}) {
    auto logits = prompt_logits(mb::make_synthetic_checkpoint("tiny", dt), {2, 10, 20, 30, 40});
    for (float v : logits) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(Bench, SyntheticSaveLoadsBackToTheSameModel) {
  if (!fs::exists(shared_tokenizer())) GTEST_SKIP() << shared_tokenizer() << " is absent";
  const std::string dir = mbtest::temp_dir("bench_save");
  const std::string out = dir + "/tiny_q4_0.gguf";
  auto r = mbtest::run_cli("bench --synthetic tiny --dtype q4_0 --pp 8 --tg 4 --reps 1 --batch 1,2 --threads 2 --json --save " +
                           out);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 2u) << r.out;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& j = rows[i];
    for (const char* k : {"model", "dtype", "threads", "batch", "pp", "tg", "pp_tokens_per_s", "tg_tokens_per_s",
                          "weight_bytes_per_token", "isa", "peak_rss_bytes", "weight_bytes", "kv_bytes",
                          "quant_matmul"})
      ASSERT_TRUE(j.contains(k)) << k << " in " << j.dump();
    EXPECT_EQ(j["model"], "tiny");
    EXPECT_EQ(j["dtype"], "q4_0");
    EXPECT_EQ(j["threads"], 2);
    EXPECT_EQ(j["batch"], int(i) + 1);
    EXPECT_EQ(j["pp"], 8);
    EXPECT_EQ(j["tg"], 4);
    EXPECT_GT(j["pp_tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["tg_tokens_per_s"].get<double>(), 0);
    const std::string isa = j["isa"];
    EXPECT_TRUE(isa == "scalar" || isa == "avx2" || isa == "avx512") << isa;
    EXPECT_NE(r.out.find(isa + " kernels"), std::string::npos) << r.out;  // in the stderr header
    const std::string qm = j["quant_matmul"];
    EXPECT_TRUE(qm == "int8" || qm == "exact") << qm;
    const double wb = j["weight_bytes"], kv = j["kv_bytes"], rss = j["peak_rss_bytes"];
    EXPECT_GT(kv, 0);
    EXPECT_GE(rss, wb);
    EXPECT_GT(wb, j["weight_bytes_per_token"].get<double>() * 0.99);  // plus the PLE table
  }
  EXPECT_GT(rows[1]["kv_bytes"].get<double>(), rows[0]["kv_bytes"].get<double>());  // two KV slots

  // The file: the same tensors, byte for byte, and the Gemma 4 tokenizer llama.cpp asks for.
  std::shared_ptr<const mb::Checkpoint> saved = mb::open_checkpoint(out);
  std::shared_ptr<const mb::Checkpoint> synth = mb::make_synthetic_checkpoint("tiny", mb::DType::Q4_0);
  ASSERT_TRUE(saved->gguf);
  EXPECT_EQ(saved->gguf->get("general.architecture").as_string(), "gemma4");
  EXPECT_EQ(saved->gguf->get("tokenizer.ggml.model").as_string(), "gemma4");
  EXPECT_EQ(saved->gguf->get("tokenizer.ggml.tokens").size(), 262144u);
  EXPECT_GT(saved->gguf->get("tokenizer.ggml.merges").size(), 0u);
  EXPECT_EQ(saved->tensors.entries().size(), synth->tensors.entries().size());
  for (auto& [name, e] : synth->tensors.entries()) {
    const mb::TensorEntry* g = saved->tensors.find(gguf_side_name(*synth, name));
    ASSERT_NE(g, nullptr) << name;
    EXPECT_EQ(g->dtype, e.dtype) << name;
    EXPECT_EQ(g->shape, e.shape) << name;
    ASSERT_EQ(g->nbytes, e.nbytes) << name;
    EXPECT_EQ(std::memcmp(g->data, e.data, e.nbytes), 0) << name;
  }
  EXPECT_EQ(saved->tensors.find("model.embed_tokens.weight")->dtype, mb::DType::Q4_0);
  EXPECT_EQ(saved->tensors.find("model.embed_tokens_per_layer.weight")->dtype, mb::DType::Q4_0);
  EXPECT_EQ(saved->tensors.find("model.layers.1.per_layer_projection.weight")->dtype, mb::DType::BF16);
  EXPECT_EQ(saved->tensors.find("model.norm.weight")->dtype, mb::DType::F32);

  // Same weights, same config: the same prompt logits, bit for bit.
  const std::vector<int32_t> toks = {2, 651, 6037, 11, 9999, 262143, 17, 5, 300, 41};
  auto a = prompt_logits(synth, toks), b = prompt_logits(saved, toks);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), toks.size() * 262144u);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;

  // The engine reads the file's tokenizer.
  markbase::EngineOptions o;
  o.model_path = out;
  auto eng = markbase::Engine::open(o);
  ASSERT_TRUE(eng->has_tokenizer());
  EXPECT_FALSE(eng->tokenize("Hello world", false).empty());

  // -m with a block --dtype requantizes at load; auto keeps the file's types.
  r = mbtest::run_cli("bench -m " + out + " --dtype q8_0 --pp 4 --tg 2 --reps 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto q8 = json_lines(r.out);
  ASSERT_EQ(q8.size(), 1u) << r.out;
  EXPECT_EQ(q8[0]["dtype"], "q8_0");
  r = mbtest::run_cli("bench -m " + out + " --pp 4 --tg 2 --reps 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto keep = json_lines(r.out);
  ASSERT_EQ(keep.size(), 1u) << r.out;
  EXPECT_GT(q8[0]["weight_bytes"].get<double>(), keep[0]["weight_bytes"].get<double>());
  // ... and -m --save writes what it converted to, or says why it cannot.
  r = mbtest::run_cli("bench -m " + out + " --dtype q8_0 --pp 0 --tg 0 --save " + dir + "/q8.gguf");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(mb::open_checkpoint(dir + "/q8.gguf")->tensors.find("model.layers.0.mlp.up_proj.weight")->dtype,
            mb::DType::Q8_0);
  r = mbtest::run_cli("bench -m " + out + " --dtype q4_k --pp 0 --tg 0 --save " + dir + "/q4k.gguf");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("cannot write the converted model"), std::string::npos) << r.out;
  r = mbtest::run_cli("bench -m " + out + " --pp 0 --tg 0 --save " + out);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("must not overwrite"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

// --dtype converts an f32 file at load, through the engine that generate and logits run on: each
// block type changes the logits (the conversion happened) by no more than its precision allows,
// and every number stays finite.
TEST(Bench, EngineConvertsAtLoadToEachWeightDtype) {
  if (!fs::exists(shared_tokenizer())) GTEST_SKIP() << shared_tokenizer() << " is absent";
  const std::string dir = mbtest::temp_dir("engine_dtype");
  const std::string f32 = dir + "/tiny_f32.gguf";
  auto r = mbtest::run_cli("bench --synthetic tiny --dtype f32 --pp 0 --tg 0 --save " + f32);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::vector<int32_t> toks = {2, 651, 6037, 11, 9999, 262143, 17, 5, 300, 41};
  std::map<std::string, std::vector<float>> logits;
  for (const char* dt : {"auto", "f32", "bf16", "f16", "q8_0", "q4_0", "q4_k"}) {
    markbase::EngineOptions o;
    o.model_path = f32;
    o.dtype = dt;
    auto eng = markbase::Engine::open(o);
    logits[dt] = eng->prompt_logits(toks, 0);
    ASSERT_EQ(logits[dt].size(), toks.size() * 262144u) << dt;
    for (float v : logits[dt]) ASSERT_TRUE(std::isfinite(v)) << dt;
  }
  EXPECT_EQ(logits["auto"], logits["f32"]);  // an f32 file: both keep its numbers
  // Error relative to the f32 logits' RMS.
  auto rel = [&](const std::string& dt) {
    const std::vector<float>&a = logits[dt], &b = logits["f32"];
    double d2 = 0, b2 = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      d2 += double(a[i] - b[i]) * (a[i] - b[i]);
      b2 += double(b[i]) * b[i];
    }
    return std::sqrt(d2 / b2);
  };
  std::map<std::string, double> err;
  for (const char* dt : {"bf16", "f16", "q8_0", "q4_0", "q4_k"}) {
    err[dt] = rel(dt);
    std::printf("[ figure ] --dtype %s: RMS of the logits' change %.3g of their RMS\n", dt, err[dt]);
    EXPECT_GT(err[dt], 0.0) << dt;
  }
  EXPECT_LT(err["f16"], err["bf16"]);   // 10 mantissa bits against 7
  EXPECT_LT(err["bf16"], err["q8_0"]);
  EXPECT_LT(err["q8_0"], err["q4_0"]);
  EXPECT_LT(err["q4_0"], 0.5);
  // tiny's only rows of whole 256-blocks are the KV-shared layers' down projections: the others
  // stay f32, so q4_k changes less than q4_0 does.
  EXPECT_LT(err["q4_k"], err["q4_0"]);
  // The CLI takes the same names, and names them when given another.
  r = mbtest::run_cli("generate -m " + f32 + " --tokens 2,651,6037 -n 3 --dtype q4_k --print-ids");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  r = mbtest::run_cli("generate -m " + f32 + " --tokens 2,651 -n 1 --dtype q3_k");
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("q4_k"), std::string::npos) << r.out;
  markbase::EngineOptions bad;
  bad.model_path = f32;
  bad.dtype = "q3_k";
  try {
    markbase::Engine::open(bad);
    ADD_FAILURE() << "--dtype q3_k was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("f32, bf16, f16, q8_0, q4_0, q4_k"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Bench, SaveOnlyAndMissingTokenizer) {
  const std::string dir = mbtest::temp_dir("bench_save_err");
  // No tokenizer: a clear error naming the file, and no file (or leftover .part) written.
  auto r = mbtest::run_cli("bench --synthetic tiny --dtype q4_0 --pp 0 --tg 0 --save " + dir +
                           "/x.gguf --tokenizer /nonexistent/gemma4-tokenizer.json");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/gemma4-tokenizer.json"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir + "/x.gguf"));
  EXPECT_FALSE(fs::exists(dir + "/x.gguf.part"));
  r = mbtest::run_cli("bench --synthetic tiny --dtype q4_k --pp 0 --tg 0");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  r = mbtest::run_cli("bench --synthetic tiny --dtype q3_k --pp 1 --tg 1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("q4_k"), std::string::npos) << r.out;
  if (fs::exists(shared_tokenizer())) {
    // --pp 0 --tg 0 with --save: save only, no table.
    r = mbtest::run_cli("bench --synthetic tiny --dtype q4_k --pp 0 --tg 0 --json --save " + dir + "/k.gguf");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_TRUE(json_lines(r.out).empty()) << r.out;
    auto ck = mb::open_checkpoint(dir + "/k.gguf");
    EXPECT_EQ(ck->tensors.find("model.layers.2.mlp.down_proj.weight")->dtype, mb::DType::Q4_K);  // rows of 256
    EXPECT_EQ(ck->tensors.find("model.layers.0.mlp.down_proj.weight")->dtype, mb::DType::BF16);  // rows of 128
  }
  fs::remove_all(dir);
}

// --temperature (and top-k/top-p/min-p) decodes by sampling, said in the JSON; bad values are refused.
TEST(Bench, SampledDecode) {
  auto r = mbtest::run_cli("bench --synthetic tiny --pp 4 --tg 3 --reps 1 --batch 1,2 --threads 2 --json "
                           "--temperature 0.8 --top-k 5 --top-p 0.9 --min-p 0.05");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 2u) << r.out;
  for (const auto& row : rows) {
    EXPECT_GT(double(row["tg_tokens_per_s"]), 0) << r.out;
    EXPECT_EQ(row["sampling"]["top_k"], 5) << r.out;
  }
  r = mbtest::run_cli("bench --synthetic tiny --pp 4 --tg 3 --reps 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_FALSE(json_lines(r.out).at(0).contains("sampling")) << r.out;
  r = mbtest::run_cli("bench --synthetic tiny --pp 4 --tg 3 --temperature 1 --top-p 1.5");
  EXPECT_NE(r.exit_code, 0) << r.out;
}

TEST(Bench, MembwProbeReportsItsBufferAndRefusesOneTheCachesHold) {
  auto r = mbtest::run_cli("bench --membw --membw-mb 64 --threads 2 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 1u) << r.out;
  EXPECT_EQ(rows[0]["membw_mb"], 64);
  EXPECT_EQ(rows[0]["threads"], 2);
  const double best = rows[0]["membw_gb_per_s"], median = rows[0]["membw_median_gb_per_s"];
  EXPECT_TRUE(std::isfinite(best) && std::isfinite(median) && median > 0 && best >= median) << r.out;
  r = mbtest::run_cli("bench --membw --membw-mb 10");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("--membw-mb must be at least 64"), std::string::npos) << r.out;
}

}  // namespace
