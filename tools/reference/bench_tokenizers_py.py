#!/usr/bin/env python3
"""Single-threaded encode/decode throughput of the Hugging Face `tokenizers` package on the
same 10 MB text as bench/bench_tokenizer.cpp, in the same units (MB/s = 1e6 bytes of UTF-8
input text per second, one encode() call over the whole text, one decode() call over all its
ids). Rates are given for CPU time (what Google Benchmark's rate counters use, and robust on a
shared machine) and for wall time.

The text is rebuilt here exactly as the C++ bench builds it; both print its length and FNV-1a
hash so the identity can be checked.

  python3 tools/reference/bench_tokenizers_py.py [--tokenizer PATH] [--repeats N] [--dump FILE]
"""
import argparse
import os

os.environ["RAYON_NUM_THREADS"] = "1"  # must precede the import of tokenizers
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import time  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

TARGET_BYTES = 10_000_000
LICENSE_DIR = "/usr/share/common-licenses"
MULTILINGUAL_REPEAT = 16
# Keep byte-identical with kMultilingual in bench/bench_tokenizer.cpp.
MULTILINGUAL = (
    "机器学习是人工智能的一个分支，它使计算机能够在没有明确编程的情况下从数据中学习。"
    "深度学习模型通过多层神经网络提取特征，并在图像识别、语音识别和自然语言处理中取得了显著成果。\n"
    "東京は日本の首都であり、世界有数の大都市です。春には桜が咲き、多くの観光客が訪れます。\n"
    "서울은 대한민국의 수도이며 한강을 중심으로 발전한 도시입니다. 전통과 현대가 공존합니다.\n"
    "الذكاء الاصطناعي هو فرع من علوم الحاسوب يهدف إلى إنشاء أنظمة قادرة على أداء مهام تتطلب ذكاءً بشريًا.\n"
    "कृत्रिम बुद्धिमत्ता कंप्यूटर विज्ञान की एक शाखा है जो ऐसी मशीनें बनाने पर केंद्रित है जो सोच सकें।\n"
    "Машинное обучение позволяет компьютерам находить закономерности в больших объёмах данных.\n"
    "ปัญญาประดิษฐ์เป็นสาขาหนึ่งของวิทยาการคอมพิวเตอร์ที่มุ่งสร้างเครื่องจักรที่คิดได้\n"
    "Η τεχνητή νοημοσύνη αλλάζει τον τρόπο που εργαζόμαστε και επικοινωνούμε.\n"
    "Emoji: 🚀✨ 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 😀😃😄 — “quotes”, café, naïve, Zürich, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.\n"
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text if c.isalnum()]  # 123 4567\n"
)


def bench_text() -> bytes:
    unit = b""
    for name in sorted(os.listdir(LICENSE_DIR)):
        path = os.path.join(LICENSE_DIR, name)
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as f:
                unit += f.read()
    unit += MULTILINGUAL.encode("utf-8") * MULTILINGUAL_REPEAT
    data = unit * (TARGET_BYTES // len(unit) + 1)
    cut = TARGET_BYTES
    while cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut]


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    default_tok = os.path.join(here, "..", "..", "..", "shared", "data", "tokenizer", "gemma4-tokenizer.json")
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.normpath(default_tok))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dump", help="also write the benchmark text to this file")
    args = ap.parse_args()

    data = bench_text()
    if args.dump:
        with open(args.dump, "wb") as f:
            f.write(data)
    text = data.decode("utf-8")
    print(f"text: {len(data)} bytes, fnv1a64 {fnv1a64(data):016x}")

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(args.tokenizer)
    print(f"load: {time.perf_counter() - t0:.3f} s")

    def timed(fn):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        return result, time.perf_counter() - w0, time.process_time() - c0

    enc_wall = enc_cpu = dec_wall = dec_cpu = float("inf")
    ids = []
    for _ in range(args.repeats):
        ids, w, c = timed(lambda: tok.encode(text, add_special_tokens=False).ids)
        enc_wall, enc_cpu = min(enc_wall, w), min(enc_cpu, c)
        out, w, c = timed(lambda: tok.decode(ids, skip_special_tokens=False))
        dec_wall, dec_cpu = min(dec_wall, w), min(dec_cpu, c)
        assert out == text
    mb = len(data) / 1e6
    print(f"tokens: {len(ids)}")
    print(f"encode: {mb / enc_cpu:.2f} MB/s CPU, {mb / enc_wall:.2f} MB/s wall (best of {args.repeats})")
    print(f"decode: {mb / dec_cpu:.2f} MB/s CPU, {mb / dec_wall:.2f} MB/s wall (best of {args.repeats})")


if __name__ == "__main__":
    main()
