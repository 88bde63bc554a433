#!/usr/bin/env python3
"""Generate tiny random-weight Gemma 4 checkpoints (Hugging Face format) plus reference
outputs computed by transformers (float32 / bfloat16, attn_implementation="eager").

Rerun:  python3 tools/reference/make_fixtures.py
Output: tests/fixtures/<name>/{config.json, *.safetensors, reference.json, logits_<i>.bin}

Everything is deterministic (fixed per-tensor seeds, CPU only).  See README.md next to
this file for the file formats.
"""

import json
import math
import os
import shutil
import sys
import zlib

import numpy as np
import torch

import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4UnifiedConfig,
    Gemma4UnifiedForConditionalGeneration,
)

EXPECTED_TRANSFORMERS = "5.17.0"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
VOCAB = 512
N_GREEDY = 10
FINAL_NORM_GAIN = 4.0
QK_NORM_GAIN = 0.5

S, F = "sliding_attention", "full_attention"

torch.set_num_threads(1)  # bit-stable CPU reductions across machines with different core counts
transformers.logging.set_verbosity_error()


# ----------------------------------------------------------------------------------------
# fixture definitions
# ----------------------------------------------------------------------------------------

COMMON_TEXT = dict(
    vocab_size=VOCAB,
    head_dim=32,
    global_head_dim=64,
    sliding_window=8,
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def e2b_like_config():
    text = dict(
        COMMON_TEXT,
        hidden_size=64,
        intermediate_size=48,  # double-wide (96) on the KV-shared layers
        num_hidden_layers=10,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=[S, S, S, S, F] * 2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=4,
        use_double_wide_mlp=True,
        attention_k_eq_v=False,
        enable_moe_block=False,
        max_position_embeddings=131072,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=32,
    )
    audio = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[8, 4],
        conv_kernel_size=3,
        output_proj_dims=16,
    )
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio)


def moe_like_config():
    return Gemma4TextConfig(
        **COMMON_TEXT,
        hidden_size=64,
        intermediate_size=32,  # dense ("shared") MLP
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, S, S, S, S, F],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=16,
        use_bidirectional_attention="vision",
        max_position_embeddings=262144,
    )


def dense_kv_config():
    # H = 48 so that sqrt(H) = 6.9282.. is not representable in bf16 (-> 6.9375).
    return Gemma4TextConfig(
        **COMMON_TEXT,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=12,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, S, S, S, S, F] * 2,
        hidden_size_per_layer_input=0,
        enable_moe_block=False,
        use_bidirectional_attention="vision",
        max_position_embeddings=262144,
    )


def unified_like_config():
    text = dict(
        COMMON_TEXT,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, S, S, S, S, F],
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        use_bidirectional_attention="vision",
        max_position_embeddings=262144,
    )
    vision = dict(patch_size=2, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=16, output_proj_dims=32)
    audio = dict(audio_embed_dim=16)
    return Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=audio)


def gemma3_like_config():
    # Gemma 3 (the 270M's architecture): (1 + w) norms, query_pre_attn_scalar != head_dim,
    # linear RoPE scaling on full layers only, and a last layer that stays sliding (Gemma 3 does
    # not force it to full, unlike Gemma 4).
    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=[S, S, S, S, S, F, S, S],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        max_position_embeddings=32768,
    )


FIXTURE_SPECS = [
    # name, class, config fn, seed, dtype, release-style config keys?, shards
    dict(name="e2b_like", cls=Gemma4ForConditionalGeneration, config=e2b_like_config, seed=1001,
         release_style=True, inject_shared_kv=True,
         tokenizer=("gemma4-tokenizer.json", "gemma-4-31B-it.jinja")),
    dict(name="moe_like", cls=Gemma4ForCausalLM, config=moe_like_config, seed=2002,
         release_style=False, shards=2),
    dict(name="dense_kv", cls=Gemma4ForCausalLM, config=dense_kv_config, seed=3003,
         release_style=True),
    dict(name="unified_like", cls=Gemma4UnifiedForConditionalGeneration, config=unified_like_config,
         seed=4004, release_style=True),
    dict(name="dense_kv_bf16", cls=Gemma4ForCausalLM, config=dense_kv_config, seed=3003,
         release_style=True, dtype=torch.bfloat16, weights_from="dense_kv"),
    dict(name="gemma3_like", cls=Gemma3ForCausalLM, config=gemma3_like_config, seed=5005,
         release_style=False, norm_shift=True, tokenizer=("gemma3-tokenizer.json", "gemma-3-it.jinja")),
]

# Gemma 3 norms multiply by (1 + w): draw w so that (1 + w) has the gains used for Gemma 4.
NORM_SHIFT = 0.0


# ----------------------------------------------------------------------------------------
# weight initialisation
# ----------------------------------------------------------------------------------------

def tensor_gen(seed, name):
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def randn(g, shape):
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def draw(name, t, g):
    """Return a float32 tensor of t's shape for parameter/buffer `name`."""
    shape = tuple(t.shape)
    leaf = name.split(".")[-1]
    parent = name.split(".")[-2] if "." in name else ""
    if leaf == "layer_scalar":
        return 0.5 + torch.rand(shape, generator=g)
    if leaf in ("input_min", "output_min"):  # audio clippable linears (finite, like real checkpoints)
        return -(4.0 + torch.rand(shape, generator=g))
    if leaf in ("input_max", "output_max"):
        return 4.0 + torch.rand(shape, generator=g)
    if leaf in ("scale", "per_expert_scale") and parent == "router":
        return 1.0 + 0.1 * randn(g, shape)
    if leaf == "bias":
        return 0.1 * randn(g, shape)
    if parent.endswith("embed_tokens") or parent.endswith("embed_tokens_per_layer"):
        # rows with std c/sqrt(dim) (so the sqrt(dim)-scaled embedding is O(1)), times a
        # log-normal per-row factor so that some rows have a clearly larger norm.
        # Main table: c = 0.5, so the (tied) current-token direction does not dominate the
        # final hidden state (with c = 1 greedy decoding just repeats the input token).
        dim = shape[1]
        c = 0.5 if parent.endswith("embed_tokens") else 1.0
        row = torch.exp(0.25 * randn(g, (shape[0], 1)))
        return c * randn(g, shape) * row / math.sqrt(dim)
    if parent in ("q_norm", "k_norm"):
        # gain 0.5: attention uses scaling 1.0, so with q/k norm weights ~1 the scores have
        # std ~sqrt(head_dim) ~ 6 and the random net becomes chaotic (bf16-vs-fp32 logits
        # differ by up to 6). With 0.5 the score std is ~1.4 (sliding) / ~2 (full).
        return QK_NORM_GAIN * (1.0 + 0.1 * randn(g, shape)) - NORM_SHIFT
    if name in ("model.norm.weight", "model.language_model.norm.weight"):
        # final norm: gain 4 so that logits reach the region where the soft-cap (30) matters
        return FINAL_NORM_GAIN * (1.0 + 0.1 * randn(g, shape)) - NORM_SHIFT
    if leaf in ("gate_up_proj", "down_proj") and parent == "experts":
        return randn(g, shape) / math.sqrt(shape[-1])  # [E, out, in]
    if len(shape) == 1 and ("norm" in parent or "layernorm" in parent or "ln" in parent):
        return 1.0 + 0.1 * randn(g, shape) - NORM_SHIFT
    if len(shape) == 2:
        return randn(g, shape) / math.sqrt(shape[1])
    if len(shape) >= 3 and "conv" in name:
        fan_in = int(np.prod(shape[1:]))
        return randn(g, shape) / math.sqrt(fan_in)
    if len(shape) == 0:
        return 1.0 + 0.1 * randn(g, (1,)).reshape(())
    # anything else (vision position tables, audio per_dim_scale, ...)
    return 0.3 * randn(g, shape)


@torch.no_grad()
def init_weights(model, seed):
    seen = set()
    names = []
    for name, t in model.state_dict(keep_vars=True).items():
        if t.data_ptr() in seen:  # tied lm_head
            continue
        seen.add(t.data_ptr())
        t.copy_(draw(name, t, tensor_gen(seed, name)).to(t.dtype))
        names.append(name)
    return names


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------

def text_config_of(model_or_cfg):
    cfg = model_or_cfg.config if hasattr(model_or_cfg, "config") else model_or_cfg
    return cfg.get_text_config()


def text_prefix(model):
    return "model.language_model." if hasattr(model.model, "language_model") else "model."


def embed_weight(model):
    return model.get_input_embeddings().weight


def kv_sharing_info(tc):
    L = tc.num_hidden_layers
    first_shared = L - (getattr(tc, "num_kv_shared_layers", 0) or 0)
    prev = tc.layer_types[:first_shared]
    src = {}
    for i in range(first_shared, L):
        lt = tc.layer_types[i]
        src[i] = len(prev) - 1 - prev[::-1].index(lt)
    return first_shared, src


PROMPT_KINDS = ("short", "long", "max-norm")


def make_prompt(model, seed, kind, cand):
    """Candidate `cand` of prompt `kind`. All prompts start with BOS (2); no BOS is added by HF."""
    g = torch.Generator().manual_seed(seed * 100_000 + kind * 10_000 + cand)
    if kind == 0:  # short
        return [2] + torch.randint(3, VOCAB, (4,), generator=g).tolist()
    if kind == 1:  # long: 32 tokens = 4 x sliding window
        return [2] + torch.randint(3, VOCAB, (31,), generator=g).tolist()
    # max-norm: the 19 tokens (ids > 2) whose embedding rows have the largest L2 norm;
    # candidate 0 in descending-norm order, later candidates are permutations of them
    norms = embed_weight(model).detach().float().norm(dim=1)
    order = [int(i) for i in torch.argsort(norms, descending=True, stable=True) if int(i) > 2][:19]
    if cand:
        order = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
    return [2] + order


def bf16_ulp(x):
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def margin_ok(top, margin, dtype):
    """Greedy steps whose top1-top2 gap is tiny are fragile for an engine whose arithmetic
    differs slightly from PyTorch's; require a safety gap (fp32: 0.01, bf16: 2 ulp)."""
    if dtype == torch.float32:
        return margin >= 0.01
    return margin >= 2 * bf16_ulp(top)


def rewrite_config_release_style(path, tc):
    """Make config.json look like Google's release configs: `global_head_dim` +
    `num_global_key_value_heads` keys instead of transformers-5.17's `per_layer_config`."""
    with open(path) as f:
        cfg = json.load(f)
    t = cfg["text_config"] if "text_config" in cfg else cfg
    plc = t.pop("per_layer_config")
    full = [i for i, lt in enumerate(tc.layer_types) if lt == F]
    assert sorted(int(k) for k in plc) == full, plc
    vals = list(plc.values())
    assert all(v == vals[0] for v in vals)
    t["global_head_dim"] = vals[0]["head_dim"]
    t["num_global_key_value_heads"] = vals[0].get("num_key_value_heads", None)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def inject_shared_kv_tensors(out_dir, model, seed):
    """Real Gemma 4 E2B/E4B checkpoints contain k_proj/v_proj/k_norm for the KV-shared layers
    (transformers does not even create those modules and ignores them on load). HF's own
    save_pretrained omits them, so add random ones here (poison: an engine must ignore them)."""
    tc = text_config_of(model)
    first_shared, _ = kv_sharing_info(tc)
    prefix = text_prefix(model)
    path = os.path.join(out_dir, "model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    added = []
    for i in range(first_shared, tc.num_hidden_layers):
        plc = tc.per_layer_config[i]
        hd, nkv = plc.head_dim, plc.num_key_value_heads
        names = {f"{prefix}layers.{i}.self_attn.k_proj.weight": (nkv * hd, tc.hidden_size),
                 f"{prefix}layers.{i}.self_attn.k_norm.weight": (hd,)}
        if not (tc.attention_k_eq_v and tc.layer_types[i] == F):
            names[f"{prefix}layers.{i}.self_attn.v_proj.weight"] = (nkv * hd, tc.hidden_size)
        for n, shape in names.items():
            assert n not in tensors
            t = torch.zeros(shape)
            tensors[n] = draw(n, t, tensor_gen(seed, n)).to(embed_weight(model).dtype)
            added.append(n)
    save_file(dict(sorted(tensors.items())), path, metadata=meta)
    return added


def list_checkpoint(out_dir):
    names = {}
    for fn in sorted(os.listdir(out_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, fn), "pt") as f:
                for k in f.keys():
                    names[k] = (fn, tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
    return names


@torch.no_grad()
def greedy_manual(model, prompt, n):
    """Argmax loop without KV cache (full re-forward each step); also used to cross-check
    generate(). Returns tokens and, per step, (top1 logit, top1-top2 gap)."""
    ids = list(prompt)
    out, gaps = [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        gaps.append((float(top2.values[0]), float(top2.values[0] - top2.values[1])))
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        ids.append(nxt)
    return out, gaps


# ----------------------------------------------------------------------------------------
# main per-fixture routine
# ----------------------------------------------------------------------------------------

def build_fixture(spec, cache):
    name = spec["name"]
    dtype = spec.get("dtype", torch.float32)
    dtype_name = str(dtype).replace("torch.", "")
    out_dir = os.path.join(FIXTURES, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)

    global NORM_SHIFT
    NORM_SHIFT = 1.0 if spec.get("norm_shift") else 0.0
    config = spec["config"]()
    cls = spec["cls"]
    torch.manual_seed(spec["seed"])
    model = cls(config).eval()
    if "weights_from" in spec:
        src = cache[spec["weights_from"]]
        missing, unexpected = model.load_state_dict(src, strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    else:
        init_weights(model, spec["seed"])
        cache[name] = {k: v.clone() for k, v in model.state_dict().items()}
    model = model.to(dtype)
    tc = text_config_of(model)

    # --- save -----------------------------------------------------------------------------
    save_kwargs = {}
    if spec.get("shards"):
        total = sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if k != "lm_head.weight")
        save_kwargs["max_shard_size"] = int(total * 0.6)
    model.save_pretrained(out_dir, **save_kwargs)
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)  # not needed; keeps the fixture minimal
    added = inject_shared_kv_tensors(out_dir, model, spec["seed"]) if spec.get("inject_shared_kv") else []
    if spec.get("release_style"):
        rewrite_config_release_style(os.path.join(out_dir, "config.json"), tc)

    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o644)  # safetensors writes 0600
    st_files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    if spec.get("shards"):
        n = spec["shards"]
        assert st_files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], st_files
        assert os.path.exists(os.path.join(out_dir, "model.safetensors.index.json"))
    else:
        assert st_files == ["model.safetensors"], st_files

    # --- reload exactly as an outside user would, and check it reproduces the model ---------
    load_kwargs = dict(dtype=dtype, attn_implementation="eager")
    if getattr(tc, "enable_moe_block", False):
        load_kwargs["experts_implementation"] = "eager"
    ref = cls.from_pretrained(out_dir, **load_kwargs).eval()
    # the (possibly rewritten) config.json must describe exactly the same per-layer geometry
    assert ref.config.get_text_config().layer_types == tc.layer_types
    for i in range(tc.num_hidden_layers):
        a, b = ref.config.get_text_config().per_layer_config[i], tc.per_layer_config[i]
        assert (a.head_dim, a.num_key_value_heads) == (b.head_dim, b.num_key_value_heads), i
    sd_mem = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, sd_mem[k]), f"reload mismatch {k}"
    assert ref.dtype == dtype
    assert ref.config._attn_implementation == "eager"
    ckpt = list_checkpoint(out_dir)
    prefix = text_prefix(ref)
    assert not any(k.startswith("lm_head") for k in ckpt), "tied lm_head should not be stored"
    # no tensor left at a constant init value
    for k, (fn, shape, _) in ckpt.items():
        if int(np.prod(shape)) > 1:
            with safe_open(os.path.join(out_dir, fn), "pt") as f:
                t = f.get_tensor(k).float()
            assert float(t.std()) > 1e-3, f"degenerate tensor {k}"

    # --- reference outputs -----------------------------------------------------------------
    gcfg = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY,
        eos_token_id=None, pad_token_id=0, bos_token_id=2,
    )
    ref.generation_config = gcfg
    entries, notes = [], []
    with torch.no_grad():
        for i in range(len(PROMPT_KINDS)):
            # pick the first candidate prompt whose greedy continuation has no near-tie,
            # at least 3 distinct tokens and no pad (0) / eos (1)
            for cand in range(300):
                p = make_prompt(ref, spec["seed"], i, cand)
                man, gaps = greedy_manual(ref, p, N_GREEDY)
                if (len(set(man)) >= 3 and not set(man) & {0, 1}  # varied, never pad/eos
                        and all(margin_ok(t, m, dtype) for t, m in gaps)):
                    break
            else:
                raise AssertionError(f"{name}: no robust prompt of kind {PROMPT_KINDS[i]}")
            logits = ref(torch.tensor([p]), use_cache=False).logits[0]
            assert logits.dtype == dtype, logits.dtype  # HF returns logits in model dtype
            lf = logits.float().numpy()
            assert lf.shape == (len(p), VOCAB)
            assert np.isfinite(lf).all(), f"{name}: non-finite logits"
            assert lf.std() > 0.5, f"{name}: logits too small (std {lf.std()})"
            fn = f"logits_{i}.bin"
            lf.astype("<f4").tofile(os.path.join(out_dir, fn))

            # eos_token_id=None in the GenerationConfig: no stopping criterion on eos and no
            # MinNewTokensLengthLogitsProcessor (it needs an eos id), i.e. plain argmax x 10.
            gen = ref.generate(torch.tensor([p]), generation_config=gcfg)
            new = gen[0, len(p):].tolist()
            assert len(new) == N_GREEDY, new
            assert len(set(new)) > 1, f"{name}: greedy output degenerate {new}"
            assert man == new, f"{name} prompt {i}: generate() {new} != no-cache argmax loop {man}"
            # first generated token must be argmax of the saved last-position logits
            assert new[0] == int(np.argmax(lf[-1])), (new[0], int(np.argmax(lf[-1])))
            entries.append(dict(tokens=p, logits_file=fn, greedy=new))
            notes.append(
                f"prompt {i} ({PROMPT_KINDS[i]}, cand {cand}): {len(p)} tok, logits std {lf.std():.3f} "
                f"max|.| {np.abs(lf).max():.2f}, greedy {new}, min gap {min(m for _, m in gaps):.4f}"
            )

    ref_json = {"transformers_version": transformers.__version__, "torch_dtype": dtype_name,
                "vocab_size": VOCAB, "prompts": entries}
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref_json, f)
        f.write("\n")

    if spec.get("tokenizer"):
        write_tiny_tokenizer(out_dir, *spec["tokenizer"])

    # --- summary --------------------------------------------------------------------------
    first_shared, src = kv_sharing_info(tc)
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"== {name}: {cls.__name__} ({tc.model_type}, {dtype_name}), prefix '{prefix}', {size/1024:.0f} KiB")
    print(f"   H={tc.hidden_size} L={tc.num_hidden_layers} nh={tc.num_attention_heads} W={tc.sliding_window} "
          f"I={tc.intermediate_size} k_eq_v={getattr(tc, 'attention_k_eq_v', None)} "
          f"PLE={getattr(tc, 'hidden_size_per_layer_input', None)} moe={getattr(tc, 'enable_moe_block', None)}")
    print("   layers: " + " ".join(
        f"{i}:{'F' if lt == F else 'S'}(hd{tc.per_layer_config[i].head_dim},kv{tc.per_layer_config[i].num_key_value_heads}"
        f",I{ref.model.language_model.layers[i].mlp.intermediate_size if prefix.endswith('language_model.') else ref.model.layers[i].mlp.intermediate_size})"
        for i, lt in enumerate(tc.layer_types)))
    if src:
        print(f"   KV-shared layers (first_shared={first_shared}): " + ", ".join(f"{i}<-{s}" for i, s in src.items()))
    if added:
        print(f"   injected {len(added)} unused shared-layer tensors, e.g. {added[0]}")
    print(f"   files: {', '.join(sorted(os.listdir(out_dir)))}")
    for n in notes:
        print("   " + n)
    return size


SHARED = os.path.join(REPO, "..", "shared", "data")


def write_tiny_tokenizer(out_dir, tokenizer_file, template_file):
    """The fixture's own tokenizer.json + chat_template.jinja, so that -p / --chat run end to end:
    the real Gemma tokenizer cut to the model's VOCAB ids. Below 512 Gemma keeps its control
    tokens (<bos> 2, <|turn> 105 / <start_of_turn> 105, ...), all 256 <0xXX> byte tokens and a few
    merges, so the cut keeps every id meaning what it means in the real model and text falls back
    to bytes."""
    with open(os.path.join(SHARED, "tokenizer", tokenizer_file)) as f:
        j = json.load(f)
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i < VOCAB}
    merges = []
    for m in j["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    j["model"]["vocab"] = vocab
    j["model"]["merges"] = merges
    j["added_tokens"] = [t for t in j["added_tokens"] if t["id"] < VOCAB]
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(j, f, ensure_ascii=False)
    shutil.copyfile(os.path.join(SHARED, "chat-templates", template_file),
                    os.path.join(out_dir, "chat_template.jinja"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True}, f, indent=1)
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert len(tok) == VOCAB, len(tok)
    # Expected ids for the CLI's tokenize / chat path, from transformers itself: the rendered chat
    # is tokenized without adding special tokens, as apply_chat_template(tokenize=True) does.
    with open(os.path.join(out_dir, "chat_template.jinja")) as f:
        tok.chat_template = f.read()
    texts = ["Hello world", "  two  spaces\nand a newline\n\n", "emoji 😀 and ünïcödé"]
    convs = [
        [{"role": "user", "content": "Hi there!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]
    cases = {"text": [{"text": t, "ids": tok.encode(t, add_special_tokens=False),
                       "decoded": tok.decode(tok.encode(t, add_special_tokens=False))} for t in texts], "chat": []}
    for msgs in convs:
        for thinking in (False, True):
            kw = dict(add_generation_prompt=True, enable_thinking=thinking)
            rendered = tok.apply_chat_template(msgs, tokenize=False, **kw)
            cases["chat"].append({"messages": msgs, "enable_thinking": thinking, "rendered": rendered,
                                  "ids": tok.encode(rendered, add_special_tokens=False)})
    with open(os.path.join(out_dir, "tokenize_cases.json"), "w") as f:
        json.dump(cases, f, ensure_ascii=False)
    print(f"   tokenizer: {tokenizer_file} cut to {len(vocab)} ids, {len(merges)} merges; {template_file}")


def main():
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        print(f"WARNING: transformers {transformers.__version__} != {EXPECTED_TRANSFORMERS}", file=sys.stderr)
    os.makedirs(FIXTURES, exist_ok=True)
    cache = {}
    total = 0
    only = set(sys.argv[1:])  # optional fixture names; dependencies (weights_from) are built too
    needed = set(only)
    for spec in FIXTURE_SPECS:
        if spec["name"] in only and "weights_from" in spec:
            needed.add(spec["weights_from"])
    for spec in FIXTURE_SPECS:
        if not only or spec["name"] in needed:
            total += build_fixture(spec, cache)
    print(f"total fixture size: {total/1024/1024:.2f} MiB in {FIXTURES}")
    # Cross-check every fixture with the independent float64 NumPy forward; it also writes the
    # exact_logits_*.bin references of the bf16 fixtures.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import numpy_forward
    numpy_forward.main()


if __name__ == "__main__":
    main()
