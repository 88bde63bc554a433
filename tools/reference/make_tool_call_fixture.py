#!/usr/bin/env python3
"""Writes tests/fixtures/tool_caller: a one-layer Gemma 4 text model whose weights are built by hand
(not trained, not random) so that, greedy, it answers any chat prompt of the e2b_like template with a
Gemma 4 tool call, and with a thinking block first when thinking is on:

  thinking off: <|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|><|tool_response>
  thinking on:  <|channel>thought\\nok<channel|> and then the same

The server tests run it through `markbase serve` so that tool_calls and reasoning_content come from
the engine's real forward pass, sampler and the Gemma 4 output parser, not from a canned string.

How the weights do it: the next token is a function of the last two tokens (a bigram table; every
(previous, current) pair in the two replies above is distinct). The embedding gives each token of the
replies its own dimension plus a shared constant dimension. Attention reads only the constant
dimension for queries and keys, so its scores depend on the relative position alone (RoPE), and the
query is rotated to peak at distance 1: the head copies the previous token's identity into a second
set of dimensions. The MLP has one unit per (previous, current) pair, firing only when both are
present (the constant dimension serves as its bias), which writes the next token's dimension; the
final norm keeps only the identity dimensions, so the tied embedding turns that into the top logit.

Needs numpy and safetensors; the tokenizer and chat template are e2b_like's. A numpy forward pass
(the same formulas as tools/reference/numpy_forward.py) checks both replies before writing.
"""
import json
import math
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "tests", "fixtures", "e2b_like")
OUT = os.path.join(ROOT, "tests", "fixtures", "tool_caller")

H, HD, WINDOW = 64, 32, 8  # hidden size, head dim, sliding window
EOS_IDS = [1, 106, 50]     # <eos>, <turn|>, <|tool_response>: where Gemma 4 IT stops


def vocab():
    tok = json.load(open(os.path.join(SRC, "tokenizer.json")))
    ids = dict(tok["model"]["vocab"])
    for a in tok["added_tokens"]:
        ids[a["content"]] = a["id"]
    return ids


def pieces(ids, text_or_specials):
    """Token ids of a reply written as a list of special tokens and plain ASCII strings."""
    out = []
    for p in text_or_specials:
        if p in ids:
            out.append(ids[p])
        else:
            out += [ids["\n"] if c == "\n" else ids["<0x%02X>" % ord(c)] for c in p]
    return out


def replies(ids):
    call = ["<|tool_call>", "call:get_time{tz:", '<|"|>', "UTC", '<|"|>', "}", "<tool_call|>", "<|tool_response>"]
    # (the last two prompt tokens, the reply) for each way the template ends the prompt
    off = ([ids["\n"], ids["<channel|>"]], pieces(ids, call))
    on = ([ids["<0x6C>"], ids["\n"]], pieces(ids, ["<|channel>", "thought", "\n", "ok", "<channel|>"] + call))
    return [off, on]


def rope(x, pos, inv):  # x [T, hd], half-split layout as the engine and transformers use
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    h = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., h:], x[..., :h]], -1) * sin


def rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def gelu_tanh(z):
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def build(ids):
    rs = replies(ids)
    table = {}  # (previous, current) -> next
    for context, reply in rs:
        seq = context + reply
        for a, b, c in zip(seq, seq[1:], seq[2:]):
            assert table.get((a, b), c) == c, "two replies need different tokens after the same pair"
            table[(a, b)] = c
    used = sorted({t for pair in table for t in pair} | set(table.values()))
    assert 1 + 2 * len(used) <= H, f"{len(used)} tokens do not fit a hidden size of {H}"
    dim = {t: 1 + i for i, t in enumerate(used)}           # a token's identity dimension
    prev_dim = {t: 1 + len(used) + i for i, t in enumerate(used)}  # "the previous token was t"
    V = 512
    W = {}
    emb = np.zeros((V, H))
    for t in used:
        emb[t, 0], emb[t, dim[t]] = 1.0, 1.0
    W["model.embed_tokens.weight"] = emb

    inv = 1.0 / 10000 ** (np.arange(0, HD, 2) / HD)
    p = "model.layers.0."
    W[p + "input_layernorm.weight"] = np.ones(H)
    # Query and key from the constant dimension only. The key is (1, 0) in every rotary pair, the
    # query the same pair turned by one step of that pair's frequency, so q.k after RoPE is
    # sum_j cos((distance - 1) * inv_j): largest at distance 1.
    k_vec = np.concatenate([np.ones(HD // 2), np.zeros(HD // 2)])
    q_vec = np.concatenate([np.cos(inv), -np.sin(inv)])
    wq, wk = np.zeros((HD, H)), np.zeros((HD, H))
    wq[:, 0], wk[:, 0] = q_vec, k_vec
    W[p + "self_attn.q_proj.weight"], W[p + "self_attn.k_proj.weight"] = wq, wk
    W[p + "self_attn.q_norm.weight"] = np.full(HD, 3.0)
    W[p + "self_attn.k_norm.weight"] = np.full(HD, 3.0)
    # Values carry the token's identity (one head dimension per token, the norm makes it 1-hot
    # scaled), o_proj writes it to the "previous token" dimensions.
    assert len(used) <= HD
    wv, wo = np.zeros((HD, H)), np.zeros((H, HD))
    for i, t in enumerate(used):
        wv[i, dim[t]] = 1.0
        wo[prev_dim[t], i] = 1.0
    W[p + "self_attn.v_proj.weight"], W[p + "self_attn.o_proj.weight"] = wv, wo
    W[p + "post_attention_layernorm.weight"] = np.ones(H)
    W[p + "pre_feedforward_layernorm.weight"] = np.ones(H)
    units = sorted(table.items())
    gate, up, down = np.zeros((len(units), H)), np.zeros((len(units), H)), np.zeros((H, len(units)))
    for k, ((a, b), c) in enumerate(units):
        gate[k, dim[b]], gate[k, prev_dim[a]], gate[k, 0] = 4.0, 4.0, -6.0  # fires only for (a, b)
        up[k, 0] = 1.0
        down[dim[c], k] = 1.0
        if b != c:
            down[dim[b], k] = -1.0  # (for b == c the unit still writes: a near-zero output would be
            # scaled up to noise by the post-feedforward norm)
    W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"] = gate, up, down
    W[p + "post_feedforward_layernorm.weight"] = np.full(H, 4.0)
    W[p + "layer_scalar"] = np.ones(1)
    norm = np.zeros(H)
    for t in used:
        norm[dim[t]] = 3.0  # logits from the identity dimensions only
    W["model.norm.weight"] = norm
    return {k: v.astype(np.float32) for k, v in W.items()}, rs, inv, len(units)


def forward(W, ids_, inv):
    x = W["model.embed_tokens.weight"][ids_].astype(np.float64) * math.sqrt(H)
    g = lambda n: W["model.layers.0." + n].astype(np.float64)
    T = len(ids_)
    pos = np.arange(T, dtype=np.float64)
    h = rms(x, g("input_layernorm.weight"))
    q = rope(rms(h @ g("self_attn.q_proj.weight").T, g("self_attn.q_norm.weight")), pos, inv)
    k = rope(rms(h @ g("self_attn.k_proj.weight").T, g("self_attn.k_norm.weight")), pos, inv)
    v = rms(h @ g("self_attn.v_proj.weight").T)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= i) & (j > i - WINDOW), q @ k.T, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    x = x + rms((s @ v) @ g("self_attn.o_proj.weight").T, g("post_attention_layernorm.weight"))
    h = rms(x, g("pre_feedforward_layernorm.weight"))
    m = (gelu_tanh(h @ g("mlp.gate_proj.weight").T) * (h @ g("mlp.up_proj.weight").T)) @ g("mlp.down_proj.weight").T
    x = (x + rms(m, g("post_feedforward_layernorm.weight"))) * g("layer_scalar")[0]
    logits = rms(x, W["model.norm.weight"].astype(np.float64)) @ W["model.embed_tokens.weight"].T
    return 30.0 * np.tanh(logits / 30.0)


def check(W, rs, inv):
    rng = np.random.default_rng(0)
    for context, reply in rs:
        seq = list(rng.integers(0, 512, 20)) + context  # any prompt that ends the way the template does
        for want in reply:
            logits = forward(W, seq, inv)[-1]
            top2 = np.sort(logits)[-2:]
            assert int(np.argmax(logits)) == want, (seq, want, int(np.argmax(logits)))
            assert top2[1] - top2[0] > 5, f"margin {top2[1] - top2[0]:.2f} too small"
            seq.append(want)


def main():
    ids = vocab()
    W, rs, inv, n_units = build(ids)
    check(W, rs, inv)
    os.makedirs(OUT, exist_ok=True)
    save_file(W, os.path.join(OUT, "model.safetensors"))
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(os.path.join(SRC, f), os.path.join(OUT, f))
    cfg = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "dtype": "float32",
        "hidden_size": H, "intermediate_size": n_units, "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": HD, "global_head_dim": HD,
        "num_global_key_value_heads": None, "attention_k_eq_v": False, "sliding_window": WINDOW,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "enable_moe_block": False, "num_experts": None, "top_k_experts": None,
        "moe_intermediate_size": None, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
        "final_logit_softcapping": 30.0, "max_position_embeddings": 4096, "vocab_size": 512,
        "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"}},
        "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": 2, "eos_token_id": EOS_IDS, "pad_token_id": 0, "use_cache": True,
    }
    json.dump(cfg, open(os.path.join(OUT, "config.json"), "w"), indent=2)
    json.dump({"bos_token_id": 2, "eos_token_id": EOS_IDS, "pad_token_id": 0},
              open(os.path.join(OUT, "generation_config.json"), "w"), indent=2)
    print(f"wrote {OUT}: {n_units} bigram units, both replies checked")


if __name__ == "__main__":
    main()
