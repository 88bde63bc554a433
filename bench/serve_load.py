#!/usr/bin/env python3
"""Load test for an OpenAI-compatible server: `markbase serve`, or llama.cpp's `llama-server` for the side by side.

N concurrent streaming clients for T seconds (both bounded; loopback servers only) send chat and completion
requests with mixed prompt lengths that share a few system prompts (so a prefix cache matters); some clients
close their stream mid-reply. Then it checks and reports:

  no 5xx          no response with a 5xx status (and no other unexpected failure: 4xx, reset, truncated stream)
  alive           the server process lives to the end (with --launch or --pid) and /health answers afterwards
  streams         every chunk of a stream carries that stream's id, and no two streams share one
  replay          up to --replay finished requests, sent again one at a time after the load, give the same
                  text (greedy or seeded): with batch invariance a request's tokens cannot depend on what ran
                  beside it, so a token from another stream, a stale KV page or a cache mix-up shows here
  idle            the server's running/waiting gauges in /metrics return to 0 (disconnects freed their slots)
  rss flat        the server's VmRSS after warm-up grows by no more than the tolerance (a KV pool whose pages
                  are touched as first used grows until full: size it, e.g. --kv-mem, to fill within the warm-up)
  clean exit      with --launch: SIGTERM ends the server with exit status 0
and throughput (generated tokens/s over the load phase), p50/p90/p99 time to first token and inter-token latency
(gaps between content chunks of a stream).

  bench/serve_load.py --base-url http://127.0.0.1:8080 --pid 1234 --clients 64 --duration 300
  bench/serve_load.py --launch "build/markbase serve -m MODEL --port 8080" --clients 16 --duration 60 --json out.json
  bench/serve_load.py --base-url ... --prefix-probe 5 --duration 0    # repeated system prompt: cold vs warm TTFT

Exit status: 0 when every check passed, 1 when one failed, 2 when the test could not run (bad arguments, the
server did not come up).
"""
import argparse
import asyncio
import ipaddress
import json
import math
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse

import httpx

MAX_CLIENTS = 1024
MAX_DURATION_S = 3600

# Plain words for prompts: the text only has to tokenize to a predictable length and differ between requests.
WORDS = ("the of and to in is was for on that with as by at from his her which an be this are or had not but "
         "all were they one have has their there been if more when will would who so no time city river house "
         "market light winter summer garden window paper stone music water bridge forest signal engine number "
         "table letter morning evening question answer story island mountain valley harbor train station road "
         "planet orbit cloud storm field school teacher student library museum painting colour shadow voice "
         "memory dream journey friend family village castle tower ocean desert silver golden ancient modern "
         "quiet bright simple careful sudden gentle strong narrow distant hidden open early late small large").split()


def quantile(values, q):
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values, scale=1.0):
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values) * scale, "p50": quantile(values, 0.5) * scale,
            "p90": quantile(values, 0.9) * scale, "p99": quantile(values, 0.99) * scale, "max": max(values) * scale}


def is_loopback(url):
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Workload:
    """A reproducible stream of request specs: which endpoint, the body, when the client hangs up."""

    def __init__(self, args, model):
        self.args = args
        self.model = model
        self.rng = random.Random(args.seed)
        self.count = 0
        lo, hi = args.system_words
        k = args.system_prompts
        # Lengths spread evenly over the range so short and long shared prefixes both occur.
        self.system_prompts = []
        for i in range(k):
            n = lo if k == 1 else round(lo + (hi - lo) * i / (k - 1))
            self.system_prompts.append(f"System prompt {i}. You are assistant number {i}. " +
                                       words(random.Random(f"system-{args.seed}-{i}"), n))

    def next(self):
        a, rng = self.args, self.rng
        self.count += 1
        nonce = f"{a.seed:x}-{self.count:06d}-{rng.getrandbits(32):08x}"
        system = rng.choice(self.system_prompts)
        lo, hi = a.user_words
        n_user = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))  # log-uniform: many short, some long
        user = f"Request {nonce}. " + words(rng, n_user)
        max_tokens = rng.randint(*a.max_tokens)
        seeded = a.sampling == "seeded" or (a.sampling == "mixed" and rng.random() < 0.5)
        chat = rng.random() >= a.completions_fraction
        body = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        if seeded:
            body.update(temperature=0.8, top_p=0.95, seed=rng.getrandbits(31))
        else:
            body["temperature"] = 0.0
        if chat:
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = system + "\n\n" + user + "\n"
            path = "/v1/completions"
        body.update(a.extra_body)
        disconnect_after = None
        if rng.random() < a.disconnect_fraction:
            disconnect_after = rng.randint(1, max(1, max_tokens // 2))  # content chunks before hanging up
        return {"nonce": nonce, "path": path, "body": body, "disconnect_after": disconnect_after,
                "session": f"session-{self.system_prompts.index(system)}-{self.count % 8}"}


class Results:
    def __init__(self):
        self.requests = []           # one dict per finished attempt (see run_stream)
        self.stream_ids = {}         # stream id -> nonce of the request that received it
        self.id_errors = []          # chunk ids that do not belong to their stream
        self.rss = []                # (seconds since start, bytes)
        self.alive_failures = []


def parse_sse_line(line):
    """The JSON of a `data:` line, "[DONE]", or None for other lines (comments, event names, blanks)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    return json.loads(data)


def chunk_text(obj):
    """The generated text a stream chunk carries (content, reasoning, or completion text) and its finish."""
    text, finish = "", None
    for ch in obj.get("choices") or []:
        delta = ch.get("delta")
        if delta is not None:
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text += ch.get("text") or ""
        finish = ch.get("finish_reason") or finish
    return text, finish


async def run_stream(client, spec, results, record=True, hang_up=True):
    """Sends one streaming request and reads it to the end (or hangs up as the spec says)."""
    r = {"nonce": spec["nonce"], "path": spec["path"], "status": None, "error": None, "text": "", "finish": None,
         "ttft": None, "t_first": None, "t_last": None, "gaps": [], "chunks": 0, "tokens": None, "disconnected": False, "cached_tokens": None,
         "t_start": time.monotonic()}
    headers = {"X-Session-ID": spec["session"]}
    last = None
    try:
        async with client.stream("POST", spec["path"], json=spec["body"], headers=headers) as resp:
            r["status"] = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread())[:500].decode("utf-8", "replace")
                r["error"] = f"HTTP {resp.status_code}: {body}"
                r["retry_after"] = resp.headers.get("retry-after")
            else:
                stream_id = None
                done = False
                async for line in resp.aiter_lines():
                    obj = parse_sse_line(line)
                    if obj is None:
                        continue
                    if obj == "[DONE]":
                        done = True
                        break
                    if "error" in obj:
                        r["error"] = "error event: " + json.dumps(obj["error"])[:300]
                        break
                    cid = obj.get("id")
                    if stream_id is None:
                        stream_id = cid
                        if record and cid is not None:
                            other = results.stream_ids.setdefault(cid, spec["nonce"])
                            if other != spec["nonce"]:
                                results.id_errors.append(f"stream id {cid} of {spec['nonce']} also went to {other}")
                    elif cid != stream_id:
                        results.id_errors.append(f"{spec['nonce']}: chunk id {cid} in stream {stream_id}")
                    if obj.get("usage"):
                        u = obj["usage"]
                        r["tokens"] = u.get("completion_tokens")
                        r["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                    text, finish = chunk_text(obj)
                    now = time.monotonic()
                    if text:
                        if r["ttft"] is None:
                            r["ttft"] = now - r["t_start"]
                            r["t_first"] = now
                        else:
                            r["gaps"].append(now - last)
                        last = now
                        r["t_last"] = now
                        r["chunks"] += 1
                        r["text"] += text
                    if finish:
                        r["finish"] = finish
                    if hang_up and spec["disconnect_after"] is not None and r["chunks"] >= spec["disconnect_after"]:
                        r["disconnected"] = True
                        break
                if not done and not r["disconnected"] and r["error"] is None:
                    r["error"] = "stream ended without [DONE]"
    except httpx.TimeoutException as e:
        r["error"] = f"timeout ({type(e).__name__})"
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["t_end"] = time.monotonic()
    if r["tokens"] is None or r["disconnected"]:
        r["tokens"] = r["chunks"]  # no usage (hung up first, or not sent): one chunk is at least one token
    if record:
        results.requests.append(r)
    return r


async def client_loop(client, workload, deadline, budget, results):
    while time.monotonic() < deadline and budget[0] > 0 and not results.alive_failures:
        budget[0] -= 1
        spec = workload.next()
        r = await run_stream(client, spec, results)
        r["spec"] = spec
        if r["status"] is None:  # no answer at all: do not spin on a server that is gone
            await asyncio.sleep(0.2)
        if r["status"] == 429:  # a full queue is the server working as designed: wait as it asks
            try:
                await asyncio.sleep(min(float(r.get("retry_after") or 1), 10))
            except ValueError:
                await asyncio.sleep(1)


def read_rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_alive(pid, proc):
    if proc is not None:
        return proc.poll() is None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def monitor(pid, proc, t0, stop, results, interval):
    while not stop.is_set():
        if pid is not None:
            if not process_alive(pid, proc):
                results.alive_failures.append(f"server process {pid} gone at {time.monotonic() - t0:.1f} s")
                return
            rss = read_rss(pid)
            if rss is not None:
                results.rss.append((time.monotonic() - t0, rss))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


# Gauges that say requests are still in the engine: markbase's and llama-server's (llama-server --metrics).
BUSY_GAUGES = re.compile(r"^(markbase_num_requests_(?:running|waiting)|llamacpp:requests_(?:processing|deferred))"
                         r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


async def busy_gauges(client):
    try:
        resp = await client.get("/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    found = {m.group(1): float(m.group(2)) for m in BUSY_GAUGES.finditer(resp.text)}
    return found or None


async def wait_idle(client, seconds):
    """The busy gauges once they all read 0 (or as they are when `seconds` pass); None without /metrics."""
    deadline = time.monotonic() + seconds
    g = await busy_gauges(client)
    while g is not None and any(v > 0 for v in g.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        g = await busy_gauges(client)
    return g


def rss_verdict(samples, warmup_s, tol_bytes, tol_frac):
    after = [(t, b) for t, b in samples if t >= warmup_s]
    if len(after) < 6:
        return {"checked": False, "reason": f"{len(after)} samples after the {warmup_s:.0f} s warm-up (need 6)"}
    w = max(2, len(after) // 5)
    first = statistics.median(b for _, b in after[:w])
    last = statistics.median(b for _, b in after[-w:])
    ts = [t for t, _ in after]
    bs = [b for _, b in after]
    tm, bm = statistics.fmean(ts), statistics.fmean(bs)
    var = sum((t - tm) ** 2 for t in ts)
    slope = sum((t - tm) * (b - bm) for t, b in after) / var if var > 0 else 0.0
    allowed = max(tol_bytes, tol_frac * first)
    return {"checked": True, "warmup_s": warmup_s, "samples": len(after), "first_mib": first / 2**20,
            "last_mib": last / 2**20, "growth_mib": (last - first) / 2**20, "allowed_mib": allowed / 2**20,
            "peak_mib": max(bs) / 2**20, "slope_mib_per_min": slope * 60 / 2**20, "flat": last - first <= allowed}


async def replay(client, done, n, rng):
    """Sends up to n finished requests again, one at a time, and compares the text."""
    picks = rng.sample(done, min(n, len(done)))
    mismatches = []
    for r in picks:
        again = await run_stream(client, r["spec"], Results(), record=False, hang_up=False)
        if again["error"]:
            mismatches.append({"nonce": r["nonce"], "error": again["error"]})
        elif again["text"] != r["text"] or again["finish"] != r["finish"]:
            a, b = r["text"], again["text"]
            at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            mismatches.append({"nonce": r["nonce"], "path": r["path"], "first_difference_at_char": at,
                               "under_load": a[max(0, at - 20):at + 40], "alone": b[max(0, at - 20):at + 40],
                               "finish": [r["finish"], again["finish"]]})
    return len(picks), mismatches


async def prefix_probe(client, model, args, rng):
    """A repeated system prompt's time to first token: each round sends a system prompt no request used before
    (cold: nothing cached can match) and then the same system prompt with another question (warm). Non-streaming
    /v1/completions with max_tokens 1, so the latency is the prefill plus one token, and the prompt is the same
    text on every server (no chat template in between)."""
    cold, warm, cached = [], [], []
    for i in range(args.prefix_probe):
        system = f"Probe {rng.getrandbits(48):012x}. " + words(rng, args.probe_system_words)
        for kind, out in (("cold", cold), ("warm", warm)):
            body = {"model": model, "max_tokens": 1, "temperature": 0.0, "stream": False,
                    "prompt": system + f"\n\nQuestion {kind} {i}: " + words(rng, 12) + "\n"}
            body.update(args.extra_body)
            t = time.monotonic()
            resp = await client.post("/v1/completions", json=body)
            dt = time.monotonic() - t
            if resp.status_code != 200:
                raise RuntimeError(f"prefix probe: HTTP {resp.status_code}: {resp.text[:300]}")
            out.append(dt)
            if kind == "warm":
                details = (resp.json().get("usage") or {}).get("prompt_tokens_details") or {}
                cached.append(details.get("cached_tokens"))
    c, w = statistics.median(cold), statistics.median(warm)
    return {"rounds": args.prefix_probe, "system_words": args.probe_system_words, "cold_s": cold, "warm_s": warm,
            "cold_median_s": c, "warm_median_s": w, "warm_over_cold": w / c if c > 0 else None,
            "warm_cached_tokens": cached}


async def wait_ready(client, proc, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"the server exited with status {proc.returncode} before it was ready"
        try:
            resp = await client.get("/health", timeout=2)
            if resp.status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    return f"/health did not answer 200 within {seconds} s"


async def pick_model(client, name):
    if name:
        return name
    try:
        resp = await client.get("/v1/models", timeout=10)
        data = resp.json().get("data") or []
        if data:
            return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return "default"


def launch(cmd, log_path):
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen(shlex.split(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc, seconds):
    """SIGTERM, then the exit status (None when it had to be killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


async def main_async(args):
    report = {"args": {k: v for k, v in vars(args).items()}, "checks": {}}
    proc = None
    pid = args.pid
    if args.launch:
        proc = launch(args.launch, args.server_log)
        pid = proc.pid
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout,
                                     headers=headers) as client:
            err = await wait_ready(client, proc, args.ready_timeout)
            if err:
                report["fatal"] = err
                report["passed"] = False
                return report, 2
            model = await pick_model(client, args.model)
            report["model"] = model
            rng = random.Random(args.seed ^ 0x5EED)
            if args.prefix_probe:
                report["prefix_probe"] = await prefix_probe(client, model, args, rng)
            results = Results()
            if args.duration > 0:
                await load_phase(client, model, args, pid, proc, results, report)
                report["replay"] = {}
                done = [r for r in results.requests
                        if not r["error"] and not r["disconnected"] and r["finish"] in ("stop", "length")]
                if args.replay and not results.alive_failures:
                    n, mism = await replay(client, done, args.replay, rng)
                    report["replay"] = {"replayed": n, "mismatches": mism}
                    if args.expect_batch_invariance:
                        report["checks"]["replay"] = {"ok": n > 0 and not mism,
                                                      "detail": f"{len(mism)} of {n} differ when sent alone"}
                    else:
                        report["checks"]["replay"] = {"ok": True, "informational": True,
                                                      "detail": f"{len(mism)} of {n} differ when sent alone "
                                                                "(batch invariance not expected)"}
            try:
                health = (await client.get("/health", timeout=10)).status_code
            except httpx.HTTPError as e:
                health = f"{type(e).__name__}"
            alive = pid is None or process_alive(pid, proc)
            report["checks"]["alive"] = {
                "ok": health == 200 and alive and not results.alive_failures,
                "detail": f"/health {health}; process " + ("not watched (no --pid)" if pid is None else
                                                           "alive" if alive else "gone") +
                          "".join("; " + f for f in results.alive_failures)}
    finally:
        if proc is not None:
            code = stop_server(proc, args.stop_timeout)
            report["server_exit_status"] = code
            if code != 0 and args.server_log:
                with open(args.server_log, "rb") as f:
                    report["server_log_tail"] = f.read()[-3000:].decode("utf-8", "replace")
            if args.expect_clean_exit:
                report["checks"]["clean_exit"] = {"ok": code == 0,
                                                  "detail": f"exit status after SIGTERM: {code}"
                                                            + (" (killed after the timeout)" if code is None else "")}
    failed = [k for k, v in report["checks"].items() if not v["ok"]]
    report["passed"] = not failed
    return report, (1 if failed else 0)


async def load_phase(client, model, args, pid, proc, results, report):
    workload = Workload(args, model)
    t0 = time.monotonic()
    stop = asyncio.Event()
    mon = asyncio.create_task(monitor(pid, proc, t0, stop, results, args.sample_interval))
    deadline = t0 + args.duration
    budget = [args.max_requests]
    # One connection pool per client, as separate users would have; started over the first second.
    clients = []
    for i in range(args.clients):
        clients.append(httpx.AsyncClient(base_url=args.base_url, timeout=client.timeout, headers=client.headers))

    async def start(i, c):
        await asyncio.sleep(i / max(1, args.clients))
        await client_loop(c, workload, deadline, budget, results)

    try:
        await asyncio.gather(*(start(i, c) for i, c in enumerate(clients)))
    finally:
        for c in clients:
            await c.aclose()
    t_end = time.monotonic()
    report["idle_gauges"] = await wait_idle(client, args.idle_timeout)
    stop.set()
    await mon
    reqs = results.requests
    wall = t_end - t0
    ok = [r for r in reqs if not r["error"]]
    s5 = [r for r in reqs if isinstance(r["status"], int) and r["status"] >= 500]
    s429 = [r for r in reqs if r["status"] == 429]
    other = [r for r in reqs if r["error"] and r not in s5 and r not in s429]
    tokens = sum(r["tokens"] or 0 for r in ok)
    report["load"] = {
        "wall_s": wall, "requests": len(reqs), "completed": sum(1 for r in ok if not r["disconnected"]),
        "disconnected": sum(1 for r in ok if r["disconnected"]), "http_5xx": len(s5), "http_429": len(s429),
        "other_failures": len(other), "generated_tokens": tokens, "throughput_tok_s": tokens / wall if wall else 0,
        "requests_per_s": len(reqs) / wall if wall else 0,
        "ttft_s": summary([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": summary([g for r in ok for g in r["gaps"]]),
        # Per request, (last chunk - first chunk) / (tokens - 1): the decode pace a client sees on average, which
        # the gaps above cannot show when a server (or a busy client) delivers several chunks at once.
        "tpot_s": summary([(r["t_last"] - r["t_first"]) / (r["tokens"] - 1) for r in ok
                           if r["t_first"] is not None and (r["tokens"] or 0) > 1 and r["t_last"] > r["t_first"]]),
        "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "failures": [f"{r['nonce']} {r['path']}: {r['error']}" for r in (s5 + other)][:20],
    }
    report["checks"]["no_5xx"] = {"ok": not s5, "detail": f"{len(s5)} responses with status >= 500"}
    report["checks"]["no_failures"] = {
        "ok": not other and len(ok) > 0,
        "detail": f"{len(other)} other failures (4xx, transport errors, timeouts, truncated streams); "
                  f"{len(ok)} requests succeeded"}
    report["checks"]["streams"] = {"ok": not results.id_errors,
                                   "detail": f"{len(results.id_errors)} chunks with another stream's id"
                                             + "".join("; " + e for e in results.id_errors[:5])}
    g = report["idle_gauges"]
    if g is not None:
        report["checks"]["idle"] = {"ok": all(v == 0 for v in g.values()),
                                    "detail": ", ".join(f"{k}={v:g}" for k, v in g.items())}
    if pid is not None:
        warmup = args.warmup if args.warmup is not None else min(30.0, 0.25 * args.duration)
        v = rss_verdict(results.rss, warmup, args.rss_tolerance_mib * 2**20, args.rss_tolerance_pct / 100)
        report["rss"] = v
        report["rss_samples"] = [(round(t, 2), b) for t, b in results.rss]
        if v["checked"]:
            report["checks"]["rss_flat"] = {
                "ok": v["flat"], "detail": f"{v['first_mib']:.1f} -> {v['last_mib']:.1f} MiB after warm-up "
                                           f"(allowed +{v['allowed_mib']:.1f}; slope {v['slope_mib_per_min']:.2f} "
                                           "MiB/min)"}


def fmt_ms(s):
    return "-" if s is None else f"{s * 1000:.1f}"


def print_report(report, out):
    p = lambda *a: print(*a, file=out)  # noqa: E731
    if "fatal" in report:
        p(f"cannot run: {report['fatal']}")
        if report.get("server_log_tail"):
            p("the end of the server's log:\n" + report["server_log_tail"])
        return
    p(f"model {report.get('model')}")
    if "prefix_probe" in report:
        pp = report["prefix_probe"]
        ratio = pp["warm_over_cold"]
        p(f"prefix probe ({pp['rounds']} rounds, {pp['system_words']}-word system prompt): cold "
          f"{fmt_ms(pp['cold_median_s'])} ms, warm {fmt_ms(pp['warm_median_s'])} ms, warm/cold "
          f"{'-' if ratio is None else f'{ratio:.3f}'}; cached tokens reported {pp['warm_cached_tokens']}")
    if "load" in report:
        ld = report["load"]
        p(f"load: {ld['requests']} requests in {ld['wall_s']:.1f} s ({ld['completed']} completed, "
          f"{ld['disconnected']} hung up on purpose, {ld['http_5xx']} 5xx, {ld['http_429']} 429, "
          f"{ld['other_failures']} other failures)")
        p(f"throughput {ld['throughput_tok_s']:.1f} generated tokens/s, {ld['requests_per_s']:.2f} requests/s; "
          f"cached prompt tokens reported {ld['cached_prompt_tokens']}")
        for name, label in (("ttft_s", "TTFT"), ("itl_s", "inter-chunk"), ("tpot_s", "per token")):
            s = ld[name]
            if s["n"]:
                p(f"{label:12s} ms: p50 {fmt_ms(s['p50'])}  p90 {fmt_ms(s['p90'])}  p99 {fmt_ms(s['p99'])}  "
                  f"max {fmt_ms(s['max'])}  (n={s['n']})")
        for f in ld["failures"][:10]:
            p(f"  failure: {f}")
    for m in (report.get("replay") or {}).get("mismatches", [])[:5]:
        p(f"  replay mismatch: {json.dumps(m)[:400]}")
    if report.get("server_log_tail"):
        p("the end of the server's log:\n" + report["server_log_tail"])
    for k, v in report["checks"].items():
        p(f"{'PASS' if v['ok'] else 'FAIL'} {k}: {v['detail']}")
    p("passed" if report.get("passed") else "FAILED")


def int_range(text):
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"want MIN,MAX with 1 <= MIN <= MAX, not {text!r}")
    return lo, hi


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080", help="the server (loopback only)")
    ap.add_argument("--launch", metavar="CMD",
                    help="start this server command, wait for /health, SIGTERM it at the end")
    ap.add_argument("--server-log", help="with --launch: the server's output goes here")
    ap.add_argument("--pid", type=int, help="the server's process id, for the RSS and liveness checks")
    ap.add_argument("--api-key")
    ap.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60, help="seconds of load (0: none, e.g. only --prefix-probe)")
    ap.add_argument("--max-requests", type=int, default=100000, help="stop after this many requests")
    ap.add_argument("--system-prompts", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--system-words", type=int_range, default=(50, 400), help="MIN,MAX words of a system prompt")
    ap.add_argument("--user-words", type=int_range, default=(5, 300), help="MIN,MAX words of a user message")
    ap.add_argument("--max-tokens", type=int_range, default=(16, 128), help="MIN,MAX tokens per reply")
    ap.add_argument("--completions-fraction", type=float, default=0.25, help="share sent to /v1/completions")
    ap.add_argument("--disconnect-fraction", type=float, default=0.1, help="share of requests hung up mid-reply")
    ap.add_argument("--sampling", choices=("greedy", "seeded", "mixed"), default="mixed")
    ap.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request")
    ap.add_argument("--replay", type=int, default=32, help="finished requests sent again alone and compared")
    ap.add_argument("--no-batch-invariance", dest="expect_batch_invariance", action="store_false",
                    help="report replay differences without failing (servers whose numerics depend on the batch)")
    ap.add_argument("--prefix-probe", type=int, default=0, metavar="ROUNDS",
                    help="before the load: cold vs warm TTFT of a repeated system prompt")
    ap.add_argument("--probe-system-words", type=int, default=1000)
    ap.add_argument("--request-timeout", type=float, default=120, help="seconds without a byte before a failure")
    ap.add_argument("--ready-timeout", type=float, default=120)
    ap.add_argument("--idle-timeout", type=float, default=10, help="seconds for /metrics' busy gauges to reach 0")
    ap.add_argument("--stop-timeout", type=float, default=30)
    ap.add_argument("--no-clean-exit", dest="expect_clean_exit", action="store_false",
                    help="with --launch: do not require exit status 0 after SIGTERM")
    ap.add_argument("--sample-interval", type=float, default=0.5, help="seconds between RSS samples")
    ap.add_argument("--warmup", type=float, help="seconds before RSS must stay flat (default min(30, 25%%))")
    ap.add_argument("--rss-tolerance-mib", type=float, default=32)
    ap.add_argument("--rss-tolerance-pct", type=float, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", help="write the full report here ('-': stdout, the summary to stderr)")
    args = ap.parse_args(argv)
    if not is_loopback(args.base_url):
        ap.error(f"{args.base_url}: only loopback servers (127.0.0.0/8, ::1, localhost)")
    if not 1 <= args.clients <= MAX_CLIENTS:
        ap.error(f"--clients must be 1..{MAX_CLIENTS}")
    if not 0 <= args.duration <= MAX_DURATION_S:
        ap.error(f"--duration must be 0..{MAX_DURATION_S} seconds")
    if args.pid is not None and args.launch:
        ap.error("--pid and --launch exclude each other")
    if not isinstance(args.extra_body, dict):
        ap.error("--extra-body must be a JSON object")
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report, code = asyncio.run(main_async(args))
    to_stdout = args.json == "-"
    print_report(report, sys.stderr if to_stdout else sys.stdout)
    if args.json:
        text = json.dumps(report, indent=1, default=str)
        if to_stdout:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
