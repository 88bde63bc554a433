#include "models/gemma4/synthetic.h"

#include <cmath>
#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/quant.h"
#include "core/splitmix64.h"
#include "core/thread_pool.h"
#include "models/hf_config.h"

namespace mb {

namespace {

using json = nlohmann::json;

json layer_types(int n, int period) {
  json t = json::array();
  for (int i = 0; i < n; ++i) t.push_back((i + 1) % period ? "sliding_attention" : "full_attention");
  return t;
}

json base_text(int H, int L, int period, int nh, int nkv, int I, int W, int max_pos) {
  return json{{"model_type", "gemma4_text"},
              {"hidden_size", H},
              {"num_hidden_layers", L},
              {"layer_types", layer_types(L, period)},
              {"num_attention_heads", nh},
              {"num_key_value_heads", nkv},
              {"head_dim", 256},
              {"global_head_dim", 512},
              {"intermediate_size", I},
              {"sliding_window", W},
              {"max_position_embeddings", max_pos},
              {"vocab_size", 262144},
              {"final_logit_softcapping", 30.0},
              {"rms_norm_eps", 1e-6},
              {"tie_word_embeddings", true},
              {"hidden_size_per_layer_input", 0},
              {"num_kv_shared_layers", 0},
              {"attention_k_eq_v", false},
              {"enable_moe_block", false}};
}

// Fast deterministic fill: splitmix64 per element index, so any thread split gives the same bits.
inline float uniform_pm1(uint64_t seed, uint64_t i) {
  const uint64_t z = splitmix64_mix(seed + i * kSplitmix64Gamma);
  return float(int64_t(z >> 40) - (int64_t(1) << 23)) * (1.f / float(1 << 23));
}

}  // namespace

const std::vector<std::string>& synthetic_model_names() {
  static const std::vector<std::string> names = {"e2b", "e4b", "12b", "26b-a4b", "31b", "tiny"};
  return names;
}

json synthetic_config_json(const std::string& name) {
  json t;
  std::string arch = "Gemma4ForConditionalGeneration";
  if (name == "e2b") {
    t = base_text(1536, 35, 5, 8, 1, 6144, 512, 131072);
    t["hidden_size_per_layer_input"] = 256;
    t["vocab_size_per_layer_input"] = 262144;
    t["num_kv_shared_layers"] = 20;
    t["use_double_wide_mlp"] = true;
  } else if (name == "e4b") {
    t = base_text(2560, 42, 6, 8, 2, 10240, 512, 131072);
    t["hidden_size_per_layer_input"] = 256;
    t["vocab_size_per_layer_input"] = 262144;
    t["num_kv_shared_layers"] = 18;
  } else if (name == "26b-a4b") {
    t = base_text(2816, 30, 6, 16, 8, 2112, 1024, 262144);
    t["attention_k_eq_v"] = true;
    t["num_global_key_value_heads"] = 2;
    t["enable_moe_block"] = true;
    t["num_experts"] = 128;
    t["top_k_experts"] = 8;
    t["moe_intermediate_size"] = 704;
  } else if (name == "31b") {
    t = base_text(5376, 60, 6, 32, 16, 21504, 1024, 262144);
    t["attention_k_eq_v"] = true;
    t["num_global_key_value_heads"] = 4;
  } else if (name == "12b") {
    t = base_text(3840, 48, 6, 16, 8, 15360, 1024, 262144);
    t["model_type"] = "gemma4_unified_text";
    t["attention_k_eq_v"] = true;
    t["num_global_key_value_heads"] = 1;
    arch = "Gemma4UnifiedForConditionalGeneration";
  } else if (name == "tiny") {
    // E2B's structure at toy width: sliding/full alternating (head dims 32/64), 2 KV-shared layers
    // with the double-wide MLP, PLE width 8 (rows of 8: not whole blocks, so those stay BF16).
    t = base_text(64, 4, 2, 2, 1, 128, 16, 4096);
    t["head_dim"] = 32;
    t["global_head_dim"] = 64;
    t["hidden_size_per_layer_input"] = 8;
    t["vocab_size_per_layer_input"] = 262144;
    t["num_kv_shared_layers"] = 2;
    t["use_double_wide_mlp"] = true;
  } else {
    fail("unknown synthetic model '{}' (known: e2b, e4b, 12b, 26b-a4b, 31b, tiny)", name);
  }
  return json{{"architectures", {arch}}, {"text_config", t}, {"dtype", "bfloat16"}};
}

DType synthetic_matrix_dtype(DType dtype, int64_t cols) {
  if (!dtype_is_quantized(dtype)) return dtype;
  return cols % dtype_block_size(dtype) == 0 ? dtype : DType::BF16;
}

std::shared_ptr<Checkpoint> make_synthetic_checkpoint(const std::string& name, DType dtype, uint64_t seed) {
  MB_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16 || dtype_is_quantized(dtype),
           "synthetic weights cannot be {}", dtype_name(dtype));
  auto ck = std::make_shared<Checkpoint>();
  ck->path = "synthetic:" + name;
  ck->config = parse_hf_config(synthetic_config_json(name), ck->path);
  ck->config.tensor_prefix = "model.language_model.";
  const ModelConfig& c = ck->config;
  const int64_t H = c.hidden_size, V = c.vocab_size, P = c.ple_dim, NL = c.n_layers;
  uint64_t tensor_seed = seed;

  // std: 1/sqrt(fan_in) for matrices (uniform in ±sqrt(3)·std), ~1 for norms; so every layer's
  // activations stay O(1) and no path produces inf/NaN however long the bench runs.
  // Element i of a tensor is centre + amp * uniform_pm1(s, i) whatever its dtype: a quantized
  // model's weights are the f32 model's, rounded by its block format.
  auto add = [&](const std::string& n, std::vector<int64_t> shape, bool matrix, float centre = 0.f) {
    const DType dt = matrix ? synthetic_matrix_dtype(dtype, shape.back()) : DType::F32;
    const float amp = matrix ? std::sqrt(3.f / float(shape.back())) : 0.1f;
    const uint64_t s = ++tensor_seed * 0x2545F4914F6CDD1Dull;
    Tensor t;
    if (dtype_is_quantized(dt)) {
      // Whole rows: each drawn in f32 into a per-task buffer, then quantized into place.
      const int64_t cols = shape.back();
      int64_t rows = 1;
      for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
      const size_t row_bytes = dtype_row_bytes(dt, cols);
      Tensor storage = host_tensor(DType::U8, {int64_t(row_bytes * size_t(rows))});
      t.dtype = dt;
      t.shape = shape;
      t.data = storage.data;
      t.owner = storage.owner;
      uint8_t* base = static_cast<uint8_t*>(storage.data);
      ThreadPool::global().parallel_for(rows, std::max<int64_t>(1, (1 << 16) / cols), [&](int64_t b, int64_t e) {
        std::vector<float> row(static_cast<size_t>(cols));
        for (int64_t r = b; r < e; ++r) {
          for (int64_t i = 0; i < cols; ++i)
            row[size_t(i)] = centre + amp * uniform_pm1(s, uint64_t(r * cols + i));
          quantize_row(dt, row.data(), base + size_t(r) * row_bytes, cols);
        }
      });
    } else {
      t = host_tensor(dt, shape);
      const int64_t count = t.numel();
      ThreadPool::global().parallel_for(count, 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          float v = centre + amp * uniform_pm1(s, uint64_t(i));
          if (dt == DType::F32) t.f32()[i] = v;
          else if (dt == DType::BF16) t.ptr<uint16_t>()[i] = f32_to_bf16(v);
          else t.ptr<uint16_t>()[i] = f32_to_f16(v);
        }
      });
    }
    TensorEntry e{c.tensor_prefix + n, dt, shape, static_cast<const uint8_t*>(t.data), t.nbytes(), ck->path, t.owner};
    ck->tensors.add(std::move(e));
  };

  add("embed_tokens.weight", {V, H}, true);
  add("norm.weight", {H}, false, 1.f);
  if (P > 0) {
    add("embed_tokens_per_layer.weight", {int64_t(c.ple_vocab), NL * P}, true);
    add("per_layer_model_projection.weight", {NL * P, H}, true);
    add("per_layer_projection_norm.weight", {P}, false, 1.f);
  }
  for (int l = 0; l < NL; ++l) {
    const LayerConfig& L = c.layers[size_t(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    const int64_t hd = L.head_dim, nh = c.n_heads, nkv = L.n_kv_heads, F = L.ffn_dim;
    for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                          "post_feedforward_layernorm.weight"})
      add(p + n, {H}, false, 1.f);
    add(p + "self_attn.q_proj.weight", {nh * hd, H}, true);
    add(p + "self_attn.q_norm.weight", {hd}, false, 0.5f);
    if (L.kv_source == l) {
      add(p + "self_attn.k_proj.weight", {nkv * hd, H}, true);
      add(p + "self_attn.k_norm.weight", {hd}, false, 0.5f);
      if (L.has_v_proj) add(p + "self_attn.v_proj.weight", {nkv * hd, H}, true);
    }
    add(p + "self_attn.o_proj.weight", {H, nh * hd}, true);
    add(p + "mlp.gate_proj.weight", {F, H}, true);
    add(p + "mlp.up_proj.weight", {F, H}, true);
    add(p + "mlp.down_proj.weight", {H, F}, true);
    add(p + "layer_scalar", {1}, false, 1.f);
    if (P > 0) {
      add(p + "per_layer_input_gate.weight", {P, H}, true);
      add(p + "per_layer_projection.weight", {H, P}, true);
      add(p + "post_per_layer_input_norm.weight", {H}, false, 1.f);
    }
    if (c.moe) {
      const int64_t E = c.n_experts, I = c.moe_ffn_dim;
      add(p + "router.proj.weight", {E, H}, true);
      add(p + "router.scale", {H}, false, 1.f);
      add(p + "router.per_expert_scale", {E}, false, 1.f);
      add(p + "experts.gate_up_proj", {E, 2 * I, H}, true);
      add(p + "experts.down_proj", {E, H, I}, true);
      for (const char* n : {"pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                            "post_feedforward_layernorm_2.weight"})
        add(p + n, {H}, false, 1.f);
    }
  }
  return ck;
}

}  // namespace mb
