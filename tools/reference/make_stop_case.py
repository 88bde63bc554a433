#!/usr/bin/env python3
"""Find a prompt whose greedy continuation on tests/fixtures/e2b_like ends on a Gemma 4 stop token,
by transformers' generate(), for tests/test_runtime.cpp (Engine.StopsAtAStopToken).

Rerun:  python3 tools/reference/make_stop_case.py   (needs transformers 5.17.0, torch; CPU, seconds)
Output: tests/fixtures/e2b_like/stop_case.json
        {"stop_tokens": {piece: id}, "prompt": [ids], "greedy": [new ids, the stop token last]}

The stop tokens are what the Gemma 4 instruction-tuned checkpoints' generation_config.json lists
as eos_token_id (<eos>, <turn|>, <|tool_response>), looked up in the fixture's own tokenizer.
generate() runs with exactly those as eos_token_id and max_new_tokens=MAX_NEW; the first seeded
prompt whose continuation stops early, after at least 2 other tokens, with a top1-top2 logit gap
of at least 0.01 at every step (as make_fixtures.py requires), is written.
"""

import json
import os
import random
import sys

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "e2b_like")
STOP_PIECES = ["<eos>", "<turn|>", "<|tool_response>"]
MAX_NEW = 24


@torch.no_grad()
def main():
    torch.set_num_threads(1)
    vocab = json.load(open(os.path.join(FIXTURE, "tokenizer.json"), encoding="utf-8"))["model"]["vocab"]
    stops = {p: vocab[p] for p in STOP_PIECES}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        FIXTURE, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    size = model.config.get_text_config().vocab_size
    gcfg = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=list(stops.values()), pad_token_id=0, bos_token_id=2,
        output_logits=True, return_dict_in_generate=True,
    )
    rng = random.Random(20)
    for _ in range(2000):
        prompt = [2] + [rng.randrange(3, size) for _ in range(rng.randrange(3, 12))]
        out = model.generate(torch.tensor([prompt]), generation_config=gcfg)
        new = out.sequences[0, len(prompt):].tolist()
        if len(new) < 3 or new[-1] not in stops.values() or set(new[:-1]) & set(stops.values()):
            continue
        gaps = [float(g[0] - g[1]) for g in (torch.topk(l[0].float(), 2).values for l in out.logits)]
        if min(gaps) < 0.01:
            continue
        with open(os.path.join(FIXTURE, "stop_case.json"), "w") as f:
            json.dump({"generator": "tools/reference/make_stop_case.py", "transformers": transformers.__version__,
                       "stop_tokens": stops, "prompt": prompt, "greedy": new}, f)
            f.write("\n")
        print(f"prompt {prompt} -> {new} (min gap {min(gaps):.4f})", file=sys.stderr)
        return
    raise SystemExit("no prompt stops early")


if __name__ == "__main__":
    main()
