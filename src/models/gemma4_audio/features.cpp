// Gemma 4 audio features (see features.h). Mirrors transformers 5.17.0:
//   models/gemma4/feature_extraction_gemma4.py      Gemma4AudioFeatureExtractor.__init__/_extract_spectrogram/__call__
//   feature_extraction_sequence_utils.py            SequenceFeatureExtractor.pad/_truncate/_pad (lengths, mask)
//   audio_utils.py                                   mel_filter_bank(norm=None, mel_scale="htk"), window_function
//   models/gemma4/processing_gemma4.py               Gemma4Processor.replace_audio_token (soft-token count)
//   models/gemma4_unified/feature_extraction_gemma4_unified.py  Gemma4UnifiedAudioFeatureExtractor
// Precision follows NumPy >= 2 step by step: float32 waveform, window and windowed frames, float32 rfft and
// magnitudes (NumPy's float32 rfft is the float64 transform rounded to complex64, so FFTW runs in double and rounds
// the same way; r2c_plan says why), float64 mel bank, product and log, float32 result. Measured against HF on the
// fixtures of tools/reference/make_audio_cases.py: bit-identical.
#include "models/gemma4_audio/features.h"

#include <fftw3.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>

#include "core/error.h"
#include "core/thread_pool.h"

namespace mb::gemma4_audio {

namespace {

// ---- processor_config.json ----

const nlohmann::json* find_key(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

double number_at(const nlohmann::json& j, const char* key, double fallback) {
  const nlohmann::json* v = find_key(j, key);
  if (!v) return fallback;
  MB_CHECK(v->is_number(), "processor_config.json: feature_extractor.{} must be a number, not {}", key, v->dump());
  const double x = v->get<double>();
  MB_CHECK(std::isfinite(x), "processor_config.json: feature_extractor.{} is not finite", key);
  return x;
}

bool bool_at(const nlohmann::json& j, const char* key, bool fallback) {
  const nlohmann::json* v = find_key(j, key);
  if (!v) return fallback;
  MB_CHECK(v->is_boolean(), "processor_config.json: feature_extractor.{} must be true or false, not {}", key,
           v->dump());
  return v->get<bool>();
}

int whole_at(const nlohmann::json& j, const char* key, int fallback, int lo, int hi) {
  const double x = number_at(j, key, fallback);
  MB_CHECK(x == std::floor(x) && x >= lo && x <= hi, "processor_config.json: feature_extractor.{} = {} is not a whole "
           "number in {}..{}", key, x, lo, hi);
  return int(x);
}

// HF stores these as np.array(values).reshape(1, 1, feature_size), so the saved JSON nests them: [[[...]]].
void flatten_numbers(const nlohmann::json& v, const char* key, int depth, std::vector<double>& out) {
  MB_CHECK(depth < 4, "processor_config.json: feature_extractor.{} is nested too deeply", key);
  if (v.is_array()) {
    for (const auto& x : v) flatten_numbers(x, key, depth + 1, out);
    return;
  }
  MB_CHECK(v.is_number() && std::isfinite(v.get<double>()), "processor_config.json: feature_extractor.{} holds {}", key,
           v.dump());
  out.push_back(v.get<double>());
}

std::vector<double> per_bin_at(const nlohmann::json& j, const char* key, int feature_size) {
  const nlohmann::json* v = find_key(j, key);
  if (!v) return {};
  std::vector<double> out;
  flatten_numbers(*v, key, 0, out);
  MB_CHECK(v->is_array() && out.size() == size_t(feature_size),
           "processor_config.json: feature_extractor.{} has {} numbers; feature_size is {}", key, out.size(),
           feature_size);
  return out;
}

// ---- the analysis pieces, each as HF builds it ----

// np.hanning(frame_length + 1)[:-1] (window_function(frame_length), periodic) cast to float32, with NumPy's own
// formula (0.5 + 0.5 cos(pi n / (M - 1)), n = 1-M, 3-M, ...) so the float64 values round the same way.
std::vector<float> periodic_hann(int frame_length) {
  const double m = double(frame_length) + 1.0;
  std::vector<float> w(static_cast<size_t>(frame_length));
  for (int k = 0; k < frame_length; ++k) {
    const double n = (1.0 - m) + 2.0 * double(k);
    w[size_t(k)] = float(0.5 + 0.5 * std::cos(std::numbers::pi * n / (m - 1.0)));
  }
  return w;
}

// np.linspace(start, stop, num): start + i * ((stop - start) / (num - 1)), the last point exactly stop.
std::vector<double> linspace(double start, double stop, int num) {
  std::vector<double> y(static_cast<size_t>(num));
  const double delta = stop - start, step = delta / double(num - 1);
  for (int i = 0; i < num; ++i)
    y[size_t(i)] = (step == 0.0 ? double(i) / double(num - 1) * delta : double(i) * step) + start;
  y.back() = stop;
  return y;
}

// One triangular filter of mel_filter_bank(..., norm=None, mel_scale="htk"): its weights over the FFT bins
// [first, first + weights.size()); bins outside are exactly 0, so skipping them leaves each sum unchanged.
struct MelFilter {
  size_t first = 0;
  std::vector<double> weights;
};

std::vector<MelFilter> htk_mel_filters(const AudioFeatureConfig& c) {
  const int n_bins = c.fft_length / 2 + 1;
  auto hz_to_mel = [](double hz) { return 2595.0 * std::log10(1.0 + hz / 700.0); };
  const std::vector<double> mels = linspace(hz_to_mel(c.min_frequency), hz_to_mel(c.max_frequency), c.feature_size + 2);
  std::vector<double> edges(mels.size());
  for (size_t i = 0; i < mels.size(); ++i) edges[i] = 700.0 * (std::pow(10.0, mels[i] / 2595.0) - 1.0);
  const std::vector<double> bin_hz = linspace(0.0, double(c.sampling_rate / 2), n_bins);  // sampling_rate // 2
  std::vector<MelFilter> filters(size_t(c.feature_size));
  for (size_t j = 0; j < filters.size(); ++j) {
    const double rise = edges[j + 1] - edges[j], fall = edges[j + 2] - edges[j + 1];
    std::vector<double> w(static_cast<size_t>(n_bins));
    for (size_t k = 0; k < w.size(); ++k) {
      const double down = -(edges[j] - bin_hz[k]) / rise, up = (edges[j + 2] - bin_hz[k]) / fall;
      w[k] = std::max(0.0, std::min(down, up));
    }
    auto nonzero = [](double x) { return x != 0.0; };
    auto lo = std::find_if(w.begin(), w.end(), nonzero);
    auto hi = std::find_if(w.rbegin(), w.rend(), nonzero).base();
    if (lo < hi) filters[j] = {size_t(lo - w.begin()), std::vector<double>(lo, hi)};  // else all-zero (filter 0)
  }
  return filters;
}

// FFTW plans of the real forward transform, one per length, made once. FFTW's planner is not thread-safe;
// executing a plan on other (equally aligned, fftw_malloc'd) arrays is. FFTW_ESTIMATE keeps the algorithm, and so
// the rounding, the same from run to run (FFTW_MEASURE picks by timing).
// Double precision on purpose: NumPy 2.x's float32 rfft returns the float64 transform rounded to complex64 (checked
// bit for bit on 500k bins), i.e. it is accurate to float32 rounding in every bin. A float32 FFT (fftwf) is only
// accurate relative to the frame's largest bin: on a pure tone its near-empty bins are off by ~1e-6, which the log
// (slope 1/mel_floor = 1000 near silence) turns into feature errors of 4e-3 against HF.
// The plans live until the process ends (never destroyed, so still reachable for the leak checker at exit).
fftw_plan r2c_plan(int n) {
  static std::mutex mu;
  static auto* plans = new std::map<int, fftw_plan>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans->find(n);
  if (it != plans->end()) return it->second;
  double* in = fftw_alloc_real(size_t(n));
  fftw_complex* out = fftw_alloc_complex(size_t(n / 2 + 1));
  fftw_plan plan = in && out ? fftw_plan_dft_r2c_1d(n, in, out, FFTW_ESTIMATE) : nullptr;
  fftw_free(in);
  fftw_free(out);
  MB_CHECK(plan, "audio features: FFTW cannot plan a {}-point real FFT", n);
  return plans->emplace(n, plan).first->second;
}

struct FftwFree {
  void operator()(void* p) const { fftw_free(p); }
};

// np.abs of a complex64 value as NumPy 2.x's SIMD loop computes it (umath loops_unary_complex: larger *
// sqrt(fma(r, r, 1)), r = smaller / larger), which differs from a correctly rounded hypotf in ~20% of values.
// (With FMA, i.e. on any AVX2 machine; NumPy on an older CPU rounds r * r first and differs from this by 1 ulp.)
float numpy_complex64_abs(float re, float im) {
  re = std::fabs(re);
  im = std::fabs(im);
  if (std::isinf(re) || std::isinf(im)) return std::numeric_limits<float>::infinity();
  const float larger = std::max(re, im), smaller = std::min(re, im);
  if (larger == 0.0f) return 0.0f;
  const float ratio = smaller / larger;
  return std::sqrt(std::fma(ratio, ratio, 1.0f)) * larger;
}

// Where the real samples sit after SequenceFeatureExtractor.pad (truncation, padding to a multiple) and the
// semicausal left pad, and how many frames that gives.
struct Layout {
  size_t kept = 0;        // input samples after truncation
  size_t padded = 0;      // after padding to pad_to_multiple_of
  size_t total = 0;       // after the frame_length/2 zeros in front
  size_t real_begin = 0;  // [real_begin, real_end): real samples within the total
  size_t real_end = 0;
  size_t frames = 0;
};

size_t round_up(size_t n, size_t multiple) {
  if (multiple == 0 || n % multiple == 0) return n;
  return (n / multiple + 1) * multiple;
}

Layout layout_for(size_t n_samples, const AudioFeatureConfig& c) {
  Layout l;
  l.kept = c.truncation ? std::min(n_samples, round_up(c.max_length, c.pad_to_multiple_of)) : n_samples;
  l.padded = round_up(l.kept, c.pad_to_multiple_of);
  const size_t semicausal = size_t(c.frame_length / 2);
  l.total = semicausal + l.padded;
  l.real_begin = semicausal + (c.padding_left ? l.padded - l.kept : 0);
  l.real_end = l.real_begin + l.kept;
  const size_t window = size_t(c.frame_length) + 1;
  l.frames = l.total >= window ? (l.total - window) / size_t(c.hop_length) + 1 : 0;
  MB_CHECK(l.frames <= size_t(std::numeric_limits<int>::max()), "audio features: {} samples make too many frames",
           n_samples);
  return l;
}

// A frame is valid when the last sample of its frame_length+1 window is real audio (HF's frame_end_indices).
std::vector<uint8_t> valid_frames(const Layout& l, const AudioFeatureConfig& c) {
  std::vector<uint8_t> valid(l.frames);
  for (size_t t = 0; t < l.frames; ++t) {
    const size_t last = t * size_t(c.hop_length) + size_t(c.frame_length);
    valid[t] = last >= l.real_begin && last < l.real_end;
  }
  return valid;
}

// replace_audio_token: two stride-2 convolutions (kernel 3, padding 1) keep t -> (t - 1) // 2 + 1 = ceil(t/2)
// positions, and the mask follows as mask[::2]; the tokens are the valid positions left.
int soft_tokens_of(std::vector<uint8_t> mask) {
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<uint8_t> next((mask.size() + 1) / 2);
    for (size_t i = 0; i < next.size(); ++i) next[i] = mask[2 * i];
    mask = std::move(next);
  }
  return int(std::count(mask.begin(), mask.end(), uint8_t(1)));
}

}  // namespace

AudioFeatureConfig parse_audio_feature_config(const nlohmann::json& processor_config) {
  MB_CHECK(processor_config.is_object(), "processor_config.json: not a JSON object");
  const nlohmann::json* fe = &processor_config;
  if (const nlohmann::json* nested = find_key(processor_config, "feature_extractor")) {
    fe = nested;
  } else {
    MB_CHECK(processor_config.contains("feature_extractor_type"),
             "processor_config.json has no feature_extractor (a Gemma 4 model without audio input?)");
  }
  MB_CHECK(fe->is_object(), "processor_config.json: feature_extractor is not an object");
  if (const nlohmann::json* type = find_key(*fe, "feature_extractor_type")) {
    MB_CHECK(type->is_string(), "processor_config.json: feature_extractor_type must be a string");
    MB_CHECK(*type == "Gemma4AudioFeatureExtractor",
             "processor_config.json: feature extractor {} is not Gemma4AudioFeatureExtractor (log-mel features); the "
             "12B unified model's Gemma4UnifiedAudioFeatureExtractor takes raw frames (unified_audio_frames)",
             type->get<std::string>());
  }
  AudioFeatureConfig c;
  c.feature_size = whole_at(*fe, "feature_size", c.feature_size, 1, 4096);
  c.sampling_rate = whole_at(*fe, "sampling_rate", c.sampling_rate, 1000, 768000);
  // HF's __init__ recomputes these from the millisecond arguments and ignores the saved sample counts.
  const double frame_ms = number_at(*fe, "frame_length_ms", 20.0), hop_ms = number_at(*fe, "hop_length_ms", 10.0);
  auto samples_of = [&](double ms, const char* key) {
    const double n = std::nearbyint(double(c.sampling_rate) * ms / 1000.0);  // Python round(): half to even
    MB_CHECK(n >= 1 && n <= 65536, "processor_config.json: feature_extractor.{} = {} ms is {} samples", key, ms, n);
    return int(n);
  };
  c.frame_length = samples_of(frame_ms, "frame_length_ms");
  c.hop_length = samples_of(hop_ms, "hop_length_ms");
  MB_CHECK(c.frame_length >= 2, "processor_config.json: a frame of {} samples is too short", c.frame_length);
  c.fft_length = 1;
  while (c.fft_length < c.frame_length) c.fft_length *= 2;
  if (bool_at(*fe, "fft_overdrive", false)) c.fft_length *= 2;
  // save_pretrained writes the sample counts but not the milliseconds, so an extractor made with other
  // milliseconds saves counts that HF itself then ignores on reload. Such a config is ambiguous (the saver used
  // one length, HF's loader another): refused rather than guessed.
  for (auto [key, derived] : {std::pair{"frame_length", c.frame_length}, {"hop_length", c.hop_length},
                              {"fft_length", c.fft_length}})
    if (find_key(*fe, key))
      MB_CHECK(whole_at(*fe, key, derived, 1, 1 << 20) == derived,
               "processor_config.json: feature_extractor.{} = {}, but transformers derives {} from frame_length_ms / "
               "hop_length_ms (20 / 10 ms unless given) and ignores the saved value: ambiguous config", key,
               fe->at(key).dump(), derived);
  c.min_frequency = number_at(*fe, "min_frequency", c.min_frequency);
  c.max_frequency = number_at(*fe, "max_frequency", c.max_frequency);
  MB_CHECK(c.min_frequency >= 0 && c.min_frequency < c.max_frequency,
           "processor_config.json: mel range min_frequency {} .. max_frequency {} Hz is empty", c.min_frequency,
           c.max_frequency);
  c.mel_floor = number_at(*fe, "mel_floor", c.mel_floor);
  MB_CHECK(c.mel_floor > 0, "processor_config.json: mel_floor {} must be positive (log of silence)", c.mel_floor);
  c.preemphasis = number_at(*fe, "preemphasis", c.preemphasis);
  MB_CHECK(c.preemphasis >= 0 && c.preemphasis < 1, "processor_config.json: preemphasis {} is outside [0, 1)",
           c.preemphasis);
  c.preemphasis_htk_flavor = bool_at(*fe, "preemphasis_htk_flavor", c.preemphasis_htk_flavor);
  c.input_scale_factor = number_at(*fe, "input_scale_factor", c.input_scale_factor);
  c.padding_value = float(number_at(*fe, "padding_value", c.padding_value));
  if (const nlohmann::json* side = find_key(*fe, "padding_side")) {
    MB_CHECK(*side == "right" || *side == "left", "processor_config.json: padding_side {} is not right or left",
             side->dump());
    c.padding_left = *side == "left";
  }
  const double dither = number_at(*fe, "dither", 0.0);
  MB_CHECK(dither == 0.0, "processor_config.json: dither {} adds random noise to every call; only 0 is supported",
           dither);
  c.per_bin_mean = per_bin_at(*fe, "per_bin_mean", c.feature_size);
  c.per_bin_stddev = per_bin_at(*fe, "per_bin_stddev", c.feature_size);
  for (double s : c.per_bin_stddev) MB_CHECK(s != 0.0, "processor_config.json: per_bin_stddev holds a zero");
  return c;
}

AudioFeatures extract_features(std::span<const float> mono, const AudioFeatureConfig& c) {
  MB_CHECK(c.frame_length >= 2 && c.hop_length >= 1 && c.fft_length >= c.frame_length && c.feature_size >= 1 &&
               c.sampling_rate > 0 && c.min_frequency < c.max_frequency && c.mel_floor > 0,
           "audio features: inconsistent config (frame {}, hop {}, fft {}, {} mels, {} Hz)", c.frame_length,
           c.hop_length, c.fft_length, c.feature_size, c.sampling_rate);
  MB_CHECK(c.per_bin_mean.empty() || c.per_bin_mean.size() == size_t(c.feature_size),
           "audio features: per_bin_mean has {} values for {} mels", c.per_bin_mean.size(), c.feature_size);
  MB_CHECK(c.per_bin_stddev.empty() || c.per_bin_stddev.size() == size_t(c.feature_size),
           "audio features: per_bin_stddev has {} values for {} mels", c.per_bin_stddev.size(), c.feature_size);
  const Layout l = layout_for(mono.size(), c);
  AudioFeatures out;
  out.n_frames = int(l.frames);
  out.n_mels = c.feature_size;
  out.valid = valid_frames(l, c);
  out.n_soft_tokens = soft_tokens_of(out.valid);
  out.mel.assign(l.frames * size_t(c.feature_size), 0.0f);
  if (l.frames == 0) return out;

  // The padded waveform: semicausal zeros, then padding_value around the real samples, times input_scale_factor
  // (HF scales after padding, in float32).
  std::vector<float> x(l.total, 0.0f);
  const size_t semicausal = size_t(c.frame_length / 2);
  std::fill(x.begin() + long(semicausal), x.end(), c.padding_value);
  std::copy(mono.begin(), mono.begin() + long(l.kept), x.begin() + long(l.real_begin));
  if (c.input_scale_factor != 1.0) {
    const float gain = float(c.input_scale_factor);
    for (size_t i = semicausal; i < x.size(); ++i) x[i] *= gain;
  }

  const std::vector<float> window = periodic_hann(c.frame_length);
  const std::vector<MelFilter> filters = htk_mel_filters(c);
  const int n_bins = c.fft_length / 2 + 1;
  const fftw_plan plan = r2c_plan(c.fft_length);
  const float pre = float(c.preemphasis), first_gain = float(1.0 - c.preemphasis);
  const size_t n = size_t(c.frame_length);

  // Frames are independent: runs of them on the pool's threads, each with its own buffers (FFTW's
  // new-array execute is thread-safe; the plan was made above, under r2c_plan's lock).
  std::atomic<bool> no_memory{false};
  ThreadPool::global().parallel_for(int64_t(l.frames), 64, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<double, FftwFree> in(fftw_alloc_real(size_t(c.fft_length)));
    std::unique_ptr<fftw_complex, FftwFree> spectrum(fftw_alloc_complex(size_t(n_bins)));
    if (!in || !spectrum) {
      no_memory = true;
      return;
    }
    std::vector<float> frame(size_t(c.frame_length));
    std::vector<float> magnitude(static_cast<size_t>(n_bins));
    for (size_t t = size_t(t0); t < size_t(t1); ++t) {
      const float* raw = x.data() + t * size_t(c.hop_length);  // frame_length + 1 samples
      if (c.preemphasis == 0.0) {
        std::copy(raw, raw + n, frame.begin());
      } else if (c.preemphasis_htk_flavor) {
        frame[0] = raw[0] * first_gain;
        for (size_t i = 1; i < n; ++i) frame[i] = raw[i] - pre * raw[i - 1];
      } else {
        for (size_t i = 0; i < n; ++i) frame[i] = raw[i + 1] - pre * raw[i];
      }
      double* padded = in.get();  // rfft(n=fft_length) zero-pads the windowed float32 frame
      for (size_t i = 0; i < n; ++i) padded[i] = double(frame[i] * window[i]);
      std::fill(padded + n, padded + c.fft_length, 0.0);
      fftw_execute_dft_r2c(plan, padded, spectrum.get());
      for (int k = 0; k < n_bins; ++k)
        magnitude[size_t(k)] = numpy_complex64_abs(float(spectrum.get()[k][0]), float(spectrum.get()[k][1]));

      const float valid = out.valid[t] ? 1.0f : 0.0f;
      float* row = out.mel.data() + t * size_t(c.feature_size);
      for (size_t j = 0; j < filters.size(); ++j) {
        double energy = 0.0;
        const MelFilter& f = filters[j];
        for (size_t k = 0; k < f.weights.size(); ++k) energy += double(magnitude[f.first + k]) * f.weights[k];
        double v = std::log(energy + c.mel_floor);
        if (!c.per_bin_mean.empty()) v -= c.per_bin_mean[j];
        if (!c.per_bin_stddev.empty()) v /= c.per_bin_stddev[j];
        row[j] = float(v) * valid;  // HF multiplies by the mask (so invalid frames of negative values are -0.0)
      }
    }
  });
  MB_CHECK(!no_memory, "audio features: cannot allocate FFT buffers");
  return out;
}

int audio_soft_tokens(size_t n_samples, const AudioFeatureConfig& config) {
  const Layout l = layout_for(n_samples, config);
  return soft_tokens_of(valid_frames(l, config));
}

int unified_audio_soft_tokens(size_t n_samples) {
  const size_t tokens = (n_samples + kUnifiedAudioSamplesPerToken - 1) / kUnifiedAudioSamplesPerToken;
  MB_CHECK(tokens <= size_t(std::numeric_limits<int>::max()), "unified audio: {} samples are too many", n_samples);
  return int(tokens);
}

std::vector<float> unified_audio_frames(std::span<const float> mono_16k) {
  std::vector<float> frames(size_t(unified_audio_soft_tokens(mono_16k.size())) * kUnifiedAudioSamplesPerToken, 0.0f);
  std::copy(mono_16k.begin(), mono_16k.end(), frames.begin());
  return frames;
}

}  // namespace mb::gemma4_audio
