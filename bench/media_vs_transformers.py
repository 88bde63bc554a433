#!/usr/bin/env python3
"""Image and audio encoding speed, MarkBase against transformers 5.17.0 on the same CPU (same threads) or
the same GPU (--device cuda), and the same full-size encoders (E4B's: the 16-layer 768-wide ViT, the
12-layer 1024-wide conformer) with random weights (--dtype, bf16 by default) in front of a two-layer
language model of E4B's width (one sliding, one full layer).

    python3 bench/media_vs_transformers.py [--threads N] [--reps 3] [--markbase build/bin/markbase] [--device cuda]
                                           [--llama-cpp /tmp/markbase-peer] [--profile]

--llama-cpp DIR (made by `PEER_MTMD=1 tools/peer/build_llama_cpp.sh DIR`) adds llama.cpp's mtmd encoders: its
converter writes the same checkpoint as a text GGUF and an mmproj GGUF (f16, as its mmproj files ship), and
`llama-mtmd-cli` reports the encode time ("mtmd batch encoding done in N ms", or per slice in other versions: the
encoder alone, after its own preprocessing), median of --reps runs.

Measured per item, median of --reps: transformers' processor + get_image_features / get_audio_features
(torch.inference_mode, torch.set_num_threads(N)), and MarkBase's time to the first token of
`markbase generate --image/--audio` (decoding, preprocessing, encoding and the two-layer prefill,
so MarkBase's figure is the larger share of work; on the CPU the table also gives MarkBase's encoding alone: that
figure less the same prompt's text alone, as many text tokens without media, median of --reps). Inputs: a 1024x768 photo-like PNG (280 soft
tokens, 2520 patches) and 30 s of 16 kHz speech-like audio (750 soft tokens).
"""
import argparse
import json
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
    text = dict(mm.mf.COMMON_TEXT, hidden_size=2560, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0, num_kv_shared_layers=0,
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
    ap.add_argument("--llama-cpp", help="llama.cpp peer folder (PEER_MTMD=1 tools/peer/build_llama_cpp.sh DIR)")
    ap.add_argument("--profile", action="store_true",
                    help="after the table, one more MarkBase run per input with MARKBASE_PROFILE_OPS=1: its op table "
                         "(on the GPU a run of the five items the table's figure comes from, so that the first item's "
                         "setup is a fifth of it)")
    ap.add_argument("--profile-env", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                    help="with --profile: the op tables again under these settings (repeatable)")
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
    # As Google's configs write it: global_head_dim (llama.cpp's converter needs it).
    mm.rewrite_release_style(os.path.join(work, "config.json"), cfg.text_config)
    with open(os.path.join(work, "config.json")) as f:
        saved = json.load(f)
    saved["text_config"].setdefault("global_head_dim", saved["text_config"]["head_dim"])
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    improc = Gemma4ImageProcessor()
    fe = Gemma4AudioFeatureExtractor()
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
    peer = llama_cpp_mtmd(args, work) if args.llama_cpp else None
    exact_col = args.device == "cpu"  # --exact-media: the towers' bf16 matmuls f32-accurate (CPU only)
    # On the CPU MarkBase's figure is a whole prompt: decoding, preprocessing, encoding and the two-layer prefill of the
    # prompt's tokens, which transformers' figure leaves out. The encoding column takes the same prompt's text alone (as
    # many text tokens, no media) off it: the share transformers' figure measures.
    enc_col = args.device == "cpu"
    print("| input | MarkBase s | transformers s | speed-up |" +
          (" MarkBase encoding s | encoding speed-up |" if enc_col else "") +
          (" MarkBase --exact-media s |" if exact_col else "") + (" llama.cpp mtmd s | vs llama.cpp |" if peer else ""))
    print("|---|---|---|---|" + ("---|---|" if enc_col else "") + ("---|" if exact_col else "") +
          ("---|---|" if peer else ""))
    # More images (other pixels, same size) and clips: on the GPU MarkBase's figure is the time each of EXTRA more
    # items adds to a prompt (its first item pays for the process's first kernel launches and cuBLAS plans, which
    # transformers' warm-up call leaves out; one more item alone was within the runs' noise for a 30 s clip).
    extra = 4
    more = {image: [], audio: []}
    for i in range(extra):
        more[image].append(os.path.join(work, f"photo{i + 2}.png"))
        mm.synthetic_image(1024, 768, 6 + i).save(more[image][-1])
        more[audio].append(os.path.join(work, f"speech{i + 2}.wav"))
        mm.write_wav16(more[audio][-1], mm.synthetic_speech(30.0, 6 + i), 16000)

    def markbase_prompt(items, flags=(), tokens=None):
        """(seconds, prompt tokens) of one `markbase generate` run: media items, or `tokens` text tokens alone."""
        ids = ["10"] * (len(items) if tokens is None else tokens - 1)
        cmd = [args.markbase, "generate", "-m", work, "-n", "1", "--threads", str(args.threads), "--device",
               args.device, "--tokens", ",".join(["2"] + ids), *flags]
        for flag, path in items:
            cmd += [flag, path]
        out = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r"prompt (\d+) tokens in ([0-9.]+) s", out.stderr)
        if out.returncode != 0 or not m:
            sys.exit(f"markbase failed:\n{out.stderr}")
        return float(m.group(2)), int(m.group(1))

    def markbase_prompt_s(items, flags=()):
        return markbase_prompt(items, flags)[0]

    for name, hf_s, flag, path in rows:
        runs = [markbase_prompt([(flag, path)]) for _ in range(args.reps)]
        one = statistics.median(r[0] for r in runs)
        if args.device == "cuda":
            items = [(flag, path)] + [(flag, p) for p in more[path]]
            mb_s = (statistics.median(markbase_prompt_s(items) for _ in range(args.reps)) - one) / extra
        else:
            mb_s = one
        line = f"| {name} | {mb_s:.3f} | {hf_s:.3f} | {hf_s / mb_s:.2f}x |"
        if enc_col:
            text_s = statistics.median(markbase_prompt([], tokens=runs[0][1])[0] for _ in range(args.reps))
            enc_s = one - text_s
            line += f" {enc_s:.3f} | {hf_s / enc_s:.2f}x |"
        if exact_col:
            exact_s = statistics.median(markbase_prompt_s([(flag, path)], ["--exact-media"]) for _ in range(args.reps))
            line += f" {exact_s:.3f} |"
        if peer:
            p = peer(flag, path)
            line += f" {p:.3f} | {p / mb_s:.2f}x |" if p else " failed | |"
        print(line)

    if args.profile:
        for setting in [""] + args.profile_env:
            env = dict(os.environ, MARKBASE_PROFILE_OPS="1")
            env.update(kv.split("=", 1) for kv in setting.split(",") if kv)
            for name, _, flag, path in rows:
                items = [path] + (more[path] if args.device == "cuda" else [])
                cmd = [args.markbase, "generate", "-m", work, "-n", "1", "--threads", str(args.threads), "--device",
                       args.device, "--tokens", ",".join(["2"] + ["10"] * len(items))]
                for p in items:
                    cmd += [flag, p]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                err = out.stderr
                table = err[err.find("MARKBASE_PROFILE_OPS"):] if "MARKBASE_PROFILE_OPS" in err else err
                print(f"\nMarkBase ops, {name} x{len(items)}{' with ' + setting if setting else ''} "
                      "(one run, model load included):")
                print("\n".join(table.splitlines()[:40]))

def llama_cpp_mtmd(args, work):
    """Converts the checkpoint with llama.cpp's own converter and returns a timer for llama-mtmd-cli."""
    import glob
    srcs = glob.glob(os.path.join(args.llama_cpp, "src", "llama_cpp_python-*", "vendor", "llama.cpp"))
    cli = os.path.join(args.llama_cpp, "build", "bin", "llama-mtmd-cli")
    if not srcs or not os.path.exists(cli):
        sys.exit(f"{args.llama_cpp}: no llama.cpp source or llama-mtmd-cli (PEER_MTMD=1 tools/peer/build_llama_cpp.sh)")
    src = sorted(srcs)[-1]
    mm.write_mm_tokenizer(work)  # the converter needs a tokenizer for the text GGUF
    text, proj = os.path.join(work, "text.gguf"), os.path.join(work, "mmproj.gguf")
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "gguf-py"))
    for extra, out in (([], text), (["--mmproj"], proj)):
        r = subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), work, "--outtype", "f16",
                            "--outfile", out] + extra, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"llama.cpp's converter failed:\n{r.stderr[-3000:]}")

    def run(flag, path):
        kind = "image" if flag == "--image" else "audio"
        times = []
        for _ in range(args.reps):
            r = subprocess.run([cli, "-m", text, "--mmproj", proj, flag, path, "-p", "x", "-n", "1", "--jinja",
                                "-t", str(args.threads)] + ([] if args.device == "cuda" else ["-ngl", "0"]),
                               capture_output=True, text=True)
            log = r.stderr + r.stdout
            ms = [float(m) for m in re.findall(rf"{kind} slice encoded in (\d+) ms", log)]
            ms = ms or [float(m) for m in re.findall(r"mtmd batch encoding done in (\d+) ms", log)]
            if r.returncode != 0 or not ms:
                print(f"llama-mtmd-cli {flag} failed:\n{(r.stderr + r.stdout)[-2000:]}", file=sys.stderr)
                return None
            times.append(sum(ms) / 1000.0)
        return statistics.median(times)
    return run


if __name__ == "__main__":
    main()
