// Conversions keep the model: for every fixture, from its Hugging Face folder and from a GGUF of
// it, `markbase quantize` to every type gives a file whose config (and `info`) is the source's,
// and a quantized file converted back to f32 runs exactly the model the quantized file runs.
// (A GGUF -> GGUF conversion once dropped Gemma 4's rope_freqs: the full layers lost their
// partial RoPE and the logits moved by ~0.6; the config check below catches that class of loss.)
#include <gtest/gtest.h>

#include <cmath>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/cpu/qmatmul.h"
#include "markbase/markbase.h"
#include "models/checkpoint.h"
#include "models/gguf_export.h"
#include "test_util.h"

namespace {

// Every field of the config that decides what the model computes (not how its files name it).
// `as_stored = false` leaves out the two fields a GGUF holds differently from an HF folder for
// the same model: stop ids (a GGUF adds the end-of-turn token, as llama.cpp reads it) and Gemma 3's
// (1 + w) norms (the GGUF stores 1 + w).
std::string fingerprint(const mb::ModelConfig& c, bool as_stored = true) {
  std::string s = fmt::format(
      "family {} hidden {} layers {} heads {} vocab {} window {} max_pos {} ple {}/{} shared {} moe {} {}/{}/{} "
      "eps {} softcap {}/{} scale {} vnorm {} tie {} bos {} pad {}\n",
      c.family, c.hidden_size, c.n_layers, c.n_heads, c.vocab_size, c.sliding_window, c.max_position, c.ple_dim,
      c.ple_vocab, c.n_kv_shared_layers, c.moe, c.n_experts, c.top_k_experts, c.moe_ffn_dim, c.rms_eps,
      c.final_logit_softcap, c.attn_logit_softcap, c.attn_scale, c.v_norm, c.tie_embeddings, c.bos_id, c.pad_id);
  if (as_stored) s += fmt::format("add1 {} eos {} {}\n", c.norm_adds_one, c.eos_id, fmt::join(c.eos_ids, ","));
  for (const mb::LayerConfig& L : c.layers)
    s += fmt::format("  {} hd {} kv {} v {} src {} ffn {} rope {}/{}/{}\n", L.kind == mb::AttnKind::Full ? "full" : "swa",
                     L.head_dim, L.n_kv_heads, L.has_v_proj, L.kv_source, L.ffn_dim, L.rope.theta,
                     L.rope.partial_rotary_factor, L.rope.linear_factor);
  return s;
}

// `markbase info` without the lines that name the file and its weights' dtype and size.
std::string info_body(const std::string& path) {
  auto r = mbtest::run_cli("info -m " + path);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  std::string body;
  size_t i = 0;
  while (i < r.out.size()) {
    size_t j = r.out.find('\n', i);
    if (j == std::string::npos) j = r.out.size();
    const std::string line = r.out.substr(i, j - i);
    if (line.rfind("path:", 0) != 0 && line.rfind("weights:", 0) != 0) body += line + "\n";
    i = j + 1;
  }
  return body;
}

struct ExactQuantMatmuls {
  bool prev = mb::cpu::set_quant_matmul_exact(true);
  ~ExactQuantMatmuls() { mb::cpu::set_quant_matmul_exact(prev); }
};

std::vector<float> logits_of(const std::string& path, const std::vector<int32_t>& tokens) {
  markbase::EngineOptions o;
  o.model_path = path;
  return markbase::Engine::open(o)->prompt_logits(tokens);
}

class GgufRoundTrip : public testing::TestWithParam<const char*> {};

TEST_P(GgufRoundTrip, EveryTypeFromEitherSourceKeepsTheModel) {
  const std::string name = GetParam(), hf = mbtest::fixture(name), dir = mbtest::temp_dir("roundtrip_" + name);
  const std::string gguf = dir + "/source.gguf";
  mb::export_gguf(*mb::open_checkpoint(hf), gguf, mb::QuantType::Keep);
  const std::string want = fingerprint(mb::open_checkpoint(gguf)->config);
  ASSERT_EQ(fingerprint(mb::open_checkpoint(gguf)->config, false), fingerprint(mb::open_checkpoint(hf)->config, false))
      << "HF folder -> GGUF (own dtypes)";
  const std::string gguf_info = info_body(gguf);

  const std::vector<int32_t> tokens = {2, 17, 44, 100, 7, 300, 12, 5, 9, 61, 3, 250};
  ExactQuantMatmuls exact;
  for (const std::string& source : {hf, gguf}) {
    const bool from_gguf = source == gguf;
    for (const char* type : {"f32", "bf16", "q8_0", "q4_0", "q4_k_m"}) {
      SCOPED_TRACE(fmt::format("{} from {} to {}", name, from_gguf ? "GGUF" : "HF folder", type));
      const std::string out = fmt::format("{}/{}_{}.gguf", dir, from_gguf ? "gguf" : "hf", type);
      auto r = mbtest::run_cli(fmt::format("quantize {} {} --type {}", source, out, type));
      ASSERT_EQ(r.exit_code, 0) << r.out;
      EXPECT_EQ(fingerprint(mb::open_checkpoint(out)->config), want);
      EXPECT_EQ(info_body(out), gguf_info);

      if (std::string(type) == "f32" || std::string(type) == "bf16") continue;
      // Back to f32: the model the quantized file runs, to the last bit of each weight. Except
      // where an embedding table stays 16-bit (rows that are not whole blocks keep the source's
      // float type): its scale sqrt(H) is rounded to the table's dtype, as transformers does, so
      // widening the table to f32 changes the model there as it does in transformers.
      auto ck = mb::open_checkpoint(out);
      bool sixteen_bit_table = false;
      for (const char* t : {"embed_tokens.weight", "embed_tokens_per_layer.weight"}) {
        const mb::TensorEntry* e = ck->tensors.find(ck->config.tensor_prefix + t);
        sixteen_bit_table |= e && (e->dtype == mb::DType::BF16 || e->dtype == mb::DType::F16);
      }
      if (sixteen_bit_table) continue;
      const std::string back = out + ".f32.gguf";
      r = mbtest::run_cli(fmt::format("quantize {} {} --type f32", out, back));
      ASSERT_EQ(r.exit_code, 0) << r.out;
      EXPECT_EQ(fingerprint(mb::open_checkpoint(back)->config), want);
      const auto a = logits_of(out, tokens), b = logits_of(back, tokens);
      ASSERT_EQ(a.size(), b.size());
      float worst = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_TRUE(std::isfinite(a[i]) && std::isfinite(b[i])) << "logit " << i;
        worst = std::max(worst, std::fabs(a[i] - b[i]));
      }
      EXPECT_LE(worst, 1e-4f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GgufRoundTrip,
                         testing::Values("e2b_like", "moe_like", "dense_kv", "dense_kv_bf16", "unified_like",
                                         "gemma3_like"));

}  // namespace
