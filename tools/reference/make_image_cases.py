#!/usr/bin/env python3
"""Test images and what Pillow, torchvision and transformers' Gemma 4 image processors make of them,
for tests/test_image.cpp (image decoding, the antialiased bicubic resize, Gemma 4 preprocessing).

  python3 tools/reference/make_image_cases.py   # rewrites tests/fixtures/images/ (deterministic, ~20 s)

Requires transformers 5.17.0 (warns on any other version), torch, torchvision, Pillow, numpy (CPU).
The images come from a seeded numpy generator, so a rerun writes the same inputs. The resize
references come from torch on an x86 CPU with AVX2/AVX-512 (torch's uint8 kernel for 3 channels);
set ATEN_CPU_CAPABILITY=default and they would come from torch's scalar fallback instead, which
differs on some sizes, so the script refuses to run then.

Outputs in tests/fixtures/images/ (< 2 MB together):
  Input images: PNG (RGB, RGBA with transparent pixels, grey, palette + tRNS, 16-bit grey, EXIF
  orientation 8 in an eXIf chunk, a very wide, a very tall and a 3x2 one), JPEG (baseline 4:2:0 at
  131x89 and 640x480, progressive grey, EXIF orientation 6), GIF (two frames; one whose first frame has a transparent
  index and covers part of the screen), WebP (lossless, lossy with alpha, animated), BMP.
  Bad inputs: truncated.png, truncated.jpg, empty.png (0 bytes), not_an_image.txt.
  decoded/<file>.png: the RGB image transformers' load_image makes of <file> (Pillow's open,
      ImageOps.exif_transpose, convert("RGB")), stored losslessly.
  resized/<case>.png: the uint8 image after torchvision's resize, for a few preprocess cases.
  resize_cases.bin: torchvision resize(uint8, BICUBIC, antialias=True) cases on random images;
      per case (little-endian) int32 in_w, in_h, out_w, out_h, then the input and the output,
      both height x width x 3 uint8.
  processor_config.json: what Gemma4Processor.save_pretrained writes (patch 4, pool 2, 70 tokens).
  cases.json:
    rescale_f32_bits: the float32 bit patterns of torch's uint8 * (1/255) for 0..255.
    decode: per input file, its decoded size and fingerprint, or for a bad file the fact that
        Pillow refuses it.
    preprocess: per (image, patch_size, pooling_kernel_size, max_soft_tokens): what
        Gemma4ImageProcessor (torchvision backend) outputs for the image's real patches: resized
        size, patch grid, patch count, soft tokens, the fingerprint of the resized uint8 image and
        of the pixel_values' float32 bits, their float64 sum; how far Gemma4ImageProcessorPil's
        pixel_values are from it (pil_twin_max_abs_diff, pil_twin_fraction_differing).
    unified: the same for Gemma4UnifiedImageProcessor (merged 48x48 patches).
    sizes: get_aspect_ratio_preserving_size on extreme aspect ratios.
    errors: max_soft_tokens values the processor refuses, with HF's message.

A fingerprint is sum_i v_i * (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) mod 2^64 over the
flattened values v_i (uint8 pixels, or float32 bit patterns as uint32), as a 16-digit hex string.
"""

import io
import json
import os
import struct
import sys
import tempfile
import warnings

import numpy as np
import PIL
import torch
import torchvision
import transformers
from PIL import Image, ImageOps
from torchvision.transforms.v2 import functional as tvF

from transformers.image_utils import load_image
from transformers.models.gemma4 import Gemma4ImageProcessor, Gemma4Processor
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4_unified.image_processing_gemma4_unified import Gemma4UnifiedImageProcessor

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "images")
SEED = 20260417


def fingerprint(values):
    v = np.ascontiguousarray(values).ravel()
    if v.dtype == np.float32:
        v = v.view(np.uint32)
    v = v.astype(np.uint64)
    i = np.arange(v.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        w = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
        return f"{int((v * w).sum(dtype=np.uint64)):016x}"


# ---------------------------------------------------------------------------------------------
# Synthetic images: smooth gradients and flat shapes, so PNG compresses them well.

def photo(w, h, rng):
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    a, b = rng.uniform(8, 30, 2)
    img = np.stack([128 + 100 * np.sin(xx / a + rng.uniform(0, 6)),
                    128 + 100 * np.cos(yy / b + xx / (a + b)),
                    255 * (xx + yy) / max(w + h - 2, 1)], -1)
    for _ in range(5):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(2, max(3.0, min(w, h) / 2.5))
        img[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    x0, y0 = int(rng.integers(0, max(w - 2, 1))), int(rng.integers(0, max(h - 2, 1)))
    img[y0:y0 + max(h // 4, 1), x0:x0 + max(w // 5, 1)] = rng.uniform(0, 255, 3)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def exif_with_orientation(value):
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def write_inputs(rng):
    """Writes the input files; returns (good file names, bad file names)."""
    good = []

    def save(name, im, **kw):
        im.save(os.path.join(OUT, name), **kw)
        good.append(name)

    save("photo_97x61.png", Image.fromarray(photo(97, 61, rng)))
    rgba = np.dstack([photo(64, 48, rng), np.full((48, 64), 255, np.uint8)])
    rgba[:16, :20, 3] = 0  # fully transparent, colour kept: must come out unchanged (no compositing)
    rgba[30:, 40:, 3] = 90
    save("rgba_64x48.png", Image.fromarray(rgba, "RGBA"))
    save("gray_50x40.png", Image.fromarray(photo(50, 40, rng)[:, :, 1], "L"))
    pal = Image.fromarray(photo(45, 33, rng)).quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=0)
    save("palette_45x33.png", pal, transparency=3)
    g16 = (np.linspace(0, 65535, 20 * 10).reshape(10, 20)).astype(np.uint16)
    g16[0, :6] = [0, 1, 254, 255, 256, 1000]
    save("gray16_20x10.png", Image.fromarray(g16))  # mode "I;16"
    save("oriented8_30x20.png", Image.fromarray(photo(30, 20, rng)), exif=exif_with_orientation(8))
    save("wide_400x9.png", Image.fromarray(photo(400, 9, rng)))
    save("tall_7x300.png", Image.fromarray(photo(7, 300, rng)))
    save("tiny_3x2.png", Image.fromarray(rng.integers(0, 256, (2, 3, 3), dtype=np.uint8)))

    save("photo_131x89.jpg", Image.fromarray(photo(131, 89, rng)), quality=90)
    save("photo_640x480.jpg", Image.fromarray(photo(640, 480, rng)), quality=90)  # downscaled at 70 tokens
    save("gray_progressive_41x29.jpg", Image.fromarray(photo(41, 29, rng)[:, :, 0], "L"), quality=85,
         progressive=True)
    save("oriented6_33x20.jpg", Image.fromarray(photo(33, 20, rng)), quality=92, exif=exif_with_orientation(6))

    frames = [Image.fromarray(photo(40, 30, rng)).quantize(colors=32, dither=0) for _ in range(2)]
    frames[0].save(os.path.join(OUT, "anim_40x30.gif"), save_all=True, append_images=frames[1:], duration=100,
                   loop=0)
    good.append("anim_40x30.gif")
    # A first frame with a transparent index, drawn on part of a larger screen (Pillow paints the
    # rest with the transparent index's colour).
    p = Image.new("P", (4, 2))
    p.putpalette([10, 20, 30, 200, 100, 50, 0, 255, 0, 90, 90, 90] + [0] * (252 * 3))
    p.putdata([0, 1, 2, 3, 3, 2, 1, 0])
    buf = io.BytesIO()
    p.save(buf, "GIF", transparency=1)
    gif = bytearray(buf.getvalue())
    gif[6:10] = struct.pack("<HH", 6, 3)
    with open(os.path.join(OUT, "partial_transparent_6x3.gif"), "wb") as f:
        f.write(gif)
    good.append("partial_transparent_6x3.gif")

    save("lossless_60x45.webp", Image.fromarray(photo(60, 45, rng)), lossless=True)
    wa = np.dstack([photo(50, 40, rng), np.full((40, 50), 255, np.uint8)])
    wa[:10, :10, 3] = 0
    wa[25:, 30:, 3] = 120
    save("lossy_alpha_50x40.webp", Image.fromarray(wa, "RGBA"), quality=80)
    frames = [Image.fromarray(np.dstack([photo(48, 36, rng), np.full((36, 48), 200, np.uint8)]), "RGBA")
              for _ in range(2)]
    frames[0].save(os.path.join(OUT, "anim_48x36.webp"), save_all=True, append_images=frames[1:], duration=80,
                   quality=70)
    good.append("anim_48x36.webp")
    save("bmp_23x17.bmp", Image.fromarray(photo(23, 17, rng)))

    bad = []
    for src, name in (("photo_97x61.png", "truncated.png"), ("photo_131x89.jpg", "truncated.jpg")):
        data = open(os.path.join(OUT, src), "rb").read()
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data[: len(data) * 6 // 10])
        bad.append(name)
    open(os.path.join(OUT, "empty.png"), "wb").close()
    with open(os.path.join(OUT, "not_an_image.txt"), "w") as f:
        f.write("This is a text file, not an image.\n")
    bad += ["empty.png", "not_an_image.txt"]
    return good, bad


# ---------------------------------------------------------------------------------------------

def resize_u8(hwc, out_w, out_h):
    t = torch.from_numpy(np.ascontiguousarray(hwc.transpose(2, 0, 1)))
    y = tvF.resize(t, [out_h, out_w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    return y.numpy().transpose(1, 2, 0)


def write_resize_cases(rng):
    # (in_w, in_h, out_w, out_h): identity, tiny, up and down on each axis, one axis only, very
    # wide and very tall, and the Gemma budget shapes. torch's kernel asserts on 1x1 outputs, so
    # none is listed.
    sizes = [(1, 1, 5, 7), (3, 2, 4, 9), (2, 3, 3, 2), (1000, 7, 50, 3), (7, 1000, 3, 50), (400, 9, 48, 7),
             (9, 400, 7, 48), (97, 61, 48, 96), (97, 61, 96, 48), (64, 48, 64, 20), (64, 48, 17, 48),
             (33, 20, 33, 20), (5, 5, 45, 45), (40, 30, 39, 31)]
    for _ in range(12):
        w, h = (int(v) for v in rng.integers(1, 48, 2))
        ow, oh = (int(v) for v in rng.integers(2, 64, 2))
        sizes.append((w, h, ow, oh))
    blob = bytearray()
    for w, h, ow, oh in sizes:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8) if rng.random() < 0.5 else photo(w, h, rng)
        out = resize_u8(img, ow, oh)
        blob += struct.pack("<4i", w, h, ow, oh) + img.tobytes() + np.ascontiguousarray(out).tobytes()
    with open(os.path.join(OUT, "resize_cases.bin"), "wb") as f:
        f.write(blob)
    return len(sizes)


def real_rows(out, key="pixel_values"):
    pos = out["image_position_ids"][0].numpy()
    real = ~(pos == -1).all(-1)
    assert real.sum() == real[: real.sum()].sum(), "real patches must come first"
    return out[key][0].numpy()[real], pos[real]


def preprocess_case(decoded, name, patch, pool, budget, store_png):
    cfg = dict(patch_size=patch, pooling_kernel_size=pool, max_soft_tokens=budget)
    out = Gemma4ImageProcessor(**cfg)(images=[decoded], return_tensors="pt")
    pix, pos = real_rows(out)
    n = pix.shape[0]
    grid_w, grid_h = int(pos[:, 0].max()) + 1, int(pos[:, 1].max()) + 1
    assert n == grid_w * grid_h
    gx, gy = np.meshgrid(np.arange(grid_w), np.arange(grid_h), indexing="xy")
    assert (pos == np.stack([gx, gy], -1).reshape(-1, 2)).all(), "positions must be the raster grid"
    rw, rh = grid_w * patch, grid_h * patch
    th, tw = get_aspect_ratio_preserving_size(decoded.height, decoded.width, patch, budget * pool * pool, pool)
    assert (tw, th) == (rw, rh)

    # The processor is resize -> uint8 * float32(1/255) -> patchify: rebuild it from the uint8
    # resized image and require the very same float32 values, so a test may store the uint8 image.
    src = np.array(decoded)
    resized = src if (rw, rh) == (decoded.width, decoded.height) else resize_u8(src, rw, rh)
    scaled = resized.astype(np.float32) * np.float32(1 / 255)
    patches = scaled.reshape(grid_h, patch, grid_w, patch, 3).transpose(0, 2, 1, 3, 4).reshape(n, -1)
    assert np.array_equal(patches.view(np.uint32), pix.view(np.uint32)), f"{name}: pixel_values != resized/255"

    pil_out = Gemma4ImageProcessorPil(**cfg)(images=[decoded], return_tensors="pt")
    pil_pix, _ = real_rows(pil_out)
    diff = np.abs(pil_pix.astype(np.float64) - pix.astype(np.float64)) if pil_pix.shape == pix.shape else None

    case_name = f"{os.path.splitext(name)[0]}_p{patch}k{pool}t{budget}"
    case = {"name": case_name, "file": name, "patch_size": patch, "pooling_kernel_size": pool,
            "max_soft_tokens": budget, "resized_w": rw, "resized_h": rh, "grid_w": grid_w, "grid_h": grid_h,
            "n_patches": n, "n_soft_tokens": int(out["num_soft_tokens_per_image"][0]),
            "resized_fingerprint": fingerprint(resized), "pixels_fingerprint": fingerprint(pix),
            "pixels_sum": float(pix.astype(np.float64).sum()),
            "pil_twin_max_abs_diff": None if diff is None else float(diff.max()),
            "pil_twin_fraction_differing": None if diff is None else float((diff > 0).mean())}
    if store_png:
        case["resized_png"] = f"resized/{case_name}.png"
        Image.fromarray(resized).save(os.path.join(OUT, case["resized_png"]), optimize=True)
    return case


def unified_case(decoded, name, budget):
    out = Gemma4UnifiedImageProcessor(max_soft_tokens=budget)(images=[decoded], return_tensors="pt")
    pix, pos = real_rows(out)
    n = pix.shape[0]
    return {"name": f"{os.path.splitext(name)[0]}_unified_t{budget}", "file": name, "max_soft_tokens": budget,
            "n_tokens": n, "row_len": int(pix.shape[1]), "grid_w": int(pos[:, 0].max()) + 1,
            "grid_h": int(pos[:, 1].max()) + 1, "positions_fingerprint": fingerprint(pos.astype(np.uint32)),
            "n_soft_tokens": int(out["num_soft_tokens_per_image"][0]), "pixels_fingerprint": fingerprint(pix),
            "pixels_sum": float(pix.astype(np.float64).sum())}


def write_processor_config():
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    tok_file = os.path.join(OUT, "..", "tokenizer", "synthetic-tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=tok_file)
    for attr, t in (("image_token", "<|image|>"), ("boi_token", "<|image>"), ("eoi_token", "<image|>"),
                    ("audio_token", "<|audio|>"), ("boa_token", "<|audio>"), ("eoa_token", "<audio|>")):
        tok.add_special_tokens({"additional_special_tokens": [t]})
        setattr(tok, attr, t)
    tok.image_token_id = tok.convert_tokens_to_ids("<|image|>")
    tok.audio_token_id = tok.convert_tokens_to_ids("<|audio|>")
    proc = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                           image_processor=Gemma4ImageProcessor(patch_size=4, pooling_kernel_size=2,
                                                                max_soft_tokens=70),
                           tokenizer=tok, video_processor=Gemma4VideoProcessor())
    with tempfile.TemporaryDirectory() as d:
        proc.save_pretrained(d)
        with open(os.path.join(d, "processor_config.json")) as f:
            text = f.read()
    with open(os.path.join(OUT, "processor_config.json"), "w") as f:
        f.write(text)


def main():
    if transformers.__version__ != "5.17.0":
        warnings.warn(f"transformers {transformers.__version__}: the fixtures were made with 5.17.0")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        sys.exit(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}: AVX2 or AVX512 needed (docstring)")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # the 3x2 image's "ambiguous channel dimension" notes
    rng = np.random.default_rng(SEED)
    os.makedirs(os.path.join(OUT, "decoded"), exist_ok=True)
    os.makedirs(os.path.join(OUT, "resized"), exist_ok=True)
    for sub in ("decoded", "resized"):
        for f in os.listdir(os.path.join(OUT, sub)):
            os.remove(os.path.join(OUT, sub, f))

    good, bad = write_inputs(rng)
    n_resize = write_resize_cases(rng)
    write_processor_config()

    scale = torch.arange(256, dtype=torch.uint8) * (1 / 255)
    assert scale.dtype == torch.float32
    assert np.array_equal(scale.numpy(), np.arange(256).astype(np.float32) * np.float32(1 / 255))

    cases = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
             "torchvision_version": torchvision.__version__, "pillow_version": PIL.__version__,
             "resize_cases": {"file": "resize_cases.bin", "count": n_resize},
             "rescale_f32_bits": [int(v) for v in scale.numpy().view(np.uint32)],
             "decode": [], "preprocess": [], "unified": [], "sizes": [], "errors": []}
    decoded = {}
    for name in good:
        im = load_image(os.path.join(OUT, name))  # open, exif_transpose, convert("RGB")
        decoded[name] = im
        png = f"decoded/{name}.png"
        im.save(os.path.join(OUT, png), optimize=True)
        cases["decode"].append({"file": name, "ok": True, "width": im.width, "height": im.height,
                                "decoded_png": png, "fingerprint": fingerprint(np.array(im))})
    for name in bad:
        try:
            load_image(os.path.join(OUT, name)).load()
            raise AssertionError(f"Pillow accepted {name}")
        except (OSError, ValueError, SyntaxError) as e:
            message = str(e).replace(os.path.join(OUT, name), name)  # no machine paths in the fixture
            cases["decode"].append({"file": name, "ok": False, "pillow_error": message[:200]})

    store = {("photo_97x61.png", 70), ("tiny_3x2.png", 70), ("rgba_64x48.png", 70)}
    for name in good:
        for patch, pool, budget in ((16, 3, 70), (16, 3, 280), (4, 2, 70)):
            store_png = (name, budget) in store and patch == 16
            cases["preprocess"].append(preprocess_case(decoded[name], name, patch, pool, budget, store_png))
    for name, budget in (("photo_97x61.png", 70), ("wide_400x9.png", 280)):
        cases["unified"].append(unified_case(decoded[name], name, budget))

    # Extreme aspect ratios take get_aspect_ratio_preserving_size's clamped branches (it cannot
    # raise for the supported budgets); unsupported budgets make the processor raise.
    for w, h, patch, pool, budget in ((3000, 1, 16, 3, 70), (1, 2000, 4, 2, 70), (16384, 1, 16, 3, 1120),
                                      (2, 3, 16, 3, 70), (1000, 7, 16, 3, 280), (7, 1000, 4, 2, 70)):
        th, tw = get_aspect_ratio_preserving_size(h, w, patch, budget * pool * pool, pool)
        cases["sizes"].append({"width": w, "height": h, "patch_size": patch, "pooling_kernel_size": pool,
                               "max_soft_tokens": budget, "resized_w": tw, "resized_h": th})
    for budget in (16, 100, 0):
        try:
            Gemma4ImageProcessor(patch_size=4, pooling_kernel_size=2)(images=[decoded["tiny_3x2.png"]],
                                                                       max_soft_tokens=budget)
            raise AssertionError(f"max_soft_tokens={budget} accepted")
        except ValueError as e:
            cases["errors"].append({"max_soft_tokens": budget, "message": str(e)})

    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    twins = [c for c in cases["preprocess"] if c["pil_twin_max_abs_diff"] is not None]
    worst = max(c["pil_twin_max_abs_diff"] for c in twins)
    print(f"{len(good)} images, {len(cases['preprocess'])} preprocess cases; Gemma4ImageProcessorPil vs "
          f"Gemma4ImageProcessor: max |diff| {worst:.6f} (x255 = {worst * 255:.2f}), max fraction differing "
          f"{max(c['pil_twin_fraction_differing'] for c in twins):.4f}, {len(cases['preprocess']) - len(twins)} "
          "cases with a different patch count")
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print(f"{OUT}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
