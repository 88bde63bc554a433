// Gemma 4 (E2B, E4B, 26B-A4B, 31B, and the 12B unified model's text decoder) in the registry.
#include <array>

#include "core/error.h"
#include "models/gemma4/gemma4.h"
#include "models/hf_config.h"
#include "models/model.h"
#include "tokenizer/chat.h"

namespace mb {

extern const char* const kBuiltinGemma4Template;  // chat_template.jinja, embedded by src/CMakeLists.txt

namespace gemma4 {

namespace {

constexpr std::array<TensorNamePair, 6> kGlobalNames = {{
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
    {"per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"},
    {"per_layer_model_proj.weight", "model.per_layer_model_projection.weight"},
    {"per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight"},
}};

constexpr std::array<TensorNamePair, 25> kLayerNames = {{
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
    {"post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
    // Gemma 4's own: the MoE block, per-layer embeddings, the layer scalar.
    {"pre_ffw_norm_2.weight", "pre_feedforward_layernorm_2.weight"},
    {"post_ffw_norm_1.weight", "post_feedforward_layernorm_1.weight"},
    {"post_ffw_norm_2.weight", "post_feedforward_layernorm_2.weight"},
    {"ffn_gate_inp.weight", "router.proj.weight"},
    {"ffn_gate_inp.scale", "router.scale"},
    {"ffn_down_exps.scale", "router.per_expert_scale"},
    {"ffn_gate_up_exps.weight", "experts.gate_up_proj"},
    {"ffn_down_exps.weight", "experts.down_proj"},
    {"inp_gate.weight", "per_layer_input_gate.weight"},
    {"proj.weight", "per_layer_projection.weight"},
    {"post_norm.weight", "post_per_layer_input_norm.weight"},
    {"layer_output_scale.weight", "layer_scalar"},
}};

constexpr std::array<std::string_view, 7> kVisibleTokens = {
    "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|\"|>"};

class Gemma4Architecture final : public Architecture {
 public:
  std::string_view name() const override { return "gemma4"; }

  bool reads_hf_config(const std::string& hf_class, const std::string& model_type) const override {
    return nested(hf_class, model_type) || flat(hf_class, model_type);
  }
  std::vector<std::string_view> hf_classes() const override {
    return {"Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4UnifiedForConditionalGeneration",
            "Gemma4UnifiedForCausalLM"};
  }
  ModelConfig parse_hf_config(const nlohmann::json& config, const std::string& source) const override {
    const std::string hf_class = hf::class_of(config), model_type = hf::model_type_of(config);
    if (flat(hf_class, model_type)) {
      const bool unified = hf_class.find("Unified") != std::string::npos || model_type == "gemma4_unified_text";
      ModelConfig c = parse_hf_text(config, unified, source);
      c.model_type = model_type;
      return c;
    }
    const bool unified = hf_class.find("Unified") != std::string::npos || model_type == "gemma4_unified";
    return hf::parse_text_config(config, source, hf_class.empty() ? model_type : hf_class,
                                 [&](const nlohmann::json& tc, const std::string& src) {
                                   return parse_hf_text(tc, unified, src);
                                 });
  }
  bool is_multimodal_tensor(std::string_view name) const override { return gemma4::is_multimodal_tensor(name); }

  std::string_view gguf_architecture() const override { return "gemma4"; }
  ModelConfig parse_gguf(const GgufFile& f) const override { return gemma4::parse_gguf(f); }
  void write_gguf_metadata(const ModelConfig& c, GgufWriter& w) const override { gemma4::write_gguf_metadata(c, w); }
  std::vector<std::string> gguf_derived_tensors() const override { return {std::string(kRopeFreqsTensor)}; }
  void add_gguf_derived_tensors(const ModelConfig& c, GgufWriter& w) const override { add_rope_freqs(c, w); }
  // llama.cpp names Gemma 4's BPE vocabulary after the architecture; MarkBase reads either name.
  std::string_view gguf_tokenizer_model() const override { return "gemma4"; }
  // convert_hf_to_gguf.py's Gemma4Model.set_vocab (LlamaHfVocab, and these markers made visible).
  GgufTokenTyping gguf_token_typing() const override { return {true, kVisibleTokens}; }
  std::span<const TensorNamePair> gguf_global_names() const override { return global_names(); }
  std::span<const TensorNamePair> gguf_layer_names() const override { return layer_names(); }

  std::unique_ptr<MediaEncoder> make_media_encoder(std::shared_ptr<const Checkpoint> ck,
                                                   Backend& backend) const override {
    return gemma4::make_media_encoder(std::move(ck), backend);
  }
  void attach_mmproj(Checkpoint& ck, const std::string& path) const override { gemma4::attach_mmproj(ck, path); }
  std::unique_ptr<Model> make_model(std::shared_ptr<const Checkpoint> ck, Backend& backend,
                                    const ModelLoadOptions& opts) const override {
    return make_decoder(std::move(ck), backend, opts);
  }

  std::span<const std::string_view> stop_tokens() const override { return kGemma4StopTokens; }
  std::string_view builtin_chat_template() const override { return kBuiltinGemma4Template; }

 private:
  static bool nested(const std::string& c, const std::string& t) {
    return c == "Gemma4ForConditionalGeneration" || c == "Gemma4UnifiedForConditionalGeneration" ||
           (c.empty() && (t == "gemma4" || t == "gemma4_unified"));
  }
  static bool flat(const std::string& c, const std::string& t) {
    return c == "Gemma4ForCausalLM" || c == "Gemma4UnifiedForCausalLM" ||
           (c.empty() && (t == "gemma4_text" || t == "gemma4_unified_text"));
  }
};

}  // namespace

std::span<const TensorNamePair> global_names() { return kGlobalNames; }

bool is_multimodal_tensor(std::string_view name) {
  for (std::string_view p : {"model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                             "model.vision_embedder.", "vision_tower.", "audio_tower.", "multi_modal_projector.",
                             "model.multi_modal_projector."})
    if (name.substr(0, p.size()) == p) return true;
  return false;
}
std::span<const TensorNamePair> layer_names() { return kLayerNames; }

}  // namespace gemma4

const Architecture& gemma4_architecture() {
  static const gemma4::Gemma4Architecture arch;
  return arch;
}

}  // namespace mb
