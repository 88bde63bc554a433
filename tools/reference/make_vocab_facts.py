#!/usr/bin/env python3
"""Vocabulary facts of the Gemma 4 and Gemma 3 tokenizer.json files (../shared/data/tokenizer), as
Hugging Face's `tokenizers` reads them, for tests/test_tokenizer.cpp (*.VocabularyAndSpecialIds,
TokenizerGemma4.SpecialTokensAndParseSpecial): the vocabulary size, the id of each named piece,
the text and added/special flags of chosen ids, and a few encodings and decodings.

Rerun:  pip install tokenizers
        python3 tools/reference/make_vocab_facts.py [--shared DIR]
Output: tests/fixtures/tokenizer/vocab_facts.json
"""

import argparse
import json
import os

import tokenizers
from tokenizers import Tokenizer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(REPO, "tests", "fixtures", "tokenizer", "vocab_facts.json")

PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<start_of_turn>", "<end_of_turn>",
          "<image_soft_token>", "\u2581Hello", "Hello", "<0x41>", "\n", "\n\n", "no such piece"]
IDS = [0, 1, 2, 3, 105, 106, 107, 108, 9259, 26352, 262143, 262144]
ENCODE = ["<bos>", "\n\n", "Hello", "a<image_soft_token>b", "<|turn>user\nHi<turn|>"]


def facts_of(path):
    tok = Tokenizer.from_file(path)
    added = tok.get_added_tokens_decoder()
    size = tok.get_vocab_size(with_added_tokens=True)
    plain = Tokenizer.from_file(path)
    plain.encode_special_tokens = True
    return {
        "vocab_size": size,
        "adds_bos": tok.encode("x", add_special_tokens=True).ids[0] == tok.token_to_id("<bos>"),
        "piece_ids": {p: tok.token_to_id(p) for p in PIECES},
        "ids": {
            str(i): {"text": tok.id_to_token(i), "added": i in added, "special": bool(i in added and added[i].special)}
            for i in IDS if i < size
        },
        "encode": [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids,
                    "ids_without_special": plain.encode(t, add_special_tokens=False).ids} for t in ENCODE],
        "decode": [{"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                    "text_skip_special": tok.decode(ids, skip_special_tokens=True)}
                   for ids in ([2, 9259], [9259, 9259], [105, 2364, 107])],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(REPO, "..", "shared", "data", "tokenizer"))
    args = ap.parse_args()
    facts = {"generator": "tools/reference/make_vocab_facts.py", "tokenizers": tokenizers.__version__}
    for name in ("gemma4", "gemma3"):
        facts[name] = facts_of(os.path.join(args.shared, f"{name}-tokenizer.json"))
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(facts, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
