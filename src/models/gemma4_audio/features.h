// Gemma 4 audio input features: the log-mel spectrogram of the E2B/E4B conformer and the raw 640-sample frames of
// the 12B "unified" model, and how many soft tokens each gives.
// Mirrors transformers 5.17.0 models/gemma4/feature_extraction_gemma4.py (Gemma4AudioFeatureExtractor, called on
// one waveform as Gemma4Processor calls it: padding "longest", max_length 480000, truncation, pad_to_multiple_of
// 128), processing_gemma4.py (replace_audio_token: the frame mask subsampled twice) and
// models/gemma4_unified/feature_extraction_gemma4_unified.py (Gemma4UnifiedAudioFeatureExtractor);
// ../shared/docs/gemma4-multimodal.md sections 3.1, 3.2 and 4.2.
#pragma once
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

namespace mb::gemma4_audio {

struct AudioFeatureConfig {
  // Saved by Gemma4Processor.save_pretrained under processor_config.json's "feature_extractor".
  int feature_size = 128;      // mel filters
  int sampling_rate = 16000;   // Hz the waveform must already be at
  int frame_length = 320;      // samples per analysis window: round(sampling_rate * frame_length_ms / 1000)
  int hop_length = 160;        // samples between windows: round(sampling_rate * hop_length_ms / 1000)
  int fft_length = 512;        // the power of two >= frame_length, doubled by fft_overdrive
  double min_frequency = 0.0;  // Hz, lower edge of the mel bank
  double max_frequency = 8000.0;
  double mel_floor = 1e-3;           // added before the natural log
  double preemphasis = 0.0;          // 0: none
  bool preemphasis_htk_flavor = true;
  double input_scale_factor = 1.0;   // waveform gain
  float padding_value = 0.0f;        // value of the samples appended to reach pad_to_multiple_of
  bool padding_left = false;         // padding_side "left"
  std::vector<double> per_bin_mean;  // [feature_size] or empty: subtracted from the log-mel
  std::vector<double> per_bin_stddev;
  // Arguments of Gemma4AudioFeatureExtractor.__call__ (not saved; the processor passes its defaults).
  size_t max_length = 480000;  // samples kept when truncating (30 s), rounded up to pad_to_multiple_of
  bool truncation = true;
  size_t pad_to_multiple_of = 128;
};

// The feature extractor of a processor_config.json (its "feature_extractor" object), or of a flat
// preprocessor_config.json, as transformers 5.17.0 reloads it: frame and hop lengths come from
// frame_length_ms / hop_length_ms (default 20 / 10 ms), the saved sample counts are only checked against them.
// Throws mb::Error for another extractor type (e.g. the unified model's), mistyped or out-of-range values, and
// dither > 0 (random noise HF draws per call, which no reimplementation reproduces).
AudioFeatureConfig parse_audio_feature_config(const nlohmann::json& processor_config);

struct AudioFeatures {
  int n_frames = 0;
  int n_mels = 0;
  std::vector<float> mel;      // [n_frames, n_mels] natural-log mel energies; 0 on invalid frames
  std::vector<uint8_t> valid;  // [n_frames] 1 where the frame's window lies on real (unpadded) audio
  int n_soft_tokens = 0;       // audio soft tokens the conformer produces (placeholders in the prompt)
};

// Log-mel features of one mono waveform at config.sampling_rate (resample and downmix first), as
// Gemma4AudioFeatureExtractor()([waveform]) computes them: truncate to max_length, right-pad to a multiple of 128,
// prepend frame_length/2 zeros ("semicausal"), frames of frame_length+1 samples every hop_length, periodic Hann,
// |rfft(fft_length)| in float32, HTK mel bank (no normalisation) and log(mel + mel_floor) in float64, cast to
// float32. Thread-safe. A waveform shorter than 129 samples has no frame.
AudioFeatures extract_features(std::span<const float> mono, const AudioFeatureConfig& config = {});

// The soft-token count extract_features(...).n_soft_tokens gives for n_samples, without computing features:
// the frame mask subsampled twice by stride-2 convolutions (t -> ceil(t/2)), valid entries counted.
// About 25 per second; 750 from 30 s on (truncation).
int audio_soft_tokens(size_t n_samples, const AudioFeatureConfig& config = {});

// 12B unified model (no audio encoder): raw 16 kHz samples in frames of 640 (40 ms), one soft token per frame.
inline constexpr int kUnifiedAudioSamplesPerToken = 640;
// ceil(n_samples / 640); no cap (Gemma4UnifiedAudioFeatureExtractor's max_length defaults to None).
int unified_audio_soft_tokens(size_t n_samples);
// [unified_audio_soft_tokens(n), 640] float32: the waveform zero-padded to a multiple of 640.
std::vector<float> unified_audio_frames(std::span<const float> mono_16k);

}  // namespace mb::gemma4_audio
