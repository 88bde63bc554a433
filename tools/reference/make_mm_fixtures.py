#!/usr/bin/env python3
"""Tiny random-weight multimodal Gemma 4 checkpoints and what transformers computes for them from
real image and audio files: soft tokens, prompt logits with the media spliced in, and greedy
continuations.

Rerun:  python3 tools/reference/make_mm_fixtures.py, then make_video_cases.py (the video references use these
        checkpoints and add a video_processor to their processor_config.json)
Output: tests/fixtures/<name>/ for name in mm_e2b_like (E2B/E4B-like: clipped-linear ViT, audio
        conformer, PLE decoder) and mm_large_like (26B/31B-like: standardised ViT, image tokens
        bidirectional on sliding layers).

Files of a fixture: config.json, model.safetensors, processor_config.json, image_*.png, audio_*.wav,
reference.json (see tools/reference/README.md), soft_<media>.bin (float32 [tokens, hidden]),
pixels_<image>.bin + positions (HF's patches for the encoder alone), logits_<i>.bin.
Deterministic: seeded weights and inputs, CPU, one thread.
"""

import io
import json
import math
import os
import shutil
import struct
import sys
import wave

import numpy as np
import torch

import transformers
from PIL import Image
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (weights drawn the same way as the text fixtures)

REPO = mf.REPO
FIXTURES = mf.FIXTURES
VOCAB = 512
# Multimodal ids inside the tiny vocabulary (the real ones, 255999..258884, are beyond it).
IDS = dict(boi_token_id=498, eoi_token_id=499, image_token_id=500, audio_token_id=501, boa_token_id=502,
           eoa_token_index=503, video_token_id=504)
S, F = mf.S, mf.F

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()


def text_config(**kw):
    return dict(mf.COMMON_TEXT, **kw)


def mm_e2b_like_config():
    text = text_config(
        hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        layer_types=[S, S, F] * 2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=False, enable_moe_block=False,
        sliding_window=16, max_position_embeddings=131072)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=128, use_clipped_linears=True, standardize=False)
    audio = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 conv_kernel_size=3, output_proj_dims=24)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, **IDS)


def mm_large_like_config():
    text = text_config(
        hidden_size=48, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F] * 2,
        hidden_size_per_layer_input=0, enable_moe_block=False, use_bidirectional_attention="vision",
        sliding_window=16, max_position_embeddings=262144)
    vision = dict(hidden_size=36, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=20, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=128, use_clipped_linears=False, standardize=True)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **IDS)


def mm_unified_like_config():
    from transformers import Gemma4UnifiedConfig
    # sliding_window 128 >= any image block here: transformers composes the 12B's sliding mask as
    # (causal AND window) OR same-image, MarkBase as window AND (causal OR same-image); they agree
    # unless an image is longer than the window (see docs/multimodal.md).
    text = text_config(
        hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F] * 2, num_kv_shared_layers=0,
        use_double_wide_mlp=False, use_bidirectional_attention="vision", sliding_window=128,
        max_position_embeddings=262144)
    vision = dict(patch_size=2, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=64, output_proj_dims=32)
    audio = dict(audio_embed_dim=640)
    return Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=audio, **IDS)


def draw(name, t, g):
    leaf = name.split(".")[-1]
    if ("vision_tower" in name or "audio_tower" in name) and leaf in ("input_min", "output_min"):
        return -(1.5 + torch.rand(tuple(t.shape), generator=g))  # tight enough that some values clip
    if ("vision_tower" in name or "audio_tower" in name) and leaf in ("input_max", "output_max"):
        return 1.5 + torch.rand(tuple(t.shape), generator=g)
    if leaf == "std_bias":
        return 0.5 * mf.randn(g, t.shape)
    if leaf == "std_scale":
        return 0.5 + torch.rand(tuple(t.shape), generator=g)
    return mf.draw(name, t, g)


@torch.no_grad()
def init_weights(model, seed):
    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        t.copy_(draw(name, t, mf.tensor_gen(seed, name)).to(t.dtype))


def synthetic_image(w, h, seed, mode="RGB"):
    """Smooth gradients and a few shapes, so that PNG keeps it small."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    for c in range(3):
        a, b, p = rng.uniform(-1, 1, 3)
        img[..., c] = 127 + 100 * np.sin(a * xx / 5 + b * yy / 7 + p * 3)
    for _ in range(3):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(2, max(3, min(w, h) / 3))
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    arr = np.clip(np.round(img), 0, 255).astype(np.uint8)
    im = Image.fromarray(arr, "RGB")
    return im.convert(mode) if mode != "RGB" else im


def write_wav16(path, samples, rate):
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768.0  # what a reader of the file gets (libsndfile's scaling)


def synthetic_speech(seconds, seed, rate=16000):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 40 * np.sin(2 * np.pi * 1.3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return 0.3 * x + 0.02 * rng.standard_normal(t.size)


def save_f32(path, a):
    np.ascontiguousarray(np.asarray(a, dtype=np.float32)).tofile(path)


def rewrite_release_style(path, tc):
    with open(path) as f:
        cfg = json.load(f)
    t = cfg["text_config"]
    plc = t.pop("per_layer_config", None)
    if plc:
        vals = list(plc.values())
        t["global_head_dim"] = vals[0]["head_dim"]
        t["num_global_key_value_heads"] = vals[0].get("num_key_value_heads", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def mm_token_types(ids):
    types = torch.zeros_like(ids)
    types[ids == IDS["image_token_id"]] = 1
    types[ids == IDS["video_token_id"]] = 2
    types[ids == IDS["audio_token_id"]] = 3
    return types


MM_TOKENS = {498: "<|image>", 499: "<image|>", 500: "<|image|>", 501: "<|audio|>", 502: "<|audio>",
             503: "<audio|>", 504: "<|video|>"}


def write_mm_tokenizer(out):
    """The text fixtures' cut Gemma 4 tokenizer with ids 498..504 renamed to the multimodal markers
    (the ids the tiny config gives them), so that a chat with media runs end to end."""
    mf.write_tiny_tokenizer(out, "gemma4-tokenizer.json", "gemma-4-31B-it.jinja")
    os.remove(os.path.join(out, "tokenize_cases.json"))
    path = os.path.join(out, "tokenizer.json")
    with open(path) as f:
        j = json.load(f)
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i not in MM_TOKENS}
    vocab.update({t: i for i, t in MM_TOKENS.items()})
    j["model"]["vocab"] = vocab
    j["model"]["merges"] = [m for m in j["model"]["merges"]
                            if all(part in vocab for part in (m if isinstance(m, list) else m.split(" ", 1)))]
    j["added_tokens"] = [t for t in j["added_tokens"] if t["id"] not in MM_TOKENS] + [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, t in MM_TOKENS.items()]
    with open(path, "w") as f:
        json.dump(j, f, ensure_ascii=False)
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        tc = json.load(f)
    tc["extra_special_tokens"] = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                                  "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tc["add_bos_token"] = False
    with open(cfg_path, "w") as f:
        json.dump(tc, f, indent=1)


def chat_case(out, model, improc, fe, image_files, audio_files, text):
    """A user turn with media through transformers' own processor: its prompt ids and greedy reply."""
    from transformers import AutoTokenizer, Gemma4Processor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    tok = AutoTokenizer.from_pretrained(out)
    with open(os.path.join(out, "chat_template.jinja")) as f:
        template = f.read()
    proc = Gemma4Processor(feature_extractor=fe, image_processor=improc, tokenizer=tok,
                           video_processor=Gemma4VideoProcessor(), chat_template=template)
    content = [{"type": "image", "path": os.path.join(out, f)} for f in image_files]
    content += [{"type": "audio", "path": os.path.join(out, f)} for f in audio_files]
    content.append({"type": "text", "text": text})
    messages = [{"role": "user", "content": content}]
    enc = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                   return_tensors="pt")
    ids = enc["input_ids"]
    kw = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        gen = model.generate(input_ids=ids, do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None,
                             pad_token_id=0, **kw)
    return {"text": text, "images": image_files, "audios": audio_files, "prompt_ids": ids[0].tolist(),
            "greedy": gen[0, ids.shape[1]:].tolist()}


def build(name, cfg, seed, images, audios, prompts, chat=None, audio_holes=None):
    out = os.path.join(FIXTURES, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    torch.manual_seed(seed)
    unified = cfg.model_type == "gemma4_unified"
    if unified:
        from transformers import Gemma4UnifiedForConditionalGeneration
        model = Gemma4UnifiedForConditionalGeneration(cfg).eval()
    else:
        model = Gemma4ForConditionalGeneration(cfg).eval()
    init_weights(model, seed)
    model.config._attn_implementation = "eager"
    for sub in (model.config.text_config, model.config.vision_config, model.config.audio_config):
        if sub is not None:
            sub._attn_implementation = "eager"
    if model.config.audio_config is not None:
        # The audio tower computes its attention itself and only takes its mask from the attention
        # implementation. "sdpa" (what from_pretrained picks) gives a boolean mask; "eager" gives an additive float
        # one (0 / -inf) that Gemma4AudioAttention's masked_fill(mask.logical_not(), ...) inverts (5.17.0), so the
        # soft tokens of real runs are the sdpa ones.
        model.config.audio_config._attn_implementation = "sdpa"
    model.save_pretrained(out, safe_serialization=True)
    rewrite_release_style(os.path.join(out, "config.json"), cfg.text_config)
    for extra in ("generation_config.json",):
        p = os.path.join(out, extra)
        if os.path.exists(p):
            os.remove(p)

    vc = cfg.vision_config
    if unified:
        from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
            Gemma4UnifiedAudioFeatureExtractor)
        from transformers.models.gemma4_unified.image_processing_gemma4_unified import Gemma4UnifiedImageProcessor
        improc = Gemma4UnifiedImageProcessor(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size,
                                             max_soft_tokens=70)
    else:
        improc = Gemma4ImageProcessor(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size,
                                      max_soft_tokens=70)
    proc_cfg = {"image_processor": improc.to_dict()}
    fe = None
    if cfg.audio_config is not None:
        fe = (Gemma4UnifiedAudioFeatureExtractor() if unified else
              Gemma4AudioFeatureExtractor(feature_size=cfg.audio_config.subsampling_conv_channels[0]))
        proc_cfg["feature_extractor"] = fe.to_dict()
    with open(os.path.join(out, "processor_config.json"), "w") as f:
        json.dump(proc_cfg, f, indent=2, sort_keys=True,
                  default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))  # numpy values as numbers
        f.write("\n")

    ref = {"transformers_version": transformers.__version__, "torch_dtype": "float32", "vocab_size": VOCAB,
           "ids": IDS, "images": [], "audios": [], "prompts": []}
    inner = model.model
    image_inputs = []
    for i, (w, h, mode) in enumerate(images):
        im = synthetic_image(w, h, seed * 100 + i, mode)
        fname = f"image_{i}.png"
        im.save(os.path.join(out, fname))
        loaded = Image.open(os.path.join(out, fname))
        loaded.load()
        enc = improc(images=[loaded.convert("RGB")], return_tensors="pt")
        pv, pos = enc["pixel_values"], enc["image_position_ids"]
        n_soft = int(enc["num_soft_tokens_per_image"][0])
        real = (pos[0] != -1).all(-1)
        save_f32(os.path.join(out, f"pixels_{i}.bin"), pv[0][real].numpy())
        with torch.no_grad():
            soft = inner.get_image_features(pv, pos, return_dict=True).pooler_output[0]
        assert soft.shape[0] == n_soft, (soft.shape, n_soft)
        save_f32(os.path.join(out, f"soft_image_{i}.bin"), soft.numpy())
        ref["images"].append({"file": fname, "size": [w, h], "mode": mode, "soft_tokens": n_soft,
                              "patches": int(real.sum()), "pixels_file": f"pixels_{i}.bin",
                              "pos_x": pos[0][real][:, 0].tolist(), "pos_y": pos[0][real][:, 1].tolist(),
                              "soft_file": f"soft_image_{i}.bin"})
        image_inputs.append((pv, pos, n_soft))

    audio_inputs = []
    wavs = []
    for i, clip in enumerate(audios):
        # A clip is its length in seconds, or (seconds, j): its features padded in a batch with clip j, which is
        # longer (the processor pads a batch to its longest clip; the mask marks the padding frames).
        seconds, batch_with = clip if isinstance(clip, tuple) else (clip, None)
        fname = f"audio_{i}.wav"
        wav = write_wav16(os.path.join(out, fname), synthetic_speech(seconds, seed * 100 + i), 16000)
        wavs.append(wav)
        if batch_with is None:
            feats = fe([wav], sampling_rate=16000, return_tensors="pt")
        else:
            assert wavs[batch_with].size > wav.size
            feats = fe([wav, wavs[batch_with]], sampling_rate=16000, return_tensors="pt")
        x, m = feats["input_features"][:1], feats["input_features_mask"][:1]
        with torch.no_grad():
            ao = inner.get_audio_features(x, m, return_dict=True)
        soft = ao.pooler_output[0][ao.attention_mask[0]]
        save_f32(os.path.join(out, f"soft_audio_{i}.bin"), soft.numpy())
        save_f32(os.path.join(out, f"features_audio_{i}.bin"), x[0].numpy())
        ref["audios"].append({"file": fname, "seconds": seconds, "soft_tokens": int(soft.shape[0]),
                              "frames": int(x.shape[1]), "valid_frames": int(m[0].sum()),
                              "features_file": f"features_audio_{i}.bin", "soft_file": f"soft_audio_{i}.bin"})
        if batch_with is not None:
            ref["audios"][-1]["padded_with"] = f"audio_{batch_with}.wav"
        audio_inputs.append((x, m, int(soft.shape[0])))

    if audio_holes:
        # A mask the feature extractor never makes (invalid frames first and in the middle), for the encoder's
        # masking: a frame whose attention window holds no valid key averages its whole context, and reaches
        # later valid frames through the causal convolution.
        i, ranges = audio_holes
        x = audio_inputs[i][0]
        m = torch.ones(1, x.shape[1], dtype=torch.bool)
        for begin, end in ranges:
            m[0, begin:end] = False
        with torch.no_grad():
            ao = inner.get_audio_features(x, m, return_dict=True)
        soft = ao.pooler_output[0][ao.attention_mask[0]]
        m[0].numpy().astype(np.uint8).tofile(os.path.join(out, f"mask_audio_{i}_holes.bin"))
        save_f32(os.path.join(out, f"soft_audio_{i}_holes.bin"), soft.numpy())
        ref["audio_masks"] = [{"features_file": f"features_audio_{i}.bin", "mask_file": f"mask_audio_{i}_holes.bin",
                               "soft_tokens": int(soft.shape[0]), "soft_file": f"soft_audio_{i}_holes.bin"}]

    rng = np.random.default_rng(seed)
    for p_i, layout in enumerate(prompts):
        ids = [2]
        used_images, used_audio = [], []
        for item in layout:
            if isinstance(item, int):
                ids += [int(t) for t in rng.integers(5, 400, item)]
            elif item[0] == "image":
                n = image_inputs[item[1]][2]
                ids += [IDS["boi_token_id"]] + [IDS["image_token_id"]] * n + [IDS["eoi_token_id"]]
                used_images.append(item[1])
            else:
                n = audio_inputs[item[1]][2]
                ids += [IDS["boa_token_id"]] + [IDS["audio_token_id"]] * n + [IDS["eoa_token_index"]]
                used_audio.append(item[1])
        input_ids = torch.tensor([ids])
        kw = {}
        if used_images:
            # The processor pads every image of a batch to the same patch count.
            kw["pixel_values"] = torch.cat([image_inputs[j][0] for j in used_images])
            kw["image_position_ids"] = torch.cat([image_inputs[j][1] for j in used_images])
        if used_audio:
            assert len(used_audio) == 1
            kw["input_features"], kw["input_features_mask"] = audio_inputs[used_audio[0]][:2]
        kw["mm_token_type_ids"] = mm_token_types(input_ids)
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False, **kw).logits[0]
            gen = model.generate(input_ids=input_ids, do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                 eos_token_id=None, pad_token_id=0, **kw)
        greedy = gen[0, len(ids):].tolist()
        assert not torch.isnan(logits).any()
        save_f32(os.path.join(out, f"logits_{p_i}.bin"), logits.numpy())
        ref["prompts"].append({"tokens": ids, "images": used_images, "audios": used_audio,
                               "logits_file": f"logits_{p_i}.bin", "greedy": greedy})
    if chat:
        write_mm_tokenizer(out)
        ref["chat"] = [chat_case(out, model, improc, fe, [f"image_{i}.png" for i in c.get("images", [])],
                                 [f"audio_{i}.wav" for i in c.get("audios", [])], c["text"]) for c in chat]
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{name}: {len(images)} images, {len(audios)} audio clips, {len(prompts)} prompts "
          f"({', '.join(str(len(p['tokens'])) for p in ref['prompts'])} tokens)")


def main():
    if transformers.__version__ != mf.EXPECTED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures expect {mf.EXPECTED_TRANSFORMERS}")
    # image_2: image_0's size with other pixels (the same prompt ids, other soft tokens).
    images = [(37, 23, "RGB"), (16, 40, "RGBA"), (37, 23, "RGB")]
    # Audio 1 spans several attention chunks; audio 2 is padded to audio 1's length (the audio encoder's tests), with
    # 38 valid frames (4k + 2): the last soft token reads a first-convolution output that only the mask zeroes.
    build("mm_e2b_like", mm_e2b_like_config(), 11, images, [0.6, 1.1, (0.39, 1)],
          [[4, ("image", 0), 5], [3, ("image", 0), 2, ("image", 1), 3], [3, ("audio", 0), 4]],
          chat=[{"images": [0], "text": "Describe this."}, {"images": [1, 0], "text": "Compare them."}],
          audio_holes=(1, [(0, 10), (40, 66), (101, None)]))
    build("mm_unified_like", mm_unified_like_config(), 13, images[:2], [0.3],
          [[4, ("image", 0), 5], [3, ("image", 1), 2, ("image", 0), 3], [3, ("audio", 0), 4]])
    build("mm_large_like", mm_large_like_config(), 12, images, [],
          [[4, ("image", 0), 5], [3, ("image", 1), 2, ("image", 0), 3]])


if __name__ == "__main__":
    main()
