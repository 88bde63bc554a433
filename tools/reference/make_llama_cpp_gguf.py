#!/usr/bin/env python3
"""Gemma 4 GGUFs as llama.cpp's own converter writes them, for tests/test_gguf_model.cpp
(LlamaCppGguf.*): convert_hf_to_gguf.py on the e2b_like (per-layer embeddings, KV sharing,
double-wide MLP) and moe_like (MoE, K=V, per-layer KV heads) fixtures at f32, plus what gguf-py
reads back from each file.

Rerun:  pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
        pip install torch transformers==5.17.0 numpy sentencepiece   (the converter's needs)
        python3 tools/reference/make_llama_cpp_gguf.py --llama-cpp llama_cpp_python-0.3.36/vendor/llama.cpp
Output: tests/fixtures/gguf/llama_cpp/{e2b_like,moe_like}.gguf
        tests/fixtures/gguf/llama_cpp/facts.json   per file: every metadata key with its GGUF type and
                                                   value (long arrays: their length), every tensor's
                                                   ggml type and shape (ne, innermost first)

moe_like has no tokenizer of its own: it is converted with e2b_like's tokenizer files beside it.
The converter reads gguf-py from its own tree, as llama.cpp's users run it.
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
OUT = os.path.join(FIXTURES, "gguf", "llama_cpp")
MODELS = ["e2b_like", "moe_like"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def facts_of(path, gguf):
    r = gguf.GGUFReader(path)
    metadata = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        entry = {"type": field.types[0].name}
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            entry["element_type"] = field.types[-1].name
            if len(field.data) > 64:
                entry["length"] = len(field.data)
                metadata[key] = entry
                continue
        entry["value"] = field.contents()
        metadata[key] = entry
    tensors = {t.name: {"type": t.tensor_type.name, "ne": [int(n) for n in t.shape]} for t in r.tensors}
    return {"metadata": metadata, "tensors": tensors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    args = ap.parse_args()
    tree = os.path.abspath(args.llama_cpp)
    sys.path.insert(0, os.path.join(tree, "gguf-py"))
    import gguf

    os.makedirs(OUT, exist_ok=True)
    facts = {"generator": "tools/reference/make_llama_cpp_gguf.py", "llama_cpp": tree.split(os.sep)[-3], "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            src = os.path.join(tmp, name)  # the folder name becomes general.name
            shutil.copytree(os.path.join(FIXTURES, name), src)
            for f in TOKENIZER_FILES:
                if not os.path.exists(os.path.join(src, f)):
                    shutil.copy(os.path.join(FIXTURES, "e2b_like", f), src)
            out = os.path.join(OUT, f"{name}.gguf")
            subprocess.run([sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), src, "--outfile", out,
                            "--outtype", "f32"], check=True, capture_output=True)
            facts["models"][name] = facts_of(out, gguf)
            print(f"{name}: {os.path.getsize(out)} bytes, {len(facts['models'][name]['tensors'])} tensors -> {out}",
                  file=sys.stderr)
    with open(os.path.join(OUT, "facts.json"), "w", encoding="utf-8") as f:
        json.dump(facts, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
