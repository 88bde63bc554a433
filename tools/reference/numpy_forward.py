#!/usr/bin/env python3
"""Independent NumPy (float64) re-implementation of the Gemma 4 text forward pass that reads
only the fixture files (config.json + *.safetensors) and checks it against the HF reference
logits in tests/fixtures/*/reference.json (torch is used only to read bf16 safetensors).  Its purpose is to show that the fixtures are
self-describing and that the semantics an engine must implement are exactly these (see
docs: /work/shared/docs/gemma4-text.md). transformers is not used.

Run:  python3 tools/reference/numpy_forward.py
"""

import glob
import json
import math
import os

import numpy as np
from safetensors import safe_open

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(REPO, "tests", "fixtures")


def bf16_round(x):
    """Round float32 values to bfloat16 (nearest-even), returned as float32."""
    a = np.asarray(x, dtype=np.float32).copy()
    u = a.view(np.uint32)
    u += 0x7FFF + ((u >> 16) & 1)
    u &= 0xFFFF0000
    return a


def load_tensors(d):
    out = {}
    for fn in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        with safe_open(fn, "pt") as f:  # "pt" handles bf16; convert to float64 numpy
            for k in f.keys():
                out[k] = f.get_tensor(k).float().numpy().astype(np.float64)
    return out


def layer_geometry(t):
    L = t["num_hidden_layers"]
    geo = []
    plc = t.get("per_layer_config")  # transformers-5.17 native style
    for i, lt in enumerate(t["layer_types"]):
        hd, nkv = t["head_dim"], t["num_key_value_heads"]
        if plc is not None:
            o = plc.get(str(i), {})
            hd, nkv = o.get("head_dim", hd), o.get("num_key_value_heads", nkv)
        elif lt == "full_attention" and not t.get("model_type", "").startswith("gemma3"):  # release style
            hd = t.get("global_head_dim", 512)
            if t.get("attention_k_eq_v") and t.get("num_global_key_value_heads") is not None:
                nkv = t["num_global_key_value_heads"]
        geo.append((hd, nkv))
    assert len(geo) == L
    return geo


def rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def gelu_tanh(z):
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


def rope(x, pos, inv_freq):  # x [T, heads, hd], half-split layout
    ang = pos[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def forward(d, ids, bf16_matrices=False):
    """bf16_matrices: round every weight matrix (ndim >= 2) except the per-layer-embedding table to
    bf16 first, as an engine run with --dtype bf16 does; norms and scalars stay exact."""
    cfg = json.load(open(os.path.join(d, "config.json")))
    t = cfg.get("text_config", cfg)
    W = load_tensors(d)
    if bf16_matrices:
        for k, v in W.items():
            if v.ndim >= 2 and "embed_tokens_per_layer" not in k:
                W[k] = bf16_round(v).astype(np.float64)
    gemma3 = t.get("model_type", "").startswith("gemma3")
    if gemma3:  # Gemma 3 RMSNorm multiplies by (1 + w)
        W = {k: (1.0 + v if v.ndim == 1 and "norm" in k else v) for k, v in W.items()}
    attn_scale = t["query_pre_attn_scalar"] ** -0.5 if gemma3 else 1.0
    pre = "model.language_model." if any(k.startswith("model.language_model.") for k in W) else "model."
    g = lambda n: W[pre + n]
    bf16 = cfg.get("dtype") == "bfloat16" or bf16_matrices
    H, L, nh = t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"]
    eps, Wsl = t["rms_norm_eps"], t["sliding_window"]
    types = t["layer_types"]
    geo = layer_geometry(t)
    k_eq_v = t.get("attention_k_eq_v", False)
    n_shared = t.get("num_kv_shared_layers", 0) or 0
    first_shared = L - n_shared
    P = t.get("hidden_size_per_layer_input", 0) or 0
    moe = t.get("enable_moe_block", False)
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)

    scale = np.float32(math.sqrt(H))
    if bf16:
        scale = bf16_round(scale)
    x = g("embed_tokens.weight")[ids] * float(scale)

    if P:
        tok = g("embed_tokens_per_layer.weight")[ids] * math.sqrt(P)
        ctx = (x @ g("per_layer_model_projection.weight").T) * H ** -0.5
        ctx = rms(ctx.reshape(T, L, P), g("per_layer_projection_norm.weight"), eps)
        ple = (ctx + tok.reshape(T, L, P)) * 2 ** -0.5

    rp = t["rope_parameters"]
    inv = {}
    for lt in set(types):
        hd = next(geo[i][0] for i in range(L) if types[i] == lt)
        p = rp[lt]
        if p["rope_type"] == "proportional":
            ra = int(p.get("partial_rotary_factor", 1.0) * hd // 2)
            f = np.zeros(hd // 2)
            f[:ra] = 1.0 / p["rope_theta"] ** (np.arange(0, 2 * ra, 2) / hd)
        else:
            f = 1.0 / p["rope_theta"] ** (np.arange(0, hd, 2) / hd)
        if p["rope_type"] == "linear":
            f = f / p["factor"]
        inv[lt] = f

    i_idx, j_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    masks = {"full_attention": j_idx <= i_idx,
             "sliding_attention": (j_idx <= i_idx) & (j_idx > i_idx - Wsl)}
    kv = {}  # layer -> (K, V)
    for l in range(L):
        lp = f"layers.{l}."
        hd, nkv = geo[l]
        lt = types[l]
        h = rms(x, g(lp + "input_layernorm.weight"), eps)
        q = (h @ g(lp + "self_attn.q_proj.weight").T).reshape(T, nh, hd)
        q = rope(rms(q, g(lp + "self_attn.q_norm.weight"), eps), pos, inv[lt])
        if l >= first_shared:
            src = max(s for s in range(first_shared) if types[s] == lt)
            K, V = kv[src]
        else:
            kr = (h @ g(lp + "self_attn.k_proj.weight").T).reshape(T, nkv, hd)
            if k_eq_v and lt == "full_attention":
                vr = kr
            else:
                vr = (h @ g(lp + "self_attn.v_proj.weight").T).reshape(T, nkv, hd)
            K = rope(rms(kr, g(lp + "self_attn.k_norm.weight"), eps), pos, inv[lt])
            V = vr if gemma3 else rms(vr, None, eps)  # Gemma 4's weightless v_norm
            kv[l] = (K, V)
        nkv_src = K.shape[1]
        grp = nh // nkv_src
        o = np.zeros((T, nh, hd))
        for hq in range(nh):
            s = (q[:, hq, :] @ K[:, hq // grp, :].T) * attn_scale
            s = np.where(masks[lt], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o[:, hq, :] = s @ V[:, hq // grp, :]
        a = o.reshape(T, nh * hd) @ g(lp + "self_attn.o_proj.weight").T
        x = x + rms(a, g(lp + "post_attention_layernorm.weight"), eps)

        r = x
        h = rms(r, g(lp + "pre_feedforward_layernorm.weight"), eps)
        m = (gelu_tanh(h @ g(lp + "mlp.gate_proj.weight").T) * (h @ g(lp + "mlp.up_proj.weight").T)) \
            @ g(lp + "mlp.down_proj.weight").T
        if moe:
            m1 = rms(m, g(lp + "post_feedforward_layernorm_1.weight"), eps)
            z = rms(r, None, eps) * g(lp + "router.scale") * H ** -0.5
            logits = z @ g(lp + "router.proj.weight").T
            prob = np.exp(logits - logits.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            k = t["top_k_experts"]
            idx = np.argsort(-prob, axis=-1, kind="stable")[:, :k]
            w = np.take_along_axis(prob, idx, -1)
            w = w / w.sum(-1, keepdims=True) * g(lp + "router.per_expert_scale")[idx]
            u = rms(r, g(lp + "pre_feedforward_layernorm_2.weight"), eps)
            gu_all, dn_all = g(lp + "experts.gate_up_proj"), g(lp + "experts.down_proj")
            I = gu_all.shape[1] // 2
            m2 = np.zeros_like(r)
            for tt in range(T):
                for kk in range(k):
                    e = idx[tt, kk]
                    gu = gu_all[e] @ u[tt]
                    m2[tt] += w[tt, kk] * (dn_all[e] @ (gelu_tanh(gu[:I]) * gu[I:]))
            m2 = rms(m2, g(lp + "post_feedforward_layernorm_2.weight"), eps)
            m = m1 + m2
        x = r + rms(m, g(lp + "post_feedforward_layernorm.weight"), eps)
        if P:
            pg = gelu_tanh(x @ g(lp + "per_layer_input_gate.weight").T) * ple[:, l, :]
            x = x + rms(pg @ g(lp + "per_layer_projection.weight").T, g(lp + "post_per_layer_input_norm.weight"), eps)
        if not gemma3:
            x = x * g(lp + "layer_scalar")[0]

    y = rms(x, g("norm.weight"), eps)
    logits = y @ g("embed_tokens.weight").T
    cap = t.get("final_logit_softcapping")
    if cap:
        logits = cap * np.tanh(logits / cap)
    return logits


def main():
    worst = {}
    for d in sorted(glob.glob(os.path.join(FIXTURES, "*"))):
        if not os.path.exists(os.path.join(d, "reference.json")):
            continue  # tokenizer/chat fixtures
        ref = json.load(open(os.path.join(d, "reference.json")))
        name = os.path.basename(d)
        errs = []
        for p in ref["prompts"]:
            want = np.fromfile(os.path.join(d, p["logits_file"]), dtype="<f4").reshape(len(p["tokens"]), -1)
            got = forward(d, p["tokens"])
            errs.append(float(np.abs(got - want).max()))
            if ref["torch_dtype"] == "bfloat16":
                # HF's bf16 activations are too noisy to test an engine's formulas against (it
                # differs from exact math by ~0.6 here). The exact float64 forward over the same
                # bf16 weights (with the bf16-rounded embedding scale) is written beside it.
                got.astype("<f4").tofile(os.path.join(d, "exact_" + p["logits_file"]))
            else:
                # What --dtype bf16 computes, exactly: separates an engine's error from the
                # change bf16 weights themselves make.
                forward(d, p["tokens"], bf16_matrices=True).astype("<f4").tofile(
                    os.path.join(d, "exact_bf16w_" + p["logits_file"]))
            # greedy continuation (no cache, float64)
            ids = list(p["tokens"])
            for _ in p["greedy"]:
                ids.append(int(np.argmax(forward(d, ids)[-1])))
            greedy_ok = ids[len(p["tokens"]):] == p["greedy"]
            errs[-1] = (errs[-1], greedy_ok)
        worst[name] = errs
        tol = 1.0 if ref["torch_dtype"] == "bfloat16" else 2e-4  # bf16: HF bf16 vs float64
        ok = all(e <= tol for e, _ in errs)
        print(f"{name:16s} dtype={ref['torch_dtype']:9s} max|numpy64 - HF| per prompt: "
              + ", ".join(f"{e:.2e}{'' if gk else ' (greedy differs)'}" for e, gk in errs)
              + ("  OK" if ok else f"  FAIL (tol {tol})"))


if __name__ == "__main__":
    main()
