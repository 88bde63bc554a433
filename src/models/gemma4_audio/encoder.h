// Gemma 4's audio encoder: the conformer of E2B/E4B ("Universal Speech Model" style: two stride-2
// convolutions over the log-mel spectrogram, 12 layers of macaron FFNs, chunked local attention
// with relative positions and a light convolution, all with clipped linears) and the projector
// into the language model's embedding space, against backend ops. It turns one clip's log-mel
// features (features.h) into the soft tokens that replace the clip's placeholder run.
// Reference: transformers 5.17.0 modeling_gemma4.py (Gemma4AudioModel, Gemma4MultimodalEmbedder);
// ../shared/docs/gemma4-multimodal.md §3.3, §3.4.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "models/checkpoint.h"

namespace mb::gemma4_audio {

struct AudioConfig {
  int hidden = 0, layers = 0, heads = 0, head_dim = 0, ffn = 0;
  int sscp_channels[2] = {128, 32};  // subsampling_conv_channels: the two stride-2 convolutions' outputs
  int conv_kernel = 5;               // the light convolution's causal depthwise kernel
  int chunk_size = 12, context_left = 13, context_right = 0;  // the blocked local attention
  float logit_cap = 50.f, invalid_logit = -1e9f;
  float residual_weight = 0.5f;      // the macaron FFNs' half step
  float gradient_clipping = 1e10f;   // a clamp of the residual stream (a no-op in practice)
  float eps = 1e-6f;
  bool clipped_linears = true;
  int output_dims = 1536;  // output_proj's width, the projector's input
  int text_hidden = 0;     // width of the soft tokens (the language model's hidden size)
};

// config.json's audio_config (plus text_config's hidden_size); `source` names the file in errors.
AudioConfig parse_audio_config(const nlohmann::json& config, const std::string& source);

class AudioEncoder {
 public:
  // Reads model.audio_tower.* and model.embed_audio.* of a checkpoint opened with its multimodal
  // tensors; a clear error when it has none.
  AudioEncoder(std::shared_ptr<const Checkpoint> ck, Backend& backend);
  ~AudioEncoder();
  const AudioConfig& config() const { return cfg_; }

  // Soft tokens [M, text_hidden] of one clip: mel [n_frames, n_mels] log-mel features, valid
  // [n_frames] non-zero on frames of real audio. M counts the valid entries of the mask after the
  // two stride-2 subsamplings (mask[::2] twice), in time order. Empty when none is left.
  std::vector<float> encode(std::span<const float> mel, std::span<const uint8_t> valid, int n_mels);

 private:
  struct Weights;
  std::shared_ptr<const Checkpoint> ck_;
  Backend& be_;
  AudioConfig cfg_;
  std::unique_ptr<Weights> w_;
};

}  // namespace mb::gemma4_audio
