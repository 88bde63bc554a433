// Audio in: decoding (libsndfile: WAV, FLAC, OGG/Vorbis, Opus, MP3 and the rest of what it reads), downmix to
// mono and sample-rate conversion (libsoxr). No model knowledge: a model's front-end takes the mono waveform at
// its own rate from here. Mirrors what Hugging Face users feed their processors: `soundfile.read(dtype="float32")`
// (the same libsndfile float decode), `librosa.to_mono` (channel mean) and `librosa.resample` (whose default
// `res_type="soxr_hq"` is python-soxr over libsoxr, SOXR_HQ, the recipe used here).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace mb {

struct Waveform {
  int sample_rate = 0;
  int channels = 0;
  std::vector<float> samples;  // interleaved [frames, channels]; nominally [-1,1] (float files are not clipped)
  size_t frames() const { return channels > 0 ? samples.size() / size_t(channels) : 0; }
};

// What a decode accepts before it allocates anything: a header declaring more than this is refused up front,
// and a stream that decodes to more (lengths of compressed streams are estimates) is refused when it gets there.
inline constexpr double kMaxAudioSeconds = 3600.0;
inline constexpr size_t kMaxAudioSamples = size_t(1) << 29;  // interleaved, 2 GiB of float: 1 h of 48 kHz stereo fits
inline constexpr int kMaxAudioChannels = 256;
inline constexpr int kMinAudioSampleRate = 1000;
inline constexpr int kMaxAudioSampleRate = 768000;

// Decodes a whole audio file held in memory. `what` names it in errors (a path, "request audio #2", ...).
// Throws mb::Error for empty, truncated, corrupt or unrecognised input, an unsupported codec, no channels, no
// samples, non-finite float samples, and lengths/rates/channel counts outside the limits above.
Waveform decode_audio(std::span<const uint8_t> bytes, const std::string& what);
Waveform read_audio_file(const std::string& path);

// The mean over channels of each frame (librosa.to_mono, torchaudio's `mean(dim=0)`); a copy for mono.
std::vector<float> to_mono(const Waveform& audio);

// Band-limited resampling with libsoxr at SOXR_HQ (20-bit precision, 91% passband, linear phase), driven the way
// python-soxr's `soxr.resample(x, from_rate, to_rate, quality="HQ")` drives it (same chunking, same output
// length: about n * to_rate / from_rate, the filter delay removed). A copy when the rates match.
std::vector<float> resample(std::span<const float> mono, int from_rate, int to_rate);

}  // namespace mb
