#!/usr/bin/env python3
"""Gemma 4 multimodal GGUF pairs as llama.cpp's own converter writes them, for tests/test_mmproj.cpp:
convert_hf_to_gguf.py on the mm_e2b_like (vision + audio towers), mm_large_like (the 26B/31B-like
vision tower) and mm_unified_like (the 12B's encoder-free patch and frame projections) fixtures,
each as a text GGUF and an mmproj GGUF (`--mmproj`), at f32; mm_e2b_like's mmproj also at f16, the
type llama.cpp's mmproj files ship in. Plus what gguf-py reads back from each file.

Rerun:  pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
        pip install torch transformers==5.17.0 numpy sentencepiece   (the converter's needs)
        python3 tools/reference/make_mmproj_gguf.py --llama-cpp llama_cpp_python-0.3.36/vendor/llama.cpp
Output: tests/fixtures/gguf/llama_cpp_mm/{name}.gguf, {name}.mmproj.gguf, mm_e2b_like.mmproj-f16.gguf,
        facts.json (per file: every metadata key with its GGUF type and value - long arrays: their
        length - and every tensor's ggml type and shape, ne innermost first; a conversion that
        failed: its error)

The fixtures without a tokenizer of their own are converted with mm_e2b_like's tokenizer files
beside them. The converter reads gguf-py from its own tree, as llama.cpp's users run it.

The tiny towers differ from Gemma 4's in two settings the converter does not write, which
llama.cpp then takes at Gemma 4's values (clip.cpp): the ViT pools 2x2, not 3x3, and the conformer
reads 8 mel bins, not 128. Each mmproj file therefore gets, after conversion, the keys llama.cpp
reads for them - clip.vision.projector.scale_factor and clip.audio.num_mel_bins - with the
fixture's values (gguf-py's copy_with_new_metadata; nothing else changes). `--keys-only` redoes
that step and facts.json on files already converted (no torch needed).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
MODELS = ["mm_e2b_like", "mm_large_like", "mm_unified_like"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
CHECKPOINT_FILES = ["config.json", "model.safetensors", "processor_config.json"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama_cpp_gguf import facts_of  # noqa: E402  (what gguf-py reads back, the same record)


def tiny_keys(name, gguf):
    """The keys llama.cpp reads for the settings where the fixture is not Gemma 4 (see above)."""
    with open(os.path.join(FIXTURES, name, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    keys = {}
    vision = config.get("vision_config") or {}
    if vision.get("pooling_kernel_size", 3) != 3:
        keys["clip.vision.projector.scale_factor"] = (gguf.GGUFValueType.UINT32, int(vision["pooling_kernel_size"]))
    proc = os.path.join(FIXTURES, name, "processor_config.json")
    if (config.get("audio_config") or {}).get("model_type") == "gemma4_audio" and os.path.exists(proc):
        with open(proc, encoding="utf-8") as f:
            fe = json.load(f).get("feature_extractor") or {}
        if fe.get("feature_size", 128) != 128:
            keys["clip.audio.num_mel_bins"] = (gguf.GGUFValueType.UINT32, int(fe["feature_size"]))
    return keys


def set_keys(path, keys, gguf):
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    reader = gguf.GGUFReader(path)
    present = {k: reader.get_field(k).contents() for k in keys if reader.get_field(k) is not None}
    if all(present.get(k) == v for k, (_, v) in keys.items()):
        return
    tmp = path + ".tmp"
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {k: MetadataDetails(t, v) for k, (t, v) in keys.items()}, [])
    del reader
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    ap.add_argument("--out", default=os.path.join(FIXTURES, "gguf", "llama_cpp_mm"))
    ap.add_argument("--keys-only", action="store_true", help="only the key step and facts.json, on converted files")
    args = ap.parse_args()
    tree = os.path.abspath(args.llama_cpp)
    sys.path.insert(0, os.path.join(tree, "gguf-py"))
    import gguf

    os.makedirs(args.out, exist_ok=True)
    facts = {"generator": "tools/reference/make_mmproj_gguf.py", "llama_cpp": "llama-cpp-python 0.3.36's vendor tree",
             "files": {}}
    jobs = []
    for name in MODELS:
        jobs.append((name, f"{name}.gguf", [], "f32"))
        jobs.append((name, f"{name}.mmproj.gguf", ["--mmproj"], "f32"))
    jobs.append(("mm_e2b_like", "mm_e2b_like.mmproj-f16.gguf", ["--mmproj"], "f16"))
    if args.keys_only:
        with open(os.path.join(args.out, "facts.json"), encoding="utf-8") as f:
            facts = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        for name, file, extra, outtype in jobs:
            out = os.path.join(args.out, file)
            if args.keys_only:
                if os.path.exists(out):
                    if extra:
                        set_keys(out, tiny_keys(name, gguf), gguf)
                    facts["files"][file] = facts_of(out, gguf)
                continue
            src = os.path.join(tmp, name)  # the folder name becomes general.name
            if not os.path.isdir(src):
                os.makedirs(src)
                for f in CHECKPOINT_FILES:
                    if os.path.exists(os.path.join(FIXTURES, name, f)):
                        shutil.copy(os.path.join(FIXTURES, name, f), src)
                for f in TOKENIZER_FILES:
                    own = os.path.join(FIXTURES, name, f)
                    shutil.copy(own if os.path.exists(own) else os.path.join(FIXTURES, "mm_e2b_like", f), src)
            r = subprocess.run([sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), src, "--outfile", out,
                                "--outtype", outtype] + extra, capture_output=True, text=True)
            if r.returncode != 0:
                facts["files"][file] = {"error": (r.stderr or r.stdout)[-3000:]}
                print(f"{file}: conversion failed\n{r.stderr[-3000:]}", file=sys.stderr)
                continue
            if extra:
                set_keys(out, tiny_keys(name, gguf), gguf)
            facts["files"][file] = facts_of(out, gguf)
            print(f"{file}: {os.path.getsize(out)} bytes, {len(facts['files'][file]['tensors'])} tensors",
                  file=sys.stderr)
    with open(os.path.join(args.out, "facts.json"), "w", encoding="utf-8") as f:
        json.dump(facts, f, indent=1, ensure_ascii=False, default=str)
        f.write("\n")


if __name__ == "__main__":
    main()
