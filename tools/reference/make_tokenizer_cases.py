#!/usr/bin/env python3
"""Generates tests/fixtures/tokenizer/hf_cases.jsonl: reference token ids and decodes from the
Hugging Face `tokenizers` package for the Gemma 4 and Gemma 3 tokenizer.json files, checked
token for token by tests/test_tokenizer.cpp.

Deterministic (fixed seed). Regenerate with
  python3 tools/reference/make_tokenizer_cases.py [--shared DIR] [--out FILE]
With --unicode-table it also rewrites src/tokenizer/tokenizer_unicode.cpp, the `\\w` class of
HF's single_word check, probed from the package itself for every code point.

Line format (JSON Lines; the first line is {"meta": ...}):
  {"k":"enc", "s": text | "x": hex bytes (invalid UTF-8), ["ps": false],
   "g4": ids, ["g3": ids], ["d4": text], ["d3": text]}
     ids = encode(text, add_special_tokens=False); with "ps": false the tokenizer has
     encode_special_tokens = True (special tokens in the text are plain text). For "x" cases the
     reference is the encoding of bytes.decode("utf-8", "replace"), the behaviour the C++
     tokenizer documents. "g3" is omitted when equal to "g4"; "d4"/"d3" (decode of the ids) are
     omitted when equal to the input text (always present for "x"). "sy"/"dsy": the same for the small synthetic
     tokenizer written next to the cases (synthetic-tokenizer.json), present on a subset.
  {"k":"dec", "t": "g4" | "g3", "ids": ids, "d": decode(ids, skip_special_tokens=False)}
"""
import argparse
import json
import os
import random

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SEED = 20240607

WORDS = (
    "the of and to in is was for that with as on by at from this be are it or an which have not "
    "has had were but one all their they can been also more its other new time first after some "
    "model token language learning attention transformer embedding vector matrix layer weight "
    "Hello World Python C++ GPU CUDA kernel tensor Gemma inference server request response "
    "don't won't it's I'm you're we've they'll she'd y'all naïve café résumé Zürich São Paulo "
    "internationalization antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis"
).split()

SPECIAL_STRINGS = [
    "<start_of_turn>", "<end_of_turn>", "<|turn>", "<turn|>", "<bos>", "<eos>", "<pad>", "<unk>",
    "<mask>", "[multimodal]", "<unused0>", "<unused12>", "<unused6241>", "<|image|>", "<|audio|>",
    "<|image>", "<image|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|\"|>",
    "<|think|>", "<|channel>", "<channel|>", "<start_of_image>", "<end_of_image>",
    "<image_soft_token>", "<table>", "</td>", "<h1>", "<code>", "</code>", "<b>", "<s>", "</s>",
]
PARTIAL_SPECIALS = [
    "<|tur", "<|turn", "<start_of_tu", "<end_of_", "<bo", "<eo", "<|", "|>", "<", ">", "<<bos>>",
    "<bos", "bos>", "<unused", "<unused99999>", "<|image", "<|\"", "<start_of_turn", "<turn|",
    "<|TURN>", "<BOS>", "< bos>", "<\nbos>", "</table", "<tab", "[multi", "[multimodal",
]
CODE_SNIPPETS = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size(); }\n",
    '{"name": "gemma", "layers": 48, "rope_theta": 1000000.0, "tags": ["a", "b"]}',
    "<html><body><table><tr><td>1</td><td>2</td></tr></table></body></html>",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "fn main() {\n    println!(\"{}\", 42);\n}\n",
    "    if x:\n        pass\n    else:\n        raise ValueError('bad')\n",
    "$ ls -la | grep '^d' && echo \"done\" > /dev/null 2>&1",
    "a = [i**2 for i in range(10) if i % 2 == 0]  # squares\n",
    "<div class=\"x\">\n  <span>text</span>\n</div>\n",
    "x<y && y>z || !(a==b) ? c : d; // ->* ::",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "```python\nprint('hi')\n```\n",
    "key:\tvalue\r\nother:\t\tvalue2\r\n",
]
EMOJI = [
    "😀", "😃", "🚀", "✨", "🦙", "✅", "❤️", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸", "🇯🇵",
    "😶‍🌫️", "🧑🏿‍🚀", "👁️‍🗨️", "🫠", "🪿", "☺", "☺️", "©", "™", "🔥🔥🔥", "💯", "🤖",
]
SCRIPTS = {
    "cjk": [(0x4E00, 0x9FFF)],
    "kana": [(0x3041, 0x3096), (0x30A1, 0x30FA)],
    "hangul": [(0xAC00, 0xD7A3)],
    "arabic": [(0x0621, 0x064A), (0x0660, 0x0669)],
    "devanagari": [(0x0905, 0x0939), (0x093E, 0x094D), (0x0966, 0x096F)],
    "cyrillic": [(0x0410, 0x044F)],
    "thai": [(0x0E01, 0x0E3A), (0x0E40, 0x0E4E)],
    "greek": [(0x0391, 0x03A9), (0x03B1, 0x03C9)],
    "hebrew": [(0x05D0, 0x05EA)],
    "latin_ext": [(0x00C0, 0x024F)],
}
WHITESPACE = [" ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2581", "\u2003", "\v", "\f"]


def rand_script_text(rng: random.Random, script: str, n: int) -> str:
    ranges = SCRIPTS[script]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
        if script not in ("cjk", "kana", "thai") and rng.random() < 0.18:
            out.append(" ")
    return "".join(out)


def rand_codepoint(rng: random.Random) -> str:
    while True:
        r = rng.random()
        if r < 0.3:
            cp = rng.randint(0, 0x7F)
        elif r < 0.6:
            cp = rng.randint(0x80, 0xFFFF)
        else:
            cp = rng.randint(0x10000, 0x10FFFF)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def rand_sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 18))]
    if rng.random() < 0.5:
        words[0] = words[0].capitalize()
    s = " ".join(words)
    return s + rng.choice(["", ".", "!", "?", ",", ":", ";", "...", "\n"])


def rand_whitespace(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.25:
        return " " * rng.randint(1, 70)
    if kind < 0.4:
        return "\t" * rng.randint(1, 40)
    if kind < 0.55:
        return "\n" * rng.randint(1, 40)
    if kind < 0.65:
        return "\u2581" * rng.randint(1, 40)
    return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 30)))


def rand_digits(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.3:
        return str(rng.randint(0, 10 ** rng.randint(1, 30)))
    if kind < 0.5:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 8)}f}"
    if kind < 0.7:
        return f"{rng.randint(0, 10**9):,}"
    if kind < 0.85:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 200)))
    return f"v{rng.randint(0, 9)}.{rng.randint(0, 99)}.{rng.randint(0, 999)}-rc{rng.randint(1, 9)}"


def rand_control(rng: random.Random) -> str:
    pool = [chr(c) for c in list(range(0, 32)) + [0x7F] + list(range(0x80, 0xA0))]
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 12)))


def rand_special_mix(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(SPECIAL_STRINGS))
        elif r < 0.55:
            parts.append(rng.choice(PARTIAL_SPECIALS))
        elif r < 0.8:
            parts.append(rand_sentence(rng))
        else:
            parts.append(rand_whitespace(rng))
    sep = rng.choice(["", "", " ", "\n"])
    return sep.join(parts)


def rand_piece(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.25:
        return rand_sentence(rng)
    if r < 0.4:
        return rand_script_text(rng, rng.choice(list(SCRIPTS)), rng.randint(1, 40))
    if r < 0.5:
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 6)))
    if r < 0.6:
        return rand_whitespace(rng)
    if r < 0.68:
        return rand_digits(rng)
    if r < 0.74:
        return rand_control(rng)
    if r < 0.82:
        return rng.choice(CODE_SNIPPETS)
    if r < 0.9:
        return rng.choice(SPECIAL_STRINGS + PARTIAL_SPECIALS)
    return "".join(rand_codepoint(rng) for _ in range(rng.randint(1, 12)))


def make_texts(rng: random.Random) -> list:
    texts = ["", " ", "  ", "\n", "\u2581", "a", "A", "<bos>", "<|turn>user\nHi<turn|>\n",
             "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n", "\ufffd", "\x00",
             " Hello", "Hello ", "Hello  world", "   leading", "trailing   ", ">\u2581</", "> </a>"]
    gens = [
        (400, lambda: rand_sentence(rng) + (" " + rand_sentence(rng) if rng.random() < 0.5 else "")),
        (400, lambda: rand_script_text(rng, rng.choice(list(SCRIPTS)), rng.randint(1, 120))),
        (200, lambda: "".join(rng.choice(EMOJI) + rng.choice(["", " ", "x"]) for _ in range(rng.randint(1, 10)))),
        (150, lambda: rand_control(rng) + rand_sentence(rng) + rand_control(rng)),
        (250, lambda: rand_whitespace(rng) + rng.choice(["", "x", "Hello", "世界"]) + rand_whitespace(rng)),
        (150, lambda: rng.choice(CODE_SNIPPETS) + rng.choice(CODE_SNIPPETS)),
        (300, lambda: rand_special_mix(rng)),
        (150, lambda: rand_digits(rng) + rng.choice([" ", "", "x", "."]) + rand_digits(rng)),
        (250, lambda: "".join(rand_codepoint(rng) for _ in range(rng.randint(1, 40)))),
        (600, lambda: "".join(rand_piece(rng) for _ in range(rng.randint(1, 10)))),
    ]
    for count, gen in gens:
        texts.extend(gen() for _ in range(count))
    # Long inputs: one BPE word spans whole lines, so these exercise the long-word merge path.
    texts.append("a" * 20000)
    texts.append("ab" * 5000 + " " + "ba" * 5000)
    texts.append(" " * 3000 + "x" + "\t" * 500 + "\n" * 700)
    texts.append(rand_script_text(rng, "cjk", 3000))
    texts.append(rand_script_text(rng, "thai", 2000))
    texts.append("".join(rand_piece(rng) for _ in range(200)))
    texts.append(" ".join(rand_sentence(rng) for _ in range(150)))
    return texts


def make_invalid(rng: random.Random) -> list:
    fixed = [
        b"\xff", b"\xfe\xff", b"\x80", b"\xbf\x80", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf",
        b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80",
        b"\xe4\xb8", b"\xe4", b"\xf0\x9f\x98", b"abc\xe4\xb8def", b"\xf0\x9f\x98\x80\x80",
        b"Hello \xff world", b"<bos\xff>", b"<bos>\xc3", b"\xc3<bos>", b"\xe2\x96", b"\xe2\x96 x",
        b"  \xa0  ", b"\x00\xff\x00", b"\xc3\xa9\xc3", b"\xf0\x90\x80", b"\xef\xbf\xbd\xff",
    ]
    out = list(fixed)
    for _ in range(120):
        r = rng.random()
        if r < 0.4:
            out.append(bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 30))))
        else:
            base = bytearray(rand_piece(rng).encode("utf-8"))
            for _ in range(rng.randint(1, 4)):
                pos = rng.randint(0, len(base))
                bad = rng.choice([b"\xff", b"\x80", b"\xc3", b"\xe4\xb8", b"\xf0\x9f", b"\xed\xa0\x80", b"\xc0\x80"])
                base[pos:pos] = bad
            out.append(bytes(base))
    return [b for b in out if not _is_utf8(b)]


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def byte_token_ids(tok: Tokenizer) -> list:
    return [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]


def make_decode_cases(rng: random.Random, tok: Tokenizer) -> list:
    n = tok.get_vocab_size(with_added_tokens=True)
    byte_ids = byte_token_ids(tok)
    cases = []
    for _ in range(120):
        ids = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.45:
                ids.append(rng.randrange(n))
            elif r < 0.85:
                ids.append(rng.choice(byte_ids))
            elif r < 0.95:
                # a correct multi-byte character spelled in byte tokens
                ids.extend(byte_ids[b] for b in rand_codepoint(rng).encode("utf-8"))
            else:
                ids.append(rng.randrange(256))
        cases.append(ids)
    return cases


SYN_ADDED = ["<tag>", "</tag>", "word", "norm me", "<s>", "</s>"]


def make_synthetic(rng: random.Random) -> Tokenizer:
    """A small BPE that exercises what Gemma's files leave unused: Prepend normalizer, Split
    MergedWithNext, <unk> fusing without byte fallback, a Strip decoder, and added tokens with
    lstrip / rstrip / single_word / normalized."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    corpus = [rand_sentence(rng) for _ in range(3000)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.add_tokens([
        AddedToken("<tag>", lstrip=True, normalized=False),
        AddedToken("</tag>", rstrip=True, normalized=False),
        AddedToken("word", single_word=True, normalized=False),
        AddedToken("norm me", normalized=True),
    ])
    return tok


def synthetic_texts(rng: random.Random, texts: list) -> list:
    out = [t for t in texts if len(t) < 400][:900]
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.4:
                parts.append(rng.choice(SYN_ADDED))
            elif r < 0.7:
                parts.append(rand_sentence(rng))
            elif r < 0.85:
                parts.append(rng.choice(["", " ", "  ", "\t", "\n ", "_", "x", "words", "sword"]))
            else:
                parts.append(rand_piece(rng))
        out.append(rng.choice(["", " ", ""]).join(parts))
    return out


def write_word_char_table(syn: Tokenizer, path: str) -> None:
    """HF decides single_word with the regex `\\w`; probing "word" + c for every code point c
    gives exactly the class the installed package uses (its Unicode version, not Python's)."""
    word_id = syn.token_to_id("word")
    cps = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    ranges = []
    for start in range(0, len(cps), 65536):
        chunk = cps[start:start + 65536]
        encs = syn.encode_batch(["word" + chr(c) for c in chunk], add_special_tokens=False)
        for c, e in zip(chunk, encs):
            if word_id in e.ids:
                continue  # "word" stood alone: c is not a word character
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
    body = ",\n".join(f"    {{0x{a:X}, 0x{b:X}}}" for a, b in ranges)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"""// Generated by tools/reference/make_tokenizer_cases.py --unicode-table (tokenizers
// {tokenizers.__version__}); do not edit. The `\\w` class of HF's single_word check: {len(ranges)} ranges.
#include <algorithm>
#include <array>
#include <cstdint>

#include "tokenizer/tokenizer_impl.h"

namespace mb::tok_detail {{
namespace {{
struct Range {{
  uint32_t lo, hi;
}};
constexpr std::array<Range, {len(ranges)}> kWordRanges{{{{
{body}}}}};
}}  // namespace

bool is_word_char(uint32_t cp) {{
  auto it = std::upper_bound(kWordRanges.begin(), kWordRanges.end(), cp,
                             [](uint32_t c, const Range& r) {{ return c < r.lo; }});
  return it != kWordRanges.begin() && cp <= (it - 1)->hi;
}}

}}  // namespace mb::tok_detail
""")
    print(f"wrote {path}: {len(ranges)} ranges")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.normpath(os.path.join(here, "..", ".."))
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(repo, "..", "shared", "data", "tokenizer"))
    ap.add_argument("--out", default=os.path.join(repo, "tests", "fixtures", "tokenizer", "hf_cases.jsonl"))
    ap.add_argument("--unicode-table", action="store_true")
    args = ap.parse_args()
    syn_path = os.path.join(os.path.dirname(args.out), "synthetic-tokenizer.json")

    g4 = Tokenizer.from_file(os.path.join(args.shared, "gemma4-tokenizer.json"))
    g3 = Tokenizer.from_file(os.path.join(args.shared, "gemma3-tokenizer.json"))
    g4_plain = Tokenizer.from_file(os.path.join(args.shared, "gemma4-tokenizer.json"))
    g3_plain = Tokenizer.from_file(os.path.join(args.shared, "gemma3-tokenizer.json"))
    g4_plain.encode_special_tokens = True
    g3_plain.encode_special_tokens = True

    rng = random.Random(SEED)
    syn = make_synthetic(rng)
    if args.unicode_table:
        write_word_char_table(syn, os.path.join(repo, "src", "tokenizer", "tokenizer_unicode.cpp"))
    texts = make_texts(rng)
    syn_set = set(synthetic_texts(rng, texts))
    invalid = make_invalid(rng)
    no_special = [t for t in texts if any(s in t for s in SPECIAL_STRINGS)][:200]

    lines = []
    n_enc = 0

    def enc_case(key: str, value, text: str, t4: Tokenizer, t3: Tokenizer, parse_special: bool) -> None:
        nonlocal n_enc
        ids4 = t4.encode(text, add_special_tokens=False).ids
        ids3 = t3.encode(text, add_special_tokens=False).ids
        case = {"k": "enc", key: value}
        if not parse_special:
            case["ps"] = False
        case["g4"] = ids4
        if ids3 != ids4:
            case["g3"] = ids3
        d4 = g4.decode(ids4, skip_special_tokens=False)
        d3 = g3.decode(ids3, skip_special_tokens=False)
        if d4 != text or key == "x":
            case["d4"] = d4
        if d3 != text or key == "x":
            case["d3"] = d3
        if parse_special and text in syn_set:
            idsy = syn.encode(text, add_special_tokens=False).ids
            case["sy"] = idsy
            dsy = syn.decode(idsy, skip_special_tokens=False)
            if dsy != text:
                case["dsy"] = dsy
            syn_set.discard(text)
        lines.append(case)
        n_enc += 1

    for t in texts:
        enc_case("s", t, t, g4, g3, True)
    for t in no_special:
        enc_case("s", t, t, g4_plain, g3_plain, False)
    for b in invalid:
        enc_case("x", b.hex(), b.decode("utf-8", errors="replace"), g4, g3, True)
    for t in sorted(syn_set):  # synthetic-only texts still get Gemma references
        enc_case("s", t, t, g4, g3, True)

    n_dec = 0
    for name, tok in (("g4", g4), ("g3", g3)):
        for ids in make_decode_cases(rng, tok):
            lines.append({"k": "dec", "t": name, "ids": ids, "d": tok.decode(ids, skip_special_tokens=False)})
            n_dec += 1

    meta = {"meta": {"tokenizers": tokenizers.__version__, "seed": SEED, "enc_cases": n_enc, "dec_cases": n_dec}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    syn_json = json.loads(syn.to_str())
    with open(syn_path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(syn_json, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for obj in [meta] + lines:
            f.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {n_enc} encode cases, {n_dec} decode cases, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
