// Audio input: decoding (libsndfile) against soundfile, downmix, resampling (libsoxr) against python-soxr, and
// Gemma 4's audio features and soft-token counts against transformers 5.17.0 (Gemma4AudioFeatureExtractor,
// Gemma4Processor.replace_audio_token, Gemma4UnifiedAudioFeatureExtractor). The references come from
// tools/reference/make_audio_cases.py (tests/fixtures/audio/cases.json says what each file is).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <thread>

#include "core/error.h"
#include "core/splitmix64.h"
#include "media/audio.h"
#include "models/gemma4_audio/features.h"
#include "media/file.h"
#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define MB_AUDIO_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MB_AUDIO_TEST_ASAN 1
#endif
#endif
#ifdef MB_AUDIO_TEST_ASAN
#include <sanitizer/lsan_interface.h>
#endif

namespace {

using mb::gemma4_audio::AudioFeatureConfig;
using mb::gemma4_audio::AudioFeatures;
using mb::gemma4_audio::extract_features;

std::string audio_path(const std::string& name) { return mbtest::fixture("audio/" + name); }

const nlohmann::json& cases() {
  static const nlohmann::json c = mbtest::read_json(audio_path("cases.json"));
  return c;
}

float max_abs_diff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.0f;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// The message of the mb::Error `f` throws ("" and a test failure when it throws nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const mb::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no mb::Error thrown";
  return "";
}

// The 16 kHz waveform HF's features of `name` were computed from, made the way the C++ engine makes it.
std::vector<float> waveform_16k(const std::string& name) {
  const mb::Waveform w = mb::read_audio_file(audio_path(name));
  return mb::resample(mb::to_mono(w), w.sample_rate, 16000);
}

// A RIFF/WAVE file in memory: PCM (format tag 1) unless told otherwise.
std::vector<uint8_t> wav_bytes(int channels, int rate, int bits, std::span<const uint8_t> data, uint16_t format_tag = 1,
                               uint32_t declared_data_size = 0xFFFFFFFFu) {
  std::vector<uint8_t> b;
  auto u32 = [&](uint32_t v) { for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i))); };
  auto u16 = [&](uint16_t v) { for (int i = 0; i < 2; ++i) b.push_back(uint8_t(v >> (8 * i))); };
  auto tag = [&](const char* s) { for (int i = 0; i < 4; ++i) b.push_back(uint8_t(s[i])); };
  const uint32_t data_size = declared_data_size == 0xFFFFFFFFu ? uint32_t(data.size()) : declared_data_size;
  tag("RIFF");
  u32(36 + uint32_t(data.size()));
  tag("WAVE");
  tag("fmt ");
  u32(16);
  u16(format_tag);
  u16(uint16_t(channels));
  u32(uint32_t(rate));
  u32(uint32_t(rate * channels * bits / 8));
  u16(uint16_t(channels * bits / 8));
  u16(uint16_t(bits));
  tag("data");
  u32(data_size);
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

// ---------------------------------------------------------------------------------------------- decoding

TEST(AudioDecode, LosslessFilesMatchSoundfileExactly) {
  int checked = 0;
  for (const auto& [name, ref] : cases()["files"].items()) {
    if (!ref["lossless"].get<bool>()) continue;
    SCOPED_TRACE(name);
    const mb::Waveform w = mb::read_audio_file(audio_path(name));
    EXPECT_EQ(w.sample_rate, ref["sample_rate"].get<int>());
    EXPECT_EQ(w.channels, ref["channels"].get<int>());
    ASSERT_EQ(w.frames(), ref["frames"].get<size_t>());
    double sum = 0, sum_abs = 0, weighted = 0;
    for (size_t i = 0; i < w.samples.size(); ++i) {
      sum += w.samples[i];
      sum_abs += std::fabs(w.samples[i]);
      weighted += double(i % 97 + 1) * w.samples[i];
    }
    // numpy sums pairwise, this sums in order: equal samples give sums equal to ~1e-15 of the magnitudes.
    const double tol = 1e-12 * (ref["sum_abs"].get<double>() * 97 + 1);
    EXPECT_NEAR(sum, ref["sum"].get<double>(), tol);
    EXPECT_NEAR(sum_abs, ref["sum_abs"].get<double>(), tol);
    EXPECT_NEAR(weighted, ref["weighted_sum"].get<double>(), tol);
    for (size_t i = 0; i < ref["head"].size(); ++i) EXPECT_EQ(w.samples[i], ref["head"][i].get<float>()) << i;
    ++checked;
  }
  EXPECT_EQ(checked, 9);  // WAV u8/16/24/32/float, FLAC
}

TEST(AudioDecode, LossyFilesMatchSoundfileClosely) {
  // Vorbis and MP3 decoders are float code of other versions in soundfile's wheel (libsndfile 1.2.2) than in
  // Debian's libsndfile 1.2.0 + libvorbis 1.3.7 + mpg123 1.31: measured 6e-8 (Vorbis) and 0 (MP3).
  for (const char* name : {"speech_22k05.ogg", "speech_44k1.mp3"}) {
    SCOPED_TRACE(name);
    const nlohmann::json& ref = cases()["files"][name];
    const mb::Waveform w = mb::read_audio_file(audio_path(name));
    EXPECT_EQ(w.sample_rate, ref["sample_rate"].get<int>());
    EXPECT_EQ(w.channels, ref["channels"].get<int>());
    ASSERT_EQ(w.frames(), ref["frames"].get<size_t>());
    const std::vector<float> expected = mbtest::read_f32(audio_path(ref["decoded"].get<std::string>()));
    EXPECT_LE(max_abs_diff(w.samples, expected), 1e-6f);
  }
}

TEST(AudioDecode, MemoryAndFileGiveTheSameSamples) {
  for (const char* name : {"speech_48k.flac", "speech_44k1.mp3", "mono_8k_u8.wav"}) {
    const std::vector<uint8_t> bytes = mb::read_media_file(audio_path(name));
    const mb::Waveform a = mb::decode_audio(bytes, name), b = mb::read_audio_file(audio_path(name));
    EXPECT_EQ(a.sample_rate, b.sample_rate);
    EXPECT_EQ(a.channels, b.channels);
    EXPECT_EQ(a.samples, b.samples) << name;
  }
}

TEST(AudioDecode, EmptyTruncatedAndForeignInputsAreClearErrors) {
  std::string m = error_of([] { mb::read_audio_file(audio_path("empty.wav")); });
  EXPECT_NE(m.find("empty.wav"), std::string::npos) << m;
  EXPECT_NE(m.find("empty (0 bytes)"), std::string::npos) << m;

  m = error_of([] { mb::read_audio_file(audio_path("truncated.wav")); });
  EXPECT_NE(m.find("truncated.wav"), std::string::npos) << m;
  EXPECT_NE(m.find("cannot decode"), std::string::npos) << m;

  const std::string text = "this is not audio, just some text that happens to be in a file\n";
  m = error_of([&] { mb::decode_audio({reinterpret_cast<const uint8_t*>(text.data()), text.size()}, "note.txt"); });
  EXPECT_NE(m.find("note.txt"), std::string::npos) << m;
  EXPECT_NE(m.find("cannot decode"), std::string::npos) << m;

  m = error_of([] { mb::read_audio_file(audio_path("no_such_file.wav")); });
  EXPECT_NE(m.find("no_such_file.wav"), std::string::npos) << m;
}

TEST(AudioDecode, UnsupportedCodecAndBadHeadersAreClearErrors) {
  const std::vector<uint8_t> pcm(1600, 0);
  // Format tag 0x1234 is no codec libsndfile knows.
  std::string m = error_of([&] { mb::decode_audio(wav_bytes(1, 16000, 16, pcm, 0x1234), "odd codec"); });
  EXPECT_NE(m.find("odd codec"), std::string::npos) << m;
  m = error_of([&] { mb::decode_audio(wav_bytes(0, 16000, 16, pcm), "no channels"); });
  EXPECT_NE(m.find("no channels"), std::string::npos) << m;
  m = error_of([&] { mb::decode_audio(wav_bytes(1, 200, 16, pcm), "slow"); });
  EXPECT_NE(m.find("200 Hz"), std::string::npos) << m;
  // A valid header with an empty data chunk.
  m = error_of([&] { mb::decode_audio(wav_bytes(1, 16000, 16, {}), "no data"); });
  EXPECT_NE(m.find("no samples"), std::string::npos) << m;
}

TEST(AudioDecode, NonFiniteFloatSamplesAreRefused) {
  std::vector<float> samples = {0.0f, 0.5f, std::numeric_limits<float>::quiet_NaN(), 0.25f};
  std::vector<uint8_t> data(samples.size() * 4);
  std::memcpy(data.data(), samples.data(), data.size());
  const std::string m = error_of([&] { mb::decode_audio(wav_bytes(1, 16000, 32, data, 3), "nan.wav"); });
  EXPECT_NE(m.find("not finite"), std::string::npos) << m;
}

TEST(AudioDecode, LengthLimitIsAnHour) {
  // At the lowest accepted rate an hour is 3.6 M frames: exactly that decodes, one more is refused up front.
  constexpr int kRate = mb::kMinAudioSampleRate;
  const size_t hour = size_t(mb::kMaxAudioSeconds) * kRate;
  std::vector<uint8_t> data((hour + 1) * 2, 0);
  std::string m = error_of([&] { mb::decode_audio(wav_bytes(1, kRate, 16, data), "long.wav"); });
  EXPECT_NE(m.find("long.wav"), std::string::npos) << m;
  EXPECT_NE(m.find("3600"), std::string::npos) << m;
  data.resize(hour * 2);
  EXPECT_EQ(mb::decode_audio(wav_bytes(1, kRate, 16, data), "hour.wav").frames(), hour);
}

TEST(AudioDecode, ShortDataChunkDecodesWhatIsThere) {
  // libsndfile, like soundfile, reads the samples a cut-off file still has; a header cut short is an error (above).
  std::vector<uint8_t> bytes = mb::read_media_file(audio_path("speech_16k_s16.wav"));
  const mb::Waveform whole = mb::decode_audio(bytes, "whole");
  bytes.resize(44 + 1000);
  const mb::Waveform cut = mb::decode_audio(bytes, "cut");
  ASSERT_EQ(cut.frames(), 500u);
  EXPECT_TRUE(std::equal(cut.samples.begin(), cut.samples.end(), whole.samples.begin()));
}

// While alive: stderr goes to /dev/null and this thread's allocations are not leak-checked. For corrupt input
// through third-party decoders only: mpg123 (inside libsndfile) prints notes about bad frames to stderr, and
// libsndfile 1.2.0 + libvorbis 1.3.7 leak the Vorbis header state when a corrupt Ogg stream fails to open
// (an upstream bug: ~23 KB per such file).
class ThirdPartyDecoderNoise {
 public:
  ThirdPartyDecoderNoise() {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (null >= 0) {
      ::dup2(null, 2);
      ::close(null);
    }
#ifdef MB_AUDIO_TEST_ASAN
    __lsan_disable();
#endif
  }
  ~ThirdPartyDecoderNoise() {
#ifdef MB_AUDIO_TEST_ASAN
    __lsan_enable();
#endif
    std::fflush(stderr);
    if (saved_ >= 0) {
      ::dup2(saved_, 2);
      ::close(saved_);
    }
  }
  ThirdPartyDecoderNoise(const ThirdPartyDecoderNoise&) = delete;
  ThirdPartyDecoderNoise& operator=(const ThirdPartyDecoderNoise&) = delete;

 private:
  int saved_ = -1;
};

TEST(AudioDecode, CorruptedFilesNeverCrash) {
  // Truncations and byte flips of every format: each either decodes or throws mb::Error (ASan/UBSan in CI).
  uint64_t state = 12345;
  auto next = [&] { return mb::splitmix64_next(state); };
  int decoded = 0, refused = 0;
  for (const char* name : {"speech_16k_s16.wav", "stereo_44k1_f32.wav", "speech_48k.flac", "speech_22k05.ogg",
                           "speech_44k1.mp3", "tone_24k_s24.wav"}) {
    const std::vector<uint8_t> original = mb::read_media_file(audio_path(name));
    for (int trial = 0; trial < 24; ++trial) {
      std::vector<uint8_t> bytes = original;
      if (trial % 3 == 0) bytes.resize(next() % bytes.size());
      const int flips = 1 + int(next() % 16);
      // Mostly in the first 256 bytes, where the headers are.
      for (int f = 0; f < flips && !bytes.empty(); ++f)
        bytes[next() % std::min<size_t>(bytes.size(), 256)] ^= uint8_t(next());
      try {
        const ThirdPartyDecoderNoise quiet;
        const mb::Waveform w = mb::decode_audio(bytes, name);
        EXPECT_GT(w.channels, 0);
        EXPECT_EQ(w.samples.size() % size_t(w.channels), 0u);
        ++decoded;
      } catch (const mb::Error&) {
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(decoded, 0);
}

// ---------------------------------------------------------------------------------------------- mono, resampling

TEST(AudioMono, ChannelMeanAndPassThrough) {
  const mb::Waveform stereo = mb::read_audio_file(audio_path("stereo_44k1_f32.wav"));
  const std::vector<float> mono = mb::to_mono(stereo);
  ASSERT_EQ(mono.size(), stereo.frames());
  for (size_t t = 0; t < mono.size(); ++t)
    ASSERT_EQ(mono[t], (stereo.samples[2 * t] + stereo.samples[2 * t + 1]) / 2.0f) << t;  // numpy float32 mean
  const mb::Waveform one = mb::read_audio_file(audio_path("speech_16k_s16.wav"));
  EXPECT_EQ(mb::to_mono(one), one.samples);
  mb::Waveform three{16000, 3, {0.1f, 0.2f, 0.6f, -1.0f, 0.0f, 1.0f}};
  const std::vector<float> m3 = mb::to_mono(three);
  ASSERT_EQ(m3.size(), 2u);
  EXPECT_FLOAT_EQ(m3[0], 0.3f);
  EXPECT_FLOAT_EQ(m3[1], 0.0f);
  EXPECT_THROW(mb::to_mono(mb::Waveform{16000, 2, {0.1f, 0.2f, 0.3f}}), mb::Error);
  EXPECT_THROW(mb::to_mono(mb::Waveform{16000, 0, {}}), mb::Error);
}

TEST(AudioResample, MatchesPythonSoxr) {
  // The same libsoxr recipe as soxr.resample(x, sr, 16000, quality="HQ"): bit-identical on x86-64 with Debian's
  // libsoxr 0.1.3 and python-soxr 1.1.0's bundled one; 1e-6 leaves room for another SIMD path of libsoxr.
  int checked = 0;
  for (const auto& [name, ref] : cases()["files"].items()) {
    if (!ref.contains("resampled")) continue;
    SCOPED_TRACE(name);
    const std::vector<float> ours = waveform_16k(name);
    const std::vector<float> expected = mbtest::read_f32(audio_path(ref["resampled"].get<std::string>()));
    ASSERT_EQ(ours.size(), ref["resampled_len"].get<size_t>());
    // Lossy decodes differ slightly between libsndfile builds (LossyFilesMatchSoundfileClosely).
    EXPECT_LE(max_abs_diff(ours, expected), ref["lossless"].get<bool>() ? 1e-6f : 2e-6f);
    ++checked;
  }
  EXPECT_EQ(checked, 7);
}

TEST(AudioResample, KeepsAToneAndItsLength) {
  for (int rate : {44100, 48000, 8000, 22050}) {
    SCOPED_TRACE(rate);
    auto tone_at = [](size_t i, int r) { return float(0.5 * std::sin(2 * std::numbers::pi * 1000.0 * double(i) / r)); };
    std::vector<float> tone(static_cast<size_t>(rate));  // 1 s of 1 kHz
    for (size_t i = 0; i < tone.size(); ++i) tone[i] = tone_at(i, rate);
    const std::vector<float> out = mb::resample(tone, rate, 16000);
    ASSERT_EQ(out.size(), 16000u);
    // Away from the ends (where the filter sees the zeros beyond the signal) the tone is intact: measured 3e-7
    // from 44.1/48 kHz and 9e-5 from 8 kHz (SOXR_HQ's passband ripple and float32).
    float worst = 0.0f;
    for (size_t i = 200; i + 200 < out.size(); ++i)
      worst = std::max(worst, std::fabs(out[i] - tone_at(i, 16000)));
    EXPECT_LT(worst, rate == 8000 ? 2e-4f : 1e-5f);
  }
  // Output length is n * to / from, rounded (libsoxr removes its filter delay and flushes the tail).
  const std::vector<float> odd(30882, 0.25f);
  EXPECT_EQ(mb::resample(odd, 44100, 16000).size(), 11204u);
  EXPECT_EQ(mb::resample(std::vector<float>(5613, 0.1f), 8000, 16000).size(), 11226u);
}

TEST(AudioResample, SameRateCopiesAndBadRatesThrow) {
  const std::vector<float> x = {0.1f, -0.2f, 0.3f};
  EXPECT_EQ(mb::resample(x, 16000, 16000), x);
  EXPECT_TRUE(mb::resample({}, 44100, 16000).empty());
  EXPECT_THROW(mb::resample(x, 0, 16000), mb::Error);
  EXPECT_THROW(mb::resample(x, 16000, -1), mb::Error);
}

// ---------------------------------------------------------------------------------------------- features

void expect_features_match(const AudioFeatures& f, const nlohmann::json& ref, const std::string& features_file,
                           float tolerance) {
  EXPECT_EQ(f.n_frames, ref["n_frames"].get<int>());
  EXPECT_EQ(std::count(f.valid.begin(), f.valid.end(), uint8_t(1)), ref["n_valid"].get<int>());
  EXPECT_EQ(f.n_soft_tokens, ref["n_soft_tokens"].get<int>());
  const std::vector<float> expected = mbtest::read_f32(audio_path(features_file));
  EXPECT_LE(max_abs_diff(f.mel, expected), tolerance);
}

TEST(AudioFeatures, MatchHfOn16kWaveforms) {
  // Same float32 waveform in, so the only differences could be FFT and libm rounding: measured 0 (bit-exact).
  for (const char* name : {"speech_16k_s16.wav", "clipped_16k_s16.wav", "short_16k_s16.wav"}) {
    SCOPED_TRACE(name);
    const nlohmann::json& ref = cases()["files"][name];
    const AudioFeatures f = extract_features(mb::read_audio_file(audio_path(name)).samples);
    EXPECT_EQ(f.n_mels, 128);
    expect_features_match(f, ref, ref["features"].get<std::string>(), 1e-4f);
  }
}

TEST(AudioFeatures, MatchHfAfterDecodingAndResampling) {
  // decode -> channel mean -> libsoxr -> features, against soundfile -> numpy mean -> python-soxr -> HF.
  // Lossless inputs and this MP3: 0 (bit-exact). Vorbis: Debian's decoder differs from soundfile's by 6e-8, which
  // the log turns into 2.5e-5 in bins near the mel floor; 1e-3 leaves room for other libvorbis builds.
  for (const auto& [name, ref] : cases()["files"].items()) {
    if (!ref.contains("resampled")) continue;
    SCOPED_TRACE(name);
    const float tolerance = ref["lossless"].get<bool>() ? 1e-4f : 1e-3f;
    expect_features_match(extract_features(waveform_16k(name)), ref, ref["features"].get<std::string>(), tolerance);
  }
}

TEST(AudioFeatures, SilenceAndFilterZeroAreTheMelFloor) {
  const float floor_feature = float(std::log(1e-3));  // HF: float32(log(0 + mel_floor)) in float64
  const AudioFeatures silence = extract_features(mb::read_audio_file(audio_path("silence_16k_s16.wav")).samples);
  EXPECT_EQ(silence.n_frames, 99);
  EXPECT_EQ(silence.n_soft_tokens, 25);
  for (int t = 0; t < silence.n_frames; ++t) {
    ASSERT_TRUE(silence.valid[size_t(t)]);
    for (int j = 0; j < 128; ++j) ASSERT_EQ(silence.mel[size_t(t) * 128 + size_t(j)], floor_feature);
  }
  // Filter 0 (0 to 27.9 Hz) covers only the 0 Hz bin, where its weight is 0: a constant on every valid frame.
  const AudioFeatures speech = extract_features(mb::read_audio_file(audio_path("speech_16k_s16.wav")).samples);
  for (int t = 0; t < speech.n_frames; ++t)
    EXPECT_EQ(speech.mel[size_t(t) * 128], speech.valid[size_t(t)] ? floor_feature : 0.0f) << t;
  EXPECT_NEAR(floor_feature, -6.907755f, 1e-6f);
}

TEST(AudioFeatures, FrameAndSoftTokenCountsMatchHf) {
  for (const auto& ref : cases()["soft_tokens"]) {
    const size_t n = ref["n_samples"].get<size_t>();
    SCOPED_TRACE(n);
    EXPECT_EQ(mb::gemma4_audio::audio_soft_tokens(n), ref["n_soft_tokens"].get<int>());
    if (n > 50000) continue;  // the long ones run through extract_features in LongAudioIsCutAt30Seconds
    const AudioFeatures f = extract_features(std::vector<float>(n, 0.0f));
    EXPECT_EQ(f.n_frames, ref["n_frames"].get<int>());
    EXPECT_EQ(std::count(f.valid.begin(), f.valid.end(), uint8_t(1)), ref["n_valid"].get<int>());
    EXPECT_EQ(f.n_soft_tokens, ref["n_soft_tokens"].get<int>());
    EXPECT_EQ(f.mel.size(), size_t(f.n_frames) * 128);
  }
  // The spec's table (gemma4-multimodal.md 3.1, 3.2): 25 tokens per second, at most 750.
  for (auto [seconds, tokens] : {std::pair{0.1, 3}, {1.0, 25}, {2.0, 50}, {10.0, 250}, {30.0, 750}, {31.0, 750},
                                 {3600.0, 750}})
    EXPECT_EQ(mb::gemma4_audio::audio_soft_tokens(size_t(seconds * 16000)), tokens) << seconds << " s";
  EXPECT_EQ(extract_features(std::vector<float>(16000, 0.0f)).n_frames, 99);
}

TEST(AudioFeatures, LongAudioIsCutAt30Seconds) {
  const nlohmann::json& ref = cases()["long_31s"];
  const std::vector<float> speech = mb::read_audio_file(audio_path("speech_16k_s16.wav")).samples;
  std::vector<float> wave(ref["n_samples"].get<size_t>());
  for (size_t i = 0; i < wave.size(); ++i) wave[i] = speech[i % speech.size()];
  const AudioFeatures f = extract_features(wave);
  EXPECT_EQ(f.n_frames, 2999);
  EXPECT_EQ(f.n_frames, ref["n_frames"].get<int>());
  EXPECT_EQ(f.n_soft_tokens, 750);
  EXPECT_EQ(std::count(f.valid.begin(), f.valid.end(), uint8_t(1)), ref["n_valid"].get<int>());
  double sum = 0, sum_abs = 0;
  for (float v : f.mel) {
    sum += v;
    sum_abs += std::fabs(v);
  }
  EXPECT_NEAR(sum, ref["sum"].get<double>(), 1e-9 * ref["sum_abs"].get<double>());
  EXPECT_NEAR(sum_abs, ref["sum_abs"].get<double>(), 1e-9 * ref["sum_abs"].get<double>());
  const std::vector<float> rows = mbtest::read_f32(audio_path(ref["rows_file"].get<std::string>()));
  ASSERT_EQ(rows.size(), ref["rows"].size() * 128);
  for (size_t r = 0; r < ref["rows"].size(); ++r) {
    const size_t t = ref["rows"][r].get<size_t>();
    EXPECT_LE(max_abs_diff({f.mel.data() + t * 128, 128}, {rows.data() + r * 128, 128}), 1e-4f) << "row " << t;
  }
}

TEST(AudioFeatures, ShortInputsHaveFewOrNoFrames) {
  for (size_t n : {0u, 1u, 128u}) {
    const AudioFeatures f = extract_features(std::vector<float>(n, 0.5f));
    EXPECT_EQ(f.n_frames, 0) << n;
    EXPECT_TRUE(f.mel.empty());
    EXPECT_EQ(f.n_soft_tokens, 0);
  }
  const AudioFeatures one = extract_features(std::vector<float>(129, 0.5f));  // one frame, not on real audio
  EXPECT_EQ(one.n_frames, 1);
  EXPECT_EQ(one.valid[0], 0);
  EXPECT_EQ(one.n_soft_tokens, 0);
}

TEST(AudioFeatures, ParsesTheSavedProcessorConfig) {
  const AudioFeatureConfig c =
      mb::gemma4_audio::parse_audio_feature_config(mbtest::read_json(audio_path("processor_config.json")));
  const AudioFeatureConfig d;
  EXPECT_EQ(c.feature_size, 128);
  EXPECT_EQ(c.sampling_rate, 16000);
  EXPECT_EQ(c.frame_length, 320);
  EXPECT_EQ(c.hop_length, 160);
  EXPECT_EQ(c.fft_length, 512);
  EXPECT_EQ(c.min_frequency, 0.0);
  EXPECT_EQ(c.max_frequency, 8000.0);
  EXPECT_EQ(c.mel_floor, 1e-3);
  EXPECT_EQ(c.preemphasis, 0.0);
  EXPECT_TRUE(c.preemphasis_htk_flavor);
  EXPECT_EQ(c.input_scale_factor, 1.0);
  EXPECT_FALSE(c.padding_left);
  EXPECT_TRUE(c.per_bin_mean.empty() && c.per_bin_stddev.empty());
  EXPECT_EQ(c.max_length, 480000u);
  EXPECT_EQ(c.pad_to_multiple_of, 128u);
  EXPECT_TRUE(c.truncation);
  EXPECT_EQ(c.frame_length, d.frame_length);
  // The flat form (preprocessor_config.json, or the object alone) reads the same.
  const nlohmann::json flat = mbtest::read_json(audio_path("processor_config.json"))["feature_extractor"];
  EXPECT_EQ(mb::gemma4_audio::parse_audio_feature_config(flat).fft_length, 512);
}

TEST(AudioFeatures, RefusesConfigsItCannotFollow) {
  auto parse = [](nlohmann::json fe) {
    return mb::gemma4_audio::parse_audio_feature_config({{"feature_extractor", fe}});
  };
  const nlohmann::json base = mbtest::read_json(audio_path("processor_config.json"))["feature_extractor"];
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json fe = base;
    fe[key] = v;
    return fe;
  };
  std::string m = error_of([&] { parse(with("feature_extractor_type", "Gemma4UnifiedAudioFeatureExtractor")); });
  EXPECT_NE(m.find("Gemma4UnifiedAudioFeatureExtractor"), std::string::npos) << m;
  m = error_of([&] { parse(with("dither", 1e-4)); });
  EXPECT_NE(m.find("dither"), std::string::npos) << m;
  // HF recomputes frame_length from frame_length_ms (20 by default) and would silently ignore this 400.
  m = error_of([&] { parse(with("frame_length", 400)); });
  EXPECT_NE(m.find("frame_length"), std::string::npos) << m;
  m = error_of([&] { parse(with("feature_size", "128")); });
  EXPECT_NE(m.find("feature_size"), std::string::npos) << m;
  m = error_of([&] { parse(with("per_bin_mean", nlohmann::json::array({1.0, 2.0}))); });
  EXPECT_NE(m.find("per_bin_mean"), std::string::npos) << m;
  m = error_of([] { mb::gemma4_audio::parse_audio_feature_config({{"image_processor", nlohmann::json::object()}}); });
  EXPECT_NE(m.find("no feature_extractor"), std::string::npos) << m;
}

TEST(AudioFeatures, OptionalStepsMatchHf) {
  // preemphasis (HTK), fft_overdrive (1024-point FFT), left padding, input scaling, per-bin normalisation
  // (saved nested as [[[...]]]), 80 mels over 50..7000 Hz, mel_floor 1e-5.
  const nlohmann::json& ref = cases()["variant"];
  const AudioFeatureConfig c = mb::gemma4_audio::parse_audio_feature_config(
      mbtest::read_json(audio_path(ref["config"].get<std::string>())));
  EXPECT_EQ(c.fft_length, 1024);
  EXPECT_TRUE(c.padding_left);
  ASSERT_EQ(c.per_bin_mean.size(), 80u);
  const AudioFeatures f = extract_features(mb::read_audio_file(audio_path("speech_16k_s16.wav")).samples, c);
  EXPECT_EQ(f.n_mels, 80);
  expect_features_match(f, ref, ref["features"].get<std::string>(), 1e-4f);
}

TEST(AudioFeatures, ConcurrentCallsAgree) {
  const std::vector<float> speech = mb::read_audio_file(audio_path("speech_16k_s16.wav")).samples;
  AudioFeatureConfig overdrive;  // a 1024-point plan that no other test may have made yet: planned concurrently
  overdrive.fft_length = 1024;
  const AudioFeatures ref = extract_features(speech), ref_overdrive = extract_features(speech, overdrive);
  std::vector<AudioFeatures> results(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i)
    threads.emplace_back([&, i] { results[i] = extract_features(speech, i % 2 ? overdrive : AudioFeatureConfig{}); });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < results.size(); ++i) EXPECT_EQ(results[i].mel, (i % 2 ? ref_overdrive : ref).mel) << i;
}

// ---------------------------------------------------------------------------------------------- 12B unified

TEST(AudioUnified, FramesAndTokensMatchHf) {
  for (const auto& ref : cases()["unified"]) {
    const size_t n = ref["n_samples"].get<size_t>();
    EXPECT_EQ(mb::gemma4_audio::unified_audio_soft_tokens(n), ref["n_tokens"].get<int>()) << n;
    EXPECT_EQ(size_t(mb::gemma4_audio::unified_audio_soft_tokens(n)), ref["shape"][0].get<size_t>()) << n;
  }
  EXPECT_EQ(mb::gemma4_audio::unified_audio_soft_tokens(0), 0);
  EXPECT_EQ(mb::gemma4_audio::unified_audio_soft_tokens(500000), 782);  // no 750 cap: HF's max_length is None

  const nlohmann::json& ref = cases()["unified_speech"];
  const std::vector<float> speech = mb::read_audio_file(audio_path("speech_16k_s16.wav")).samples;
  const std::vector<float> frames = mb::gemma4_audio::unified_audio_frames(speech);
  ASSERT_EQ(frames.size(), ref["shape"][0].get<size_t>() * mb::gemma4_audio::kUnifiedAudioSamplesPerToken);
  EXPECT_TRUE(std::equal(speech.begin(), speech.end(), frames.begin()));
  EXPECT_EQ(size_t(std::count(frames.begin() + long(speech.size()), frames.end(), 0.0f)),
            ref["tail_zeros"].get<size_t>());
  double sum = 0;
  for (float v : frames) sum += v;
  EXPECT_NEAR(sum, ref["sum"].get<double>(), 1e-9);
  EXPECT_TRUE(mb::gemma4_audio::unified_audio_frames({}).empty());
}

}  // namespace
