// Audio decoding over libsndfile's virtual I/O, channel downmix, and libsoxr resampling (see audio.h).
// Why libsoxr rather than a hand-written interpolator: speech models are trained on band-limited 16 kHz audio, and
// a naive (linear) resampler aliases everything above the new Nyquist frequency back into the band. libsoxr's
// SOXR_HQ is a linear-phase band-limiting FIR design (20-bit precision, ~120 dB) and is what librosa uses by default
// (res_type "soxr_hq": librosa.resample is soxr.resample(x, sr, target, "HQ") padded or cut to ceil(n * ratio)),
// so the waveforms are what HF users feed the processors: Debian's libsoxr 0.1.3 and python-soxr 1.1.0 give
// bit-identical output with the recipe below. On a 1 kHz tone at 0.5 (tools/reference/make_audio_cases.py, cases.json
// "resampler"): libsoxr is 3e-7 from the ideal 16 kHz tone away from the ends (9e-5 from 8 kHz);
// torchaudio.functional.resample (a shorter Hann-windowed sinc, width 6, rolloff 0.99) differs from it by 2e-4
// there and by up to 1.1e-3 (5e-3 from 8 kHz) over the first and last samples.
#include "media/audio.h"

#include <sndfile.h>
#include <soxr.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/mmap.h"

namespace mb {

namespace {

// The memory libsndfile reads through its virtual I/O callbacks; positions are kept inside [0, size].
struct MemoryStream {
  std::span<const uint8_t> bytes;
  sf_count_t pos = 0;
};

sf_count_t stream_length(void* user) { return sf_count_t(static_cast<MemoryStream*>(user)->bytes.size()); }

sf_count_t stream_seek(sf_count_t offset, int whence, void* user) {
  auto* s = static_cast<MemoryStream*>(user);
  const sf_count_t size = sf_count_t(s->bytes.size());
  sf_count_t base = 0;
  switch (whence) {
    case SEEK_SET: base = 0; break;
    case SEEK_CUR: base = s->pos; break;
    case SEEK_END: base = size; break;
    default: return -1;
  }
  // Checked before the addition: a corrupt header can ask for any offset, and none may overflow or leave [0, size].
  if (offset < -base || offset > size - base) return -1;
  s->pos = base + offset;
  return s->pos;
}

sf_count_t stream_read(void* out, sf_count_t count, void* user) {
  auto* s = static_cast<MemoryStream*>(user);
  if (count <= 0) return 0;
  const sf_count_t n = std::min(count, sf_count_t(s->bytes.size()) - s->pos);
  if (n <= 0) return 0;
  std::memcpy(out, s->bytes.data() + s->pos, size_t(n));
  s->pos += n;
  return n;
}

sf_count_t stream_write(const void*, sf_count_t, void*) { return 0; }

sf_count_t stream_tell(void* user) { return static_cast<MemoryStream*>(user)->pos; }

struct SndfileCloser {
  void operator()(SNDFILE* f) const { sf_close(f); }
};

std::string format_name(int format) {
  SF_FORMAT_INFO info{};
  info.format = format & SF_FORMAT_TYPEMASK;
  if (sf_command(nullptr, SFC_GET_FORMAT_INFO, &info, sizeof info) == 0 && info.name) return info.name;
  return fmt::format("format 0x{:x}", format);
}

}  // namespace

Waveform decode_audio(std::span<const uint8_t> bytes, const std::string& what) {
  MB_CHECK(!bytes.empty(), "audio {}: the file is empty (0 bytes)", what);
  MemoryStream stream{bytes, 0};
  SF_VIRTUAL_IO io{stream_length, stream_seek, stream_read, stream_write, stream_tell};
  SF_INFO info{};
  std::unique_ptr<SNDFILE, SndfileCloser> file(sf_open_virtual(&io, SFM_READ, &info, &stream));
  if (!file) {
    // sf_strerror(nullptr) is libsndfile's last open error (process-wide; at worst another thread's message).
    const char* why = sf_strerror(nullptr);
    fail("audio {}: cannot decode it ({} bytes): {} (readable: WAV, FLAC, OGG/Vorbis, Opus, MP3, AIFF, ...)", what,
         bytes.size(), why ? why : "unknown error");
  }
  const std::string format = format_name(info.format);
  MB_CHECK(info.channels > 0, "audio {}: {} stream with no channels", what, format);
  MB_CHECK(info.channels <= kMaxAudioChannels, "audio {}: {} channels; at most {} are accepted", what, info.channels,
           kMaxAudioChannels);
  MB_CHECK(info.samplerate >= kMinAudioSampleRate && info.samplerate <= kMaxAudioSampleRate,
           "audio {}: sample rate {} Hz is outside {}..{} Hz", what, info.samplerate, kMinAudioSampleRate,
           kMaxAudioSampleRate);
  const size_t channels = size_t(info.channels);
  const size_t max_frames = std::min(size_t(kMaxAudioSeconds * info.samplerate), kMaxAudioSamples / channels);
  // The declared length sizes the buffer when it is plausible; compressed streams only estimate it, and
  // SF_COUNT_MAX means "unknown", so the read loop below enforces the limit on what actually decodes.
  if (info.frames > 0 && info.frames != SF_COUNT_MAX && uint64_t(info.frames) > max_frames)
    fail("audio {}: declares {} frames ({:.0f} s at {} Hz, {} channels); the limit is {:.0f} s and {} samples", what,
         info.frames, double(info.frames) / info.samplerate, info.samplerate, info.channels, kMaxAudioSeconds,
         kMaxAudioSamples);

  sf_command(file.get(), SFC_SET_NORM_FLOAT, nullptr, SF_TRUE);  // integer PCM to [-1,1), as soundfile reads it
  Waveform out;
  out.sample_rate = info.samplerate;
  out.channels = info.channels;
  const size_t chunk_frames = std::max<size_t>(1, (size_t(1) << 18) / channels);
  // A header may declare an hour that the bytes do not hold: reserve at most 8 samples per input byte (all that
  // PCM and typical compressed audio need), and let the vector grow with what really decodes.
  if (info.frames > 0 && info.frames != SF_COUNT_MAX)
    out.samples.reserve(std::min(size_t(info.frames) * channels, 8 * bytes.size() + chunk_frames * channels));
  size_t frames = 0;
  for (;;) {
    // One frame past the limit is asked for so that a stream of exactly max_frames is accepted.
    const size_t want = std::min(chunk_frames, max_frames + 1 - frames);
    out.samples.resize((frames + want) * channels);
    const sf_count_t got = sf_readf_float(file.get(), out.samples.data() + frames * channels, sf_count_t(want));
    frames += size_t(std::max<sf_count_t>(got, 0));
    out.samples.resize(frames * channels);
    MB_CHECK(frames <= max_frames,
             "audio {}: decodes to more than {} frames ({:.0f} s at {} Hz); the limit is {:.0f} s", what, max_frames,
             double(max_frames) / info.samplerate, info.samplerate, kMaxAudioSeconds);
    if (got <= 0) break;
  }
  if (const int err = sf_error(file.get()); err != SF_ERR_NO_ERROR)
    fail("audio {}: {} stream is corrupt after {} frames: {}", what, format, frames, sf_error_number(err));
  MB_CHECK(frames > 0, "audio {}: {} stream contains no samples (truncated or empty)", what, format);
  for (size_t i = 0; i < out.samples.size(); ++i)
    MB_CHECK(std::isfinite(out.samples[i]), "audio {}: sample {} of channel {} is not finite ({})", what,
             i / channels, i % channels, out.samples[i]);
  out.samples.shrink_to_fit();
  return out;
}

Waveform read_audio_file(const std::string& path) {
  std::shared_ptr<MappedFile> file = MappedFile::open(path);
  if (file->size() == 0) return decode_audio({}, path);
  return decode_audio({file->data(), file->size()}, path);
}

std::vector<float> to_mono(const Waveform& audio) {
  MB_CHECK(audio.channels > 0, "to_mono: audio with {} channels", audio.channels);
  const size_t channels = size_t(audio.channels);
  MB_CHECK(audio.samples.size() % channels == 0, "to_mono: {} samples do not divide into {} channels",
           audio.samples.size(), channels);
  if (channels == 1) return audio.samples;
  const size_t frames = audio.samples.size() / channels;
  std::vector<float> mono(frames);
  // A double sum rounds once at the end: for two channels this is float32 (a + b) / 2 exactly, which is what
  // numpy's and torch's float32 mean give.
  for (size_t t = 0; t < frames; ++t) {
    double sum = 0.0;
    for (size_t c = 0; c < channels; ++c) sum += double(audio.samples[t * channels + c]);
    mono[t] = float(sum / double(channels));
  }
  return mono;
}

std::vector<float> resample(std::span<const float> mono, int from_rate, int to_rate) {
  MB_CHECK(from_rate > 0 && to_rate > 0, "resample: sample rates must be positive (from {} Hz to {} Hz)", from_rate,
           to_rate);
  if (from_rate == to_rate || mono.empty()) return {mono.begin(), mono.end()};
  // python-soxr's output buffer: soxr returns at most this many samples, the flush included.
  const double capacity = double(mono.size()) * double(to_rate) / double(from_rate) + 1.0;
  MB_CHECK(capacity <= double(kMaxAudioSamples), "resample: {} samples from {} Hz to {} Hz would exceed {} samples",
           mono.size(), from_rate, to_rate, kMaxAudioSamples);
  std::vector<float> out(size_t(capacity), 0.0f);

  soxr_error_t err = nullptr;
  const soxr_io_spec_t io = soxr_io_spec(SOXR_FLOAT32_I, SOXR_FLOAT32_I);
  const soxr_quality_spec_t quality = soxr_quality_spec(SOXR_HQ, 0);
  const soxr_runtime_spec_t runtime = soxr_runtime_spec(1);
  std::unique_ptr<soxr, decltype(&soxr_delete)> resampler(
      soxr_create(double(from_rate), double(to_rate), 1, &err, &io, &quality, &runtime), soxr_delete);
  if (err || !resampler) fail("resample {} Hz -> {} Hz: libsoxr: {}", from_rate, to_rate, err ? err : "no resampler");

  // The same input chunks as python-soxr (48000 output samples' worth, at least 1000), so both see one stream.
  const size_t chunk = size_t(std::max(1000.0, 48000.0 * double(from_rate) / double(to_rate)));
  size_t written = 0;
  for (size_t pos = 0; pos < mono.size(); pos += chunk) {
    size_t done = 0;
    err = soxr_process(resampler.get(), mono.data() + pos, std::min(chunk, mono.size() - pos), nullptr,
                       out.data() + written, out.size() - written, &done);
    if (err) fail("resample {} Hz -> {} Hz: libsoxr: {}", from_rate, to_rate, err);
    written += done;
  }
  size_t done = 0;
  err = soxr_process(resampler.get(), nullptr, 0, nullptr, out.data() + written, out.size() - written, &done);
  if (err) fail("resample {} Hz -> {} Hz: libsoxr: {}", from_rate, to_rate, err);
  written += done;
  out.resize(written);
  return out;
}

}  // namespace mb
