#!/usr/bin/env python3
"""Reference data for the quantization and GGUF tests, computed by llama.cpp's own Python
package (`pip install gguf numpy`), independent of MarkBase's C++.

  python3 tools/reference/make_quant_cases.py --ggml-src DIR  # rewrite tests/fixtures/{quant,gguf}/
  python3 tools/reference/make_quant_cases.py --check F        # check a GGUF written by MarkBase

DIR is a ggml source tree (the directory holding include/ and src/ggml-quants.c, e.g.
llama.cpp/ggml or llama-cpp-python's sdist vendor/llama.cpp/ggml; the committed fixtures used
llama-cpp-python 0.3.36). gguf-py cannot quantize K types, so their quantized cases come from
ggml's own C reference quantizers (quantize_row_q{4,5,6}_K_ref), compiled with gcc
-ffp-contract=off; without --ggml-src the K types get dequantization cases only.

Outputs (deterministic, < 1 MB):
  tests/fixtures/quant/cases.json + cases.bin
      Per case: block type, row length n, row count, and byte offsets into cases.bin of the f32
      input (-1 when there is none), the quantized rows and the dequantized f32 rows.
      Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: input -> gguf.quants.quantize -> gguf.quants.dequantize.
      Q4_K, Q5_K, Q6_K: input -> ggml quantize_row_*_ref -> gguf.quants.dequantize, plus seeded
      random blocks (finite f16 scales) -> gguf.quants.dequantize.
  tests/fixtures/gguf/all_types.gguf + all_types.json
      A GGUF from gguf.GGUFWriter with every metadata value type (nested arrays included) and
      one tensor of every type MarkBase reads; the JSON is what gguf.GGUFReader reads back.

--check F reads F with gguf.GGUFReader and compares its metadata and tensors to all_types.json
(the GGUF tests write such a file when MARKBASE_GGUF_WRITE=path is set).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
QUANT_DIR = os.path.join(REPO, "tests", "fixtures", "quant")
GGUF_DIR = os.path.join(REPO, "tests", "fixtures", "gguf")

SIMPLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
KQUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]

# Offsets of the f16 scales inside a K block, kept finite so dequantized values are comparable.
K_SCALE_OFFSETS = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def inputs(block, rng):
    """(name, f32 array [rows, n]) edge cases and random rows; n a multiple of `block`."""
    normal = lambda r, n, s=1.0: (rng.standard_normal((r, n)) * s).astype(np.float32)
    outlier = normal(1, 2 * block)
    outlier[0, 37] = 100.0
    # amax 127 makes the Q8_0 scale exactly 1, so x * id hits the .5 ties of roundf.
    ties = np.tile(np.array([127.0] + [k + 0.5 for k in range(-15, 16)], np.float32), block // 32)[None]
    return [
        ("zeros", np.zeros((1, block), np.float32)),
        ("constant", np.full((1, block), 0.75, np.float32)),
        ("ties", ties),
        ("tiny", normal(1, 2 * block, 1e-20)),
        ("huge", normal(1, 2 * block, 3e4)),
        ("f16_overflow", normal(1, block, 2e7)),  # the f16 scale overflows to inf
        ("outlier", outlier),
        ("negative_only", -np.abs(normal(1, 2 * block)) - 0.01),
        ("positive_only", np.abs(normal(1, 2 * block)) + 0.5),
        ("uniform", rng.uniform(-3, 3, (2, 3 * block)).astype(np.float32)),
        ("one_block", normal(1, block)),
        ("rows", normal(4, 8 * 32 if block == 32 else 2 * block)),
        ("long_row", normal(1, 1024 if block == 32 else 2048, 0.02)),
    ]


HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml-quants.h"
void ggml_abort(const char* f, int l, const char* fmt, ...) { fprintf(stderr, "abort %s:%d\n", f, l); abort(); }
size_t ggml_row_size(enum ggml_type t, int64_t n) { return 0; }
const char* ggml_type_name(enum ggml_type t) { return "?"; }
size_t ggml_type_size(enum ggml_type t) { return 0; }
int main(int argc, char** argv) {  /* harness TYPE N < f32 > blocks */
  long long n = atoll(argv[2]);
  float* x = malloc(n * 4);
  char* y = malloc(n * 2);
  size_t bytes = 0;
  if (fread(x, 4, n, stdin) != (size_t)n) return 2;
  if (!strcmp(argv[1], "Q4_K")) { quantize_row_q4_K_ref(x, (void*)y, n); bytes = n / 256 * 144; }
  if (!strcmp(argv[1], "Q5_K")) { quantize_row_q5_K_ref(x, (void*)y, n); bytes = n / 256 * 176; }
  if (!strcmp(argv[1], "Q6_K")) { quantize_row_q6_K_ref(x, (void*)y, n); bytes = n / 256 * 210; }
  fwrite(y, 1, bytes, stdout);
  return bytes ? 0 : 3;
}
"""


def build_ggml_harness(ggml_src, workdir):
    src = os.path.join(workdir, "harness.c")
    with open(src, "w") as f:
        f.write(HARNESS)
    exe = os.path.join(workdir, "harness")
    inc = [f"-I{ggml_src}/include", f"-I{ggml_src}/src", f"-I{ggml_src}/src/ggml-cpu"]
    subprocess.run(["gcc", "-O2", "-DNDEBUG", "-ffp-contract=off", *inc, src,
                    os.path.join(ggml_src, "src", "ggml-quants.c"), "-lm", "-o", exe], check=True)
    return lambda qt, rows: b"".join(
        subprocess.run([exe, qt.name, str(row.size)], input=row.tobytes(), capture_output=True, check=True).stdout
        for row in rows)


def k_blocks(qt, rng, n_blocks, fill=None):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qt]
    if fill is None:
        raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    else:
        raw = np.full((n_blocks, type_size), fill, np.uint8)
    for off in K_SCALE_OFFSETS[qt]:
        d = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw


def k_inputs(qt, rng):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qt]
    return [
        ("zeros", np.zeros((1, type_size), np.uint8), 1),
        ("all_bits_set", k_blocks(qt, rng, 1, fill=0xFF), 1),
        ("one_block", k_blocks(qt, rng, 1), 1),
        ("several_blocks", k_blocks(qt, rng, 4), 1),
        ("rows", k_blocks(qt, rng, 6), 3),
    ]


class Blob:
    def __init__(self):
        self.parts, self.size = [], 0

    def add(self, arr):
        b = np.ascontiguousarray(arr).tobytes()
        off = self.size
        self.parts.append(b)
        self.size += len(b)
        return off


def make_quant_cases(ggml_quantize):
    rng = np.random.default_rng(20261129)
    blob, cases = Blob(), []
    for qt in SIMPLE:
        for name, x in inputs(32, rng):
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                q = gguf.quants.quantize(x, qt)
                y = gguf.quants.dequantize(q, qt).astype(np.float32)
            cases.append({"type": qt.name, "name": name, "rows": int(x.shape[0]), "n": int(x.shape[1]),
                          "input": blob.add(x), "quantized": blob.add(q), "dequantized": blob.add(y)})
    for qt in KQUANTS:
        for name, x in (inputs(256, rng) if ggml_quantize else []):
            q = np.frombuffer(ggml_quantize(qt, x), np.uint8).reshape(x.shape[0], -1)
            with np.errstate(all="ignore"):
                y = gguf.quants.dequantize(q, qt).astype(np.float32)
            cases.append({"type": qt.name, "name": name, "rows": int(x.shape[0]), "n": int(x.shape[1]),
                          "input": blob.add(x), "quantized": blob.add(q), "dequantized": blob.add(y)})
        for name, raw, rows in k_inputs(qt, rng):
            name = "blocks_" + name
            q = raw.reshape(rows, -1)
            with np.errstate(all="ignore"):
                y = gguf.quants.dequantize(q, qt).astype(np.float32)
            n = y.shape[1]
            assert np.isfinite(y).all(), (qt.name, name)
            cases.append({"type": qt.name, "name": name, "rows": rows, "n": int(n), "input": -1,
                          "quantized": blob.add(q), "dequantized": blob.add(y)})
    os.makedirs(QUANT_DIR, exist_ok=True)
    with open(os.path.join(QUANT_DIR, "cases.bin"), "wb") as f:
        for p in blob.parts:
            f.write(p)
    with open(os.path.join(QUANT_DIR, "cases.json"), "w") as f:
        json.dump({"gguf_version": gguf_version(), "numpy": np.__version__,
                   "k_quantize_reference": "ggml quantize_row_*_ref" if ggml_quantize else None,
                   "cases": cases}, f, indent=1)
    print(f"{len(cases)} quant cases, {blob.size} bytes")


def gguf_version():
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:
        return "unknown"


# ---- GGUF fixture --------------------------------------------------------------------------------

def write_gguf(path):
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, arch="testarch")
    w.add_custom_alignment(64)
    kv = w.add_key_value
    kv("test.u8", 200, V.UINT8)
    kv("test.i8", -100, V.INT8)
    kv("test.u16", 60000, V.UINT16)
    kv("test.i16", -30000, V.INT16)
    kv("test.u32", 4000000000, V.UINT32)
    kv("test.i32", -2000000000, V.INT32)
    kv("test.f32", 0.1, V.FLOAT32)
    kv("test.bool_true", True, V.BOOL)
    kv("test.bool_false", False, V.BOOL)
    kv("test.string", "Grüße, GGUF ✓", V.STRING)
    kv("test.empty_string", "", V.STRING)
    kv("test.u64", 18000000000000000000, V.UINT64)
    kv("test.i64", -9000000000000000000, V.INT64)
    kv("test.f64", 2.718281828459045, V.FLOAT64)
    for name, sub, vals in [
        ("u8", V.UINT8, [0, 1, 255]), ("i8", V.INT8, [-128, 0, 127]), ("u16", V.UINT16, [0, 65535]),
        ("i16", V.INT16, [-32768, 32767]), ("u32", V.UINT32, [0, 4294967295]),
        ("i32", V.INT32, [-2147483648, 2147483647, 5]), ("f32", V.FLOAT32, [1.5, -0.25, 3e38]),
        ("bool", V.BOOL, [True, False, True]), ("u64", V.UINT64, [0, 2**64 - 1]),
        ("i64", V.INT64, [-2**63, 2**63 - 1]), ("f64", V.FLOAT64, [1e-300, -2.5]),
        ("string", V.STRING, ["a", "", "<end_of_turn>", "▁hello"]),
    ]:
        kv(f"test.array_{name}", vals, V.ARRAY, sub_type=sub)
    kv("test.array_nested_strings", [["a", "bc"], ["", "déf"]], V.ARRAY, sub_type=V.ARRAY)
    kv("test.array_nested_i32", [[1, 2], [3]], V.ARRAY)
    kv("tokenizer.ggml.model", "llama", V.STRING)

    def add(name, qt, shape):
        x = rng.standard_normal(shape).astype(np.float32)
        if qt == T.F32:
            w.add_tensor(name, x)
        elif qt == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qt == T.I32:
            w.add_tensor(name, rng.integers(-1000, 1000, shape).astype(np.int32))
        elif qt == T.I64:
            w.add_tensor(name, rng.integers(-10**12, 10**12, shape).astype(np.int64))
        elif qt in KQUANTS:
            rows = int(np.prod(shape[:-1]))
            raw = k_blocks(qt, rng, rows * shape[-1] // 256).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)

    add("f32_2d", T.F32, (3, 5))
    add("f32_4d", T.F32, (1, 2, 3, 4))
    add("f16_1d", T.F16, (7,))
    add("bf16", T.BF16, (2, 8))
    add("i32", T.I32, (4,))
    add("i64", T.I64, (3,))
    add("q8_0_3d", T.Q8_0, (2, 3, 32))
    add("q4_0", T.Q4_0, (2, 64))
    add("q4_1", T.Q4_1, (1, 32))
    add("q5_0", T.Q5_0, (3, 32))
    add("q5_1", T.Q5_1, (2, 32))
    add("q4_k", T.Q4_K, (2, 256))
    add("q5_k", T.Q5_K, (1, 512))
    add("q6_k", T.Q6_K, (2, 256))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def value_json(field, idx=None):
    """A GGUFReader field as {type, value} (arrays: {type: ARRAY, element, value: [...]})."""
    types = field.types
    if types[0] == V.ARRAY:
        return {"type": "ARRAY", "element": types[1].name, "value": array_json(field, types[1:], field.data)}
    return {"type": types[0].name, "value": scalar_json(types[0], field.parts[field.data[0]])}


def scalar_json(t, part):
    if t == V.STRING:
        return bytes(part).decode("utf-8")
    v = part.tolist()[0]
    if t == V.BOOL:
        return bool(v)
    if t == V.FLOAT32:
        return float(np.float32(v))
    return v


def array_json(field, types, data_idx):
    # Nested arrays: gguf-py flattens them into `parts`; walk them with its own layout, where
    # each nested array contributes (type, count, items...) and data holds the item part indices.
    t = types[0]
    if t != V.ARRAY:
        return [scalar_json(t, field.parts[i]) for i in data_idx]
    raise NotImplementedError


def read_gguf_json(path):
    r = gguf.GGUFReader(path)
    fields = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == V.ARRAY and len(f.types) > 1 and f.types[1] == V.ARRAY:
            fields[key] = nested_json(r, f)
        else:
            fields[key] = value_json(f)
    tensors = []
    for t in r.tensors:
        raw = np.asarray(t.data).view(np.uint8).tobytes()
        qt = T(t.tensor_type)
        if qt in (T.I32, T.I64):
            values = np.frombuffer(raw, np.int32 if qt == T.I32 else np.int64).tolist()
        else:
            values = [float(v) for v in gguf.quants.dequantize(np.frombuffer(raw, np.uint8), qt).ravel()] \
                if qt not in (T.F32, T.F16) else [float(v) for v in np.asarray(t.data, np.float32).ravel()]
        tensors.append({"name": t.name, "type": qt.name, "ne": [int(v) for v in t.shape],
                        "offset": int(t.data_offset), "nbytes": int(t.n_bytes), "hex": raw.hex(), "values": values})
    return {"version": int(r.fields["GGUF.version"].parts[-1][0]), "alignment": int(r.alignment),
            "fields": fields, "tensors": tensors}


def nested_json(reader, f):
    # gguf-py stores nested array parts flat: [key_len, key, type, elem_type, count, then per
    # inner array: elem_type, count, (str_len, str)* or value*]. Re-walk that layout.
    parts = f.parts
    i = 5  # after key length, key, value type, element type (ARRAY), count
    count = int(parts[4][0])
    out = []
    for _ in range(count):
        sub_t = V(int(parts[i][0]))
        n = int(parts[i + 1][0])
        i += 2
        items = []
        for _ in range(n):
            if sub_t == V.STRING:
                items.append(bytes(parts[i + 1]).decode("utf-8"))
                i += 2
            else:
                items.append(scalar_json(sub_t, parts[i]))
                i += 1
        out.append({"element": sub_t.name, "value": items})
    return {"type": "ARRAY", "element": "ARRAY", "value": out}


def make_gguf_fixture():
    os.makedirs(GGUF_DIR, exist_ok=True)
    path = os.path.join(GGUF_DIR, "all_types.gguf")
    write_gguf(path)
    data = read_gguf_json(path)
    with open(os.path.join(GGUF_DIR, "all_types.json"), "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
    print(f"{path}: {os.path.getsize(path)} bytes, {len(data['fields'])} keys, {len(data['tensors'])} tensors")


def check(path):
    with open(os.path.join(GGUF_DIR, "all_types.json")) as f:
        want = json.load(f)
    got = read_gguf_json(path)
    ok = True
    for key in ("version", "alignment", "fields"):
        if got[key] != want[key]:
            ok = False
            print(f"{key} differs")
            if key == "fields":
                for k in sorted(set(got[key]) | set(want[key])):
                    if got[key].get(k) != want[key].get(k):
                        print(f"  {k}: got {got[key].get(k)} want {want[key].get(k)}")
    strip = lambda ts: [{k: v for k, v in t.items() if k != "offset"} for t in ts]
    if strip(got["tensors"]) != strip(want["tensors"]):
        ok = False
        print("tensors differ")
    print(f"{path}: {'OK, gguf-py reads the same metadata and tensors' if ok else 'MISMATCH'}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", metavar="GGUF", help="verify a GGUF written by MarkBase against all_types.json")
    ap.add_argument("--ggml-src", metavar="DIR", help="ggml source tree for the K-type reference quantizers")
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check(args.check) else 1)
    with tempfile.TemporaryDirectory() as tmp:
        ggml_quantize = build_ggml_harness(args.ggml_src, tmp) if args.ggml_src else None
        if not ggml_quantize:
            print("no --ggml-src: K types get dequantization cases only")
        make_quant_cases(ggml_quantize)
    make_gguf_fixture()


if __name__ == "__main__":
    main()
