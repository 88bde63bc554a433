#!/usr/bin/env python3
"""Test audio files and what soundfile, python-soxr and transformers' Gemma 4 audio feature extractors make of
them, for tests/test_audio.cpp (src/media/audio.*, src/models/gemma4_audio/features.*).

  python3 tools/reference/make_audio_cases.py   # rewrites tests/fixtures/audio/ (deterministic, ~10 s)

Requires transformers 5.17.0 (warns on any other version), numpy >= 2, soundfile (its wheel bundles libsndfile
1.2.2 with MP3/Vorbis/FLAC), soxr (python-soxr). torchaudio is optional: when importable, the resampler comparison
below also reports torchaudio.functional.resample. The waveforms come from a seeded numpy generator and the
lossless files store them exactly, so a rerun writes the same inputs; the lossy encoders (Vorbis, LAME) are
deterministic too for a given library build, except that libsndfile gives each Ogg stream a random serial
number: speech_22k05.ogg's bytes change from run to run, its decoded samples do not.

Feature references depend only on the float32 16 kHz mono waveform that enters Gemma4AudioFeatureExtractor, so
  * 16 kHz files are int16 WAVs: the waveform is exactly int16 / 32768, as libsndfile's float read gives it, and
    C++ and HF see the same samples;
  * other rates: soundfile's decode, channel mean (numpy float32, as librosa.to_mono), soxr.resample(x, sr, 16000,
    quality="HQ") -- which is librosa.resample's default (res_type "soxr_hq"; librosa then only pads/trims to
    ceil(n * ratio)) -- then HF. The resampled waveform is stored too, to check libsoxr's C output against it.

Outputs in tests/fixtures/audio/ (< 2 MB together):
  speech_16k_s16.wav   1.3 s mono 16 kHz PCM_16, speech-like (rising pitch with harmonics, formants, syllable
                       envelope, noise)
  silence_16k_s16.wav  1 s of zeros;  clipped_16k_s16.wav  0.5 s at full scale (-32768 and 32767);
  short_16k_s16.wav    0.05 s (800 samples)
  stereo_44k1_f32.wav  0.4 s stereo 44.1 kHz IEEE float (the channels differ)
  mono_8k_u8.wav       1 s mono 8 kHz unsigned 8-bit;  tone_24k_s24.wav 0.25 s 24-bit;  tone_32k_s32.wav 0.2 s
                       32-bit int
  speech_48k.flac      0.75 s mono 48 kHz FLAC 16-bit;  speech_22k05.ogg 0.5 s mono Vorbis;
  speech_44k1.mp3      0.25 s stereo 44.1 kHz MPEG-1 layer III
  truncated.wav        the first 30 bytes of speech_16k_s16.wav (cut inside the fmt chunk); empty.wav 0 bytes
  <name>.features.bin  HF's input_features [n_frames, 128] float32 (0 on invalid frames)
  <name>.16k.bin       the 16 kHz float32 waveform HF's features were computed from (files at other rates)
  <name>.decoded.bin   soundfile's float32 decode, interleaved (lossy files only: decoders may differ slightly)
  long_31s.rows.bin    rows 0, 1, 1000, 2997, 2998 of the features of the 31 s case (see cases.json)
  processor_config.json  what Gemma4Processor.save_pretrained writes (its feature_extractor object)
  variant_config.json, variant.features.bin  a feature extractor with preemphasis, fft_overdrive, left padding,
                       input scaling, per-bin normalisation and 80 mels, and its features of speech_16k_s16.wav
  cases.json:
    files: per file its rate, channels, frames, float64 checksums of the decode (sum, sum |x|, and
        sum((i % 97 + 1) * x_i) over interleaved samples), the first 16 samples, and for the feature cases
        n_frames / valid frames / soft tokens and the feature file names
    invalid: the bad files
    long_31s: speech_16k_s16.wav's int16 samples repeated to 496000 samples (31 s): frame count, soft tokens,
        float64 sum and sum |x| of the features, the rows stored in long_31s.rows.bin
    soft_tokens: per sample count (zeros), HF's frame count, valid frames and replace_audio_token's count
    unified: per sample count, Gemma4UnifiedAudioFeatureExtractor's frames and token count; unified_speech: the
        frames of speech_16k_s16.wav
    variant: the variant extractor's frame, valid-frame and soft-token counts
    resampler: python-soxr vs librosa-style vs torchaudio on a 1 kHz tone (max differences), for the record
"""
import json
import os
import sys
import tempfile
import warnings

import numpy as np
import soundfile as sf
import soxr
import transformers
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor

SEED = 20260423
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "audio")
LONG_ROWS = [0, 1, 1000, 2997, 2998]
SFC_SET_ADD_PEAK_CHUNK = 0x1050  # sndfile.h


def speech_like(n, sr, rng):
    """A voiced-speech stand-in: a pitch chirp (110 -> 190 Hz, with vibrato) and its harmonics shaped by two
    formants, under a 4 Hz syllable envelope, plus a little noise. Peak around 0.6."""
    t = np.arange(n) / sr
    dur = n / sr
    f0 = 110.0 + 80.0 * t / dur + 12.0 * np.sin(2 * np.pi * 5.0 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = np.zeros(n)
    for k in range(1, 40):
        fk = k * f0
        gain = (1.0 / k) * (1.0 + 3.0 * np.exp(-(((fk - 700.0) / 180.0) ** 2)) +
                            2.0 * np.exp(-(((fk - 1200.0) / 250.0) ** 2)) +
                            1.0 * np.exp(-(((fk - 2500.0) / 400.0) ** 2)))
        voiced += np.where(fk < 0.45 * sr, gain * np.sin(k * phase), 0.0)
    envelope = 0.15 + 0.85 * np.sin(np.pi * 4.0 * t) ** 2
    y = 0.12 * voiced * envelope + 0.01 * rng.standard_normal(n)
    return y / max(1.0, np.abs(y).max() / 0.6)


def to_int16(y):
    return np.round(np.clip(y, -1.0, 32767 / 32768) * 32768).astype(np.int16)


def fingerprint(x):
    """Checksums of an interleaved float32 decode (float64 sums, in order)."""
    flat = x.reshape(-1).astype(np.float64)
    weights = (np.arange(flat.size) % 97 + 1).astype(np.float64)
    return {"sum": float(flat.sum()), "sum_abs": float(np.abs(flat).sum()),
            "weighted_sum": float((flat * weights).sum()), "head": [float(v) for v in flat[:16]]}


def hf_features(fe, wave16k):
    """Gemma4AudioFeatureExtractor on one waveform, called as Gemma4Processor calls it (a list of one array)."""
    out = fe([wave16k.astype(np.float32)], return_tensors="np")
    feats = out["input_features"][0].astype(np.float32)
    mask = out["input_features_mask"][0].astype(bool)
    return feats, mask


def replace_audio_token_count(mask):
    """processing_gemma4.Gemma4Processor.replace_audio_token's count (the mask through two stride-2 convs)."""
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    return int(mask.sum())


def write_processor_config():
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma4 import Gemma4ImageProcessor, Gemma4Processor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(OUT, "..", "tokenizer", "synthetic-tokenizer.json"))
    for attr, t in (("image_token", "<|image|>"), ("boi_token", "<|image>"), ("eoi_token", "<image|>"),
                    ("audio_token", "<|audio|>"), ("boa_token", "<|audio>"), ("eoa_token", "<audio|>")):
        tok.add_special_tokens({"additional_special_tokens": [t]})
        setattr(tok, attr, t)
    tok.image_token_id = tok.convert_tokens_to_ids("<|image|>")
    tok.audio_token_id = tok.convert_tokens_to_ids("<|audio|>")
    proc = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=Gemma4ImageProcessor(),
                           tokenizer=tok, video_processor=Gemma4VideoProcessor())
    with tempfile.TemporaryDirectory() as d:
        proc.save_pretrained(d)
        with open(os.path.join(d, "processor_config.json")) as f:
            text = f.read()
    with open(os.path.join(OUT, "processor_config.json"), "w") as f:
        f.write(text)


def resampler_comparison():
    """python-soxr HQ (= libsoxr, = librosa's default) against torchaudio's default sinc resampler, on a tone."""
    out = {}
    for sr in (44100, 48000, 8000):
        n = sr  # 1 s
        tone = (0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(n) / sr)).astype(np.float32)
        ideal = 0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(16000) / 16000)
        ref = soxr.resample(tone, sr, 16000, quality="HQ")
        m = min(len(ref), 16000)
        # librosa.resample(res_type="soxr_hq") is this call followed by util.fix_length(ceil(n * ratio)).
        librosa_len = int(np.ceil(n * 16000 / sr))
        inner = slice(100, m - 100)  # away from the edges, where every resampler sees zeros beyond the signal
        case = {"soxr_len": int(len(ref)), "librosa_len": librosa_len,
                "soxr_vs_ideal_inner": float(np.abs(ref[inner] - ideal[inner]).max()),
                "soxr_vs_ideal_all": float(np.abs(ref[:m] - ideal[:m]).max())}
        try:
            import torch
            import torchaudio.functional as F
            ta = F.resample(torch.from_numpy(tone), sr, 16000).numpy()
            k = min(len(ta), m)
            case["torchaudio_len"] = int(len(ta))
            case["torchaudio_vs_soxr_inner"] = float(np.abs(ta[100:k - 100] - ref[100:k - 100]).max())
            case["torchaudio_vs_soxr_all"] = float(np.abs(ta[:k] - ref[:k]).max())
            case["torchaudio_vs_ideal_inner"] = float(np.abs(ta[100:k - 100] - ideal[100:k - 100]).max())
        except ImportError:
            case["torchaudio"] = "not installed"
        out[str(sr)] = case
    return out


def main():
    if transformers.__version__ != "5.17.0":
        warnings.warn(f"transformers {transformers.__version__}: the fixtures were made with 5.17.0")
    if int(np.__version__.split(".")[0]) < 2:
        sys.exit("numpy >= 2 needed: numpy 1.x runs HF's rfft in float64 and its features differ slightly")
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        os.remove(os.path.join(OUT, name))
    rng = np.random.default_rng(SEED)
    fe = Gemma4AudioFeatureExtractor()
    cases = {"transformers": transformers.__version__, "numpy": np.__version__, "soundfile": sf.__version__,
             "libsndfile": sf.__libsndfile_version__, "soxr": soxr.__version__,
             "files": {}, "invalid": {}}

    def write(name, data, sr, subtype, fmt=None):
        channels = 1 if data.ndim == 1 else data.shape[1]
        with sf.SoundFile(os.path.join(OUT, name), "w", sr, channels, subtype=subtype, format=fmt) as f:
            # No PEAK chunk in float WAVs: it carries a timestamp, and the files should not change from run to run.
            sf._snd.sf_command(f._file, SFC_SET_ADD_PEAK_CHUNK, sf._ffi.NULL, 0)
            f.write(data)

    # 16 kHz int16 files: the exact waveform is int16 / 32768.
    speech16 = to_int16(speech_like(20800, 16000, rng))
    write("speech_16k_s16.wav", speech16, 16000, "PCM_16")
    write("silence_16k_s16.wav", np.zeros(16000, np.int16), 16000, "PCM_16")
    t = np.arange(8000) / 16000
    write("clipped_16k_s16.wav", to_int16(np.clip(3.0 * np.sin(2 * np.pi * 220.0 * t), -1.0, 1.0)), 16000, "PCM_16")
    write("short_16k_s16.wav", to_int16(speech_like(800, 16000, rng)), 16000, "PCM_16")

    # Other rates, channel layouts and codecs.
    n = int(0.4 * 44100)
    left = speech_like(n, 44100, rng)
    right = 0.3 * np.sin(2 * np.pi * 3000.0 * np.arange(n) / 44100) + 0.5 * left
    write("stereo_44k1_f32.wav", np.stack([left, right], axis=1).astype(np.float32), 44100, "FLOAT")
    write("mono_8k_u8.wav", speech_like(8000, 8000, rng), 8000, "PCM_U8")
    write("tone_24k_s24.wav", 0.7 * np.sin(2 * np.pi * 440.0 * np.arange(6000) / 24000), 24000, "PCM_24")
    write("tone_32k_s32.wav", 0.9 * np.sin(2 * np.pi * 1234.5 * np.arange(6400) / 32000), 32000, "PCM_32")
    write("speech_48k.flac", to_int16(speech_like(36000, 48000, rng)), 48000, "PCM_16", "FLAC")
    write("speech_22k05.ogg", speech_like(11025, 22050, rng).astype(np.float32), 22050, "VORBIS", "OGG")
    n = int(0.25 * 44100)
    mp3 = speech_like(n, 44100, rng)
    write("speech_44k1.mp3", np.stack([mp3, 0.8 * mp3], axis=1).astype(np.float32), 44100, "MPEG_LAYER_III", "MP3")

    lossy = {"speech_22k05.ogg", "speech_44k1.mp3"}
    for name in sorted(os.listdir(OUT)):
        path = os.path.join(OUT, name)
        data, sr = sf.read(path, dtype="float32", always_2d=True)
        info = sf.info(path)
        entry = {"sample_rate": sr, "channels": int(data.shape[1]), "frames": int(data.shape[0]),
                 "format": info.format, "subtype": info.subtype, "lossless": name not in lossy}
        entry.update(fingerprint(data))
        if name in lossy:
            data.astype(np.float32).tofile(os.path.join(OUT, name + ".decoded.bin"))
            entry["decoded"] = name + ".decoded.bin"
        mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
        if sr != 16000:
            wave = soxr.resample(mono, sr, 16000, quality="HQ")
            wave.astype(np.float32).tofile(os.path.join(OUT, name + ".16k.bin"))
            entry["resampled"] = name + ".16k.bin"
            entry["resampled_len"] = int(len(wave))
        else:
            wave = mono
        feats, mask = hf_features(fe, wave)
        if name != "silence_16k_s16.wav":  # silence is ln(mel_floor) on every valid frame: checked by formula
            feats.tofile(os.path.join(OUT, name + ".features.bin"))
            entry["features"] = name + ".features.bin"
        entry.update({"n_frames": int(feats.shape[0]), "n_valid": int(mask.sum()),
                      "n_soft_tokens": replace_audio_token_count(mask)})
        cases["files"][name] = entry

    with open(os.path.join(OUT, "speech_16k_s16.wav"), "rb") as f:
        head = f.read(30)
    with open(os.path.join(OUT, "truncated.wav"), "wb") as f:
        f.write(head)
    open(os.path.join(OUT, "empty.wav"), "wb").close()
    for name in ("truncated.wav", "empty.wav"):
        try:
            sf.read(os.path.join(OUT, name))
            cases["invalid"][name] = "soundfile reads it"
        except Exception as e:  # noqa: BLE001 (soundfile raises LibsndfileError or RuntimeError)
            cases["invalid"][name] = f"soundfile refuses it: {e}"

    # 31 s: longer than the 30 s HF keeps.
    long_wave = np.tile(speech16, 496000 // len(speech16) + 1)[:496000].astype(np.float32) / 32768
    feats, mask = hf_features(fe, long_wave)
    feats[LONG_ROWS].tofile(os.path.join(OUT, "long_31s.rows.bin"))
    cases["long_31s"] = {"source": "speech_16k_s16.wav samples repeated", "n_samples": 496000,
                         "n_frames": int(feats.shape[0]), "n_valid": int(mask.sum()),
                         "n_soft_tokens": replace_audio_token_count(mask),
                         "sum": float(feats.astype(np.float64).sum()),
                         "sum_abs": float(np.abs(feats.astype(np.float64)).sum()),
                         "rows": LONG_ROWS, "rows_file": "long_31s.rows.bin"}

    cases["soft_tokens"] = []
    for n in (0, 1, 128, 129, 288, 300, 800, 1600, 16000, 16001, 20800, 32000, 160000, 479999, 480000, 480001,
              496000, 960000):
        feats, mask = hf_features(fe, np.zeros(n, np.float32)) if n else (np.zeros((0, 128)), np.zeros(0, bool))
        cases["soft_tokens"].append({"n_samples": n, "n_frames": int(feats.shape[0]), "n_valid": int(mask.sum()),
                                     "n_soft_tokens": replace_audio_token_count(mask)})

    ufe = Gemma4UnifiedAudioFeatureExtractor()
    cases["unified"] = []
    for n in (1, 639, 640, 641, 16000, 480000, 500000):
        out = ufe([np.zeros(n, np.float32)], return_tensors="np")
        cases["unified"].append({"n_samples": n, "shape": list(out["input_features"][0].shape),
                                 "n_tokens": int(out["input_features_mask"][0].sum())})
    out = ufe([speech16.astype(np.float32) / 32768], return_tensors="np")
    frames = out["input_features"][0]
    cases["unified_speech"] = {"shape": list(frames.shape), "n_tokens": int(out["input_features_mask"][0].sum()),
                               "sum": float(frames.astype(np.float64).sum()),
                               "tail_zeros": int((frames.reshape(-1)[len(speech16):] == 0).sum())}

    # A feature extractor with every optional step on (none of them is used by Gemma 4's own config).
    variant = Gemma4AudioFeatureExtractor(feature_size=80, min_frequency=50.0, max_frequency=7000.0, mel_floor=1e-5,
                                          preemphasis=0.97, fft_overdrive=True, input_scale_factor=0.5,
                                          padding_side="left", per_bin_mean=list(rng.uniform(-9.0, 0.0, 80)),
                                          per_bin_stddev=list(rng.uniform(0.5, 3.0, 80)))
    with open(os.path.join(OUT, "variant_config.json"), "w") as f:
        f.write(variant.to_json_string())
    feats, mask = hf_features(variant, speech16.astype(np.float32) / 32768)
    feats.tofile(os.path.join(OUT, "variant.features.bin"))
    cases["variant"] = {"config": "variant_config.json", "input": "speech_16k_s16.wav",
                        "features": "variant.features.bin", "n_frames": int(feats.shape[0]),
                        "n_mels": int(feats.shape[1]), "n_valid": int(mask.sum()),
                        "n_soft_tokens": replace_audio_token_count(mask)}

    cases["resampler"] = resampler_comparison()
    write_processor_config()
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"wrote {len(os.listdir(OUT))} files, {total / 1e6:.2f} MB, to {os.path.normpath(OUT)}")
    print(json.dumps(cases["resampler"], indent=1))


if __name__ == "__main__":
    main()
