#!/usr/bin/env python3
"""Video fixtures: small synthetic clips and what transformers 5.17.0 makes of them with the tiny multimodal
checkpoints of make_mm_fixtures.py (run that first): the frames its PyAV loader decodes, the frames the video
processor samples, their timestamps, the soft tokens, and prompt logits and greedy ids with the video spliced in.

Rerun:  python3 tools/reference/make_video_cases.py        (needs transformers 5.17.0, torch, torchvision, av)
Output: tests/fixtures/videos/: lossless.mov (PNG frames, so every decoder gives the same pixels), short.mov (5
        frames: fewer than the processor samples), yuv420.mp4 (MPEG-4 part 2, 4:2:0: the decoder's colour
        conversion is compared, not the model), frames/ (a folder of frame images), timestamps.json (HF's MM:SS
        strings for many index/fps pairs), yuv420_rgb.bin (PyAV's RGB of the sampled yuv420.mp4 frames).
        tests/fixtures/<model>/video_reference.json and video_*.bin for mm_e2b_like (chat through Gemma4Processor),
        mm_large_like (bidirectional frames) and mm_unified_like; each fixture's processor_config.json gets the
        video processor's settings (num_frames 8 keeps the fixtures small).
"""

import fractions
import json
import os
import shutil
import sys

import av
import numpy as np
import torch
from PIL import Image

import transformers
from transformers.video_utils import VideoMetadata, load_video

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

FIXTURES = mf.FIXTURES
VIDEOS = os.path.join(FIXTURES, "videos")
NUM_FRAMES = 8
LOGIT_ROWS = 16  # the prompt's last rows: they see every frame

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()


def synthetic_frames(n, w, h, seed):
    """A drifting gradient with a moving square and some noise: frames that differ from each other."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    frames = []
    for t in range(n):
        f = np.zeros((h, w, 3), np.float64)
        f[..., 0] = 255 * (x / max(w - 1, 1) + 0.05 * t) % 256
        f[..., 1] = 255 * (y / max(h - 1, 1))
        f[..., 2] = 128 + 100 * np.sin((x + y + 3 * t) / 4)
        sx, sy = (2 * t) % max(w - 6, 1), (t // 2) % max(h - 6, 1)
        f[sy:sy + 6, sx:sx + 6] = [250, 30, 30]
        f += rng.normal(0, 6, f.shape)
        frames.append(np.clip(f, 0, 255).astype(np.uint8))
    return frames


def write_video(path, frames, fps, codec, pix_fmt):
    with av.open(path, "w") as c:
        s = c.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1001))
        s.width, s.height = frames[0].shape[1], frames[0].shape[0]
        s.pix_fmt = pix_fmt
        if codec == "mpeg4":
            s.options = {"qscale": "3"}
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)


def make_videos():
    shutil.rmtree(VIDEOS, ignore_errors=True)
    os.makedirs(os.path.join(VIDEOS, "frames"))
    write_video(os.path.join(VIDEOS, "lossless.mov"), synthetic_frames(40, 30, 22, 1), 10, "png", "rgb24")
    write_video(os.path.join(VIDEOS, "short.mov"), synthetic_frames(5, 20, 28, 2), 2, "png", "rgb24")
    write_video(os.path.join(VIDEOS, "yuv420.mp4"), synthetic_frames(45, 48, 32, 3), 25, "mpeg4", "yuv420p")
    for i, f in enumerate(synthetic_frames(3, 24, 18, 4)):
        Image.fromarray(f).save(os.path.join(VIDEOS, "frames", f"frame_{i:03d}.png"))


def load(name):
    """A fixture video as transformers' PyAV loader gives it (all frames), or a folder's frames (no metadata)."""
    path = os.path.join(VIDEOS, name)
    if os.path.isdir(path):
        from transformers.image_utils import load_image
        frames = np.stack([np.asarray(load_image(os.path.join(path, f))) for f in sorted(os.listdir(path))])
        return frames, None
    frames, meta = load_video(path, backend="pyav")
    return frames, meta


def sample_kwargs(frames, meta):
    """HF samples num_frames itself from a decoded video, raises for fewer frames, and refuses to sample a list of
    images: what MarkBase does in those cases (every frame) is HF with sampling off."""
    if meta is None or len(frames) <= NUM_FRAMES:
        if meta is not None:
            meta.frames_indices = list(range(len(frames)))
        return {"do_sample_frames": False}
    return {"do_sample_frames": True}


def timestamps_table():
    rows = []
    for fps in [24.0, 25.0, 30000 / 1001, 7.5, 60.0, 10.0, 1 / 3]:
        idx = torch.tensor([0, 1, 59, 60, 599, 1439, 1440, 1441, 35999, 36000, 59999, 86399, 123457], dtype=torch.int32)
        m = VideoMetadata(total_num_frames=200000, fps=fps, frames_indices=idx)
        for i, t in zip(idx.tolist(), m.timestamps):
            rows.append({"index": i, "fps": fps, "text": f"{int(t // 60):02d}:{int(t % 60):02d}"})
    samples = []
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    vp = Gemma4VideoProcessor()
    for total in [32, 33, 40, 45, 100, 1001, 4567, 100000]:
        samples.append({"total": total, "num_frames": 32,
                        "indices": vp.sample_frames(VideoMetadata(total_num_frames=total, fps=25.0), 32).tolist()})
    with open(os.path.join(VIDEOS, "timestamps.json"), "w") as f:
        json.dump({"timestamps": rows, "samples": samples}, f, indent=1)
        f.write("\n")


def yuv_pixels():
    frames, meta = load("yuv420.mp4")
    idx = torch.arange(0, meta.total_num_frames, meta.total_num_frames / NUM_FRAMES).int().tolist()
    frames[idx].astype(np.uint8).tofile(os.path.join(VIDEOS, "yuv420_rgb.bin"))
    return {"file": "yuv420.mp4", "indices": idx, "size": [int(frames.shape[2]), int(frames.shape[1])],
            "rgb_file": "yuv420_rgb.bin", "fps": meta.fps, "total_frames": meta.total_num_frames}


def video_processor(unified, vc):
    if unified:
        from transformers.models.gemma4_unified.video_processing_gemma4_unified import Gemma4UnifiedVideoProcessor
        cls = Gemma4UnifiedVideoProcessor
    else:
        from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
        cls = Gemma4VideoProcessor
    return cls(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size, max_soft_tokens=70,
               num_frames=NUM_FRAMES)


def save_f32(path, a):
    np.ascontiguousarray(a, dtype=np.float32).tofile(path)


def fixture(name, chat_text=None):
    out = os.path.join(FIXTURES, name)
    cfg = transformers.AutoConfig.from_pretrained(out)
    unified = cfg.model_type == "gemma4_unified"
    if unified:
        from transformers import Gemma4UnifiedForConditionalGeneration as Model
    else:
        from transformers import Gemma4ForConditionalGeneration as Model
    model = Model.from_pretrained(out, torch_dtype=torch.float32, attn_implementation="eager").eval()
    if model.config.audio_config is not None:
        model.config.audio_config._attn_implementation = "sdpa"  # as make_mm_fixtures.py (HF's eager mask)
    vp = video_processor(unified, cfg.vision_config)

    proc_path = os.path.join(out, "processor_config.json")
    with open(proc_path) as f:
        proc_cfg = json.load(f)
    proc_cfg["video_processor"] = json.loads(vp.to_json_string())
    with open(proc_path, "w") as f:
        json.dump(proc_cfg, f, indent=2, sort_keys=True)
        f.write("\n")

    ids = {k: getattr(cfg, k) for k in ("boi_token_id", "eoi_token_id", "video_token_id")}
    ref = {"transformers_version": transformers.__version__, "num_frames": NUM_FRAMES, "videos": [], "prompts": []}
    rng = np.random.default_rng(7)
    for v_i, vname in enumerate(["lossless.mov", "short.mov", "frames"]):
        frames, meta = load(vname)
        kw = sample_kwargs(frames, meta)
        enc = vp(videos=[frames], video_metadata=[meta] if meta is not None else None, return_metadata=True,
                 return_tensors="pt", **kw)
        pv, pos = enc["pixel_values_videos"], enc["video_position_ids"]
        n_soft = int(enc["num_soft_tokens_per_video"][0])
        vmeta = enc["video_metadata"][0]
        fps = vmeta.fps if vmeta.fps is not None else 24
        vmeta.fps = fps
        indices = [int(i) for i in vmeta.frames_indices]
        stamps = [f"{int(t // 60):02d}:{int(t % 60):02d}" for t in vmeta.timestamps]
        with torch.no_grad():
            soft = torch.cat(list(model.model.get_video_features(pv, pos, return_dict=True).pooler_output), 0)
        assert soft.shape[0] == n_soft * len(indices), (soft.shape, n_soft, len(indices))
        soft_file = f"video_soft_{v_i}.bin"
        save_f32(os.path.join(out, soft_file), soft.numpy())
        real = (pos[0, 0] != -1).all(-1)
        pix_file = f"video_pixels_{v_i}.bin"
        save_f32(os.path.join(out, pix_file), pv[0, 0][real].numpy())  # the first frame's patches
        entry = {"file": vname, "indices": indices, "timestamps": stamps, "fps": fps, "tokens_per_frame": n_soft,
                 "soft_file": soft_file, "first_frame_pixels_file": pix_file, "first_frame_patches": int(real.sum())}
        ref["videos"].append(entry)

        # The prompt as HF's processor writes it, with made-up ids where the timestamps' text would go (these
        # fixtures have no tokenizer; the chat case below has one): the engine takes it pre-expanded.
        tokens = [2] + [int(t) for t in rng.integers(5, 400, 3)]
        for f_i in range(len(indices)):
            if f_i:
                tokens.append(17)
            tokens += [11, 12, 13]
            tokens += [ids["boi_token_id"]] + [ids["video_token_id"]] * n_soft + [ids["eoi_token_id"]]
        tokens += [int(t) for t in rng.integers(5, 400, 4)]
        input_ids = torch.tensor([tokens])
        mm = torch.zeros_like(input_ids)
        mm[input_ids == ids["video_token_id"]] = 2
        kwv = {"pixel_values_videos": pv, "video_position_ids": pos, "mm_token_type_ids": mm}
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False, **kwv).logits[0]
            gen = model.generate(input_ids=input_ids, do_sample=False, max_new_tokens=6, min_new_tokens=6,
                                 eos_token_id=None, pad_token_id=0, **kwv)
        assert not torch.isnan(logits).any()
        lf = f"video_logits_{v_i}.bin"
        save_f32(os.path.join(out, lf), logits[-LOGIT_ROWS:].numpy())
        ref["prompts"].append({"video": v_i, "tokens": tokens, "logits_file": lf, "logit_rows": LOGIT_ROWS,
                               "greedy": gen[0, len(tokens):].tolist()})

        if chat_text and vname != "frames":
            from transformers import AutoTokenizer, Gemma4Processor
            from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
            from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
            tok = AutoTokenizer.from_pretrained(out)
            with open(os.path.join(out, "chat_template.jinja")) as f:
                template = f.read()
            proc = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(**proc_cfg["feature_extractor"]),
                                   image_processor=Gemma4ImageProcessor(**proc_cfg["image_processor"]),
                                   tokenizer=tok, video_processor=vp, chat_template=template)
            messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": chat_text}]}]
            text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            enc = proc(text=text, videos=[frames], video_metadata=[meta], return_tensors="pt", **kw)
            cids = enc["input_ids"]
            ckw = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
            with torch.no_grad():
                clogits = model(input_ids=cids, use_cache=False, **ckw).logits[0]
                cgen = model.generate(input_ids=cids, do_sample=False, max_new_tokens=6, min_new_tokens=6,
                                      eos_token_id=None, pad_token_id=0, **ckw)
            clf = f"video_chat_logits_{v_i}.bin"
            save_f32(os.path.join(out, clf), clogits[-LOGIT_ROWS:].numpy())
            ref.setdefault("chat", []).append({"video": v_i, "text": chat_text, "prompt_ids": cids[0].tolist(),
                                               "logits_file": clf, "logit_rows": LOGIT_ROWS,
                                               "greedy": cgen[0, cids.shape[1]:].tolist()})
    with open(os.path.join(out, "video_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{name}: {len(ref['videos'])} videos, prompts of "
          f"{', '.join(str(len(p['tokens'])) for p in ref['prompts'])} tokens")


def main():
    if transformers.__version__ != mf.EXPECTED_TRANSFORMERS:
        print(f"warning: transformers {transformers.__version__}, fixtures expect {mf.EXPECTED_TRANSFORMERS}")
    make_videos()
    timestamps_table()
    yuv = yuv_pixels()
    with open(os.path.join(VIDEOS, "yuv420.json"), "w") as f:
        json.dump(yuv, f, indent=1)
        f.write("\n")
    fixture("mm_e2b_like", chat_text="What happens?")
    fixture("mm_large_like")
    fixture("mm_unified_like")


if __name__ == "__main__":
    main()
