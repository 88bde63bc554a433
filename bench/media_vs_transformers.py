#!/usr/bin/env python3
"""Image and audio encoding speed, MarkBase against transformers 5.17.0 on the same CPU (same threads) or
the same GPU (--device cuda), and the same full-size encoders (E4B's: the 16-layer 768-wide ViT, the 12-layer 1024-wide
conformer) with random f32 weights in front of a one-layer language model of E4B's width.

    python3 bench/media_vs_transformers.py [--threads N] [--reps 3] [--markbase build/bin/markbase] [--device cuda]

Measured per item, median of --reps: transformers' processor + get_image_features / get_audio_features
(torch.inference_mode, torch.set_num_threads(N)), and MarkBase's time to the first token of
`markbase generate --image/--audio` (decoding, preprocessing, encoding and the one-layer prefill,
so MarkBase's figure is the larger share of work). Inputs: a 1024x768 photo-like PNG (280 soft
tokens, 2520 patches) and 30 s of 16 kHz speech-like audio (750 soft tokens).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import transformers
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "reference"))
import make_mm_fixtures as mm  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def e4b_encoders_config():
    text = dict(mm.mf.COMMON_TEXT, hidden_size=2560, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, global_head_dim=64,
                layer_types=["full_attention"], hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                enable_moe_block=False, sliding_window=512, max_position_embeddings=131072)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=10240, use_clipped_linears=True, standardize=False)
    audio = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32],
                 conv_kernel_size=5, output_proj_dims=1536)
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, **mm.IDS)


def median_time(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--markbase", default=os.path.join(ROOT, "build", "bin", "markbase"))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the checkpoint's dtype, which both engines run in (released checkpoints are bfloat16)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    work = tempfile.mkdtemp(prefix="mb_media_bench_")
    cfg = e4b_encoders_config()
    model = Gemma4ForConditionalGeneration(cfg).eval()
    mm.init_weights(model, 21)
    model = model.to(getattr(torch, args.dtype))
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(work, safe_serialization=True)
    improc = Gemma4ImageProcessor()
    fe = Gemma4AudioFeatureExtractor()
    import json
    with open(os.path.join(work, "processor_config.json"), "w") as f:
        json.dump({"image_processor": improc.to_dict(), "feature_extractor": fe.to_dict()}, f,
                  default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    image = os.path.join(work, "photo.png")
    mm.synthetic_image(1024, 768, 5).save(image)
    audio = os.path.join(work, "speech.wav")
    wav = mm.write_wav16(audio, mm.synthetic_speech(30.0, 5), 16000)

    from PIL import Image
    model = model.to(args.device)
    inner = model.model

    def sync(x):
        if args.device == "cuda":
            torch.cuda.synchronize()
        return x

    def hf_image():
        with torch.inference_mode():
            enc = improc(images=[Image.open(image).convert("RGB")], return_tensors="pt")
            return sync(inner.get_image_features(enc["pixel_values"].to(args.device, model.dtype),
                                                 enc["image_position_ids"].to(args.device)).pooler_output)

    def hf_audio():
        with torch.inference_mode():
            f = fe([wav], sampling_rate=16000, return_tensors="pt")
            return sync(inner.get_audio_features(f["input_features"].to(args.device, model.dtype),
                                                 f["input_features_mask"].to(args.device)).pooler_output)

    hf_image()  # warm-up
    hf_audio()
    rows = [("image, 280 soft tokens", median_time(hf_image, args.reps), "--image", image),
            ("audio, 30 s (750 soft tokens)", median_time(hf_audio, args.reps), "--audio", audio)]
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"threads {args.threads}"
    print(f"{args.dtype}, {args.device} ({where}), {args.reps} reps, transformers {transformers.__version__}, torch {torch.__version__}")
    print("| input | MarkBase s | transformers s | speed-up |")
    print("|---|---|---|---|")
    for name, hf_s, flag, path in rows:
        mb = []
        for _ in range(args.reps):
            out = subprocess.run([args.markbase, "generate", "-m", work, "--tokens", "2,10", "-n", "1", flag, path,
                                  "--threads", str(args.threads), "--device", args.device], capture_output=True, text=True)
            m = re.search(r"prompt \d+ tokens in ([0-9.]+) s", out.stderr)
            if out.returncode != 0 or not m:
                sys.exit(f"markbase failed:\n{out.stderr}")
            mb.append(float(m.group(1)))
        mb_s = statistics.median(mb)
        print(f"| {name} | {mb_s:.3f} | {hf_s:.3f} | {hf_s / mb_s:.2f}x |")


if __name__ == "__main__":
    main()
