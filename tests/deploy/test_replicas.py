"""Two `markbase serve` replicas behind nginx (deploy/nginx.conf + deploy/markbase.conf), all on loopback:
requests reach both replicas, a session stays on one, and killing a replica loses no request that nginx can
retry. nginx runs unprivileged with its config, pid and logs in a temporary folder (as `nobody` when the test
runs as root).

  python3 -m pytest tests/deploy -q          # or tests/deploy/run.sh
Env: MARKBASE_BIN (default build/bin/markbase), MARKBASE_DEPLOY_MODEL (default tests/fixtures/e2b_like),
MARKBASE_REPLICA_CMD (a command with {port}, to put another OpenAI-compatible server behind nginx instead).
"""
import concurrent.futures
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
SESSIONS = [f"user-{i}" for i in range(24)]
# Per replica, requests it answered: the first of these counters in its /metrics (markbase's; the other names
# cover servers put in its place with MARKBASE_REPLICA_CMD).
REQUEST_COUNTERS = ("markbase_requests_finished_total", "llamacpp:requests_processed_total")


# Replies that keep a replica busy long enough to be killed under them (about LONG_REPLY_SECONDS each, sized
# by the replica's speed: a sanitizer build is slower): no early end of turn.
LONG_REPLY_SECONDS = 1.0
LONG_REPLY_EXTRA = {"ignore_eos": True}
# Gauges of requests a replica holds (running or queued).
BUSY_GAUGES = re.compile(r"^(markbase_num_requests_(?:running|waiting)|llamacpp:requests_(?:processing|deferred))"
                         r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, proc, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer {url} within {seconds} s")


def replica_command(port):
    template = os.environ.get("MARKBASE_REPLICA_CMD")
    if template:
        return shlex.split(template.format(port=port))
    binary = os.environ.get("MARKBASE_BIN", os.path.join(ROOT, "build", "bin", "markbase"))
    model = os.environ.get("MARKBASE_DEPLOY_MODEL", os.path.join(ROOT, "tests", "fixtures", "e2b_like"))
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"no markbase binary at {binary} (build it, or set MARKBASE_BIN)")
    return [binary, "serve", "-m", model, "--host", "127.0.0.1", "--port", str(port), "--max-seqs", "4",
            "--threads", "1"]


def nginx_config(listen, replicas):
    """deploy/markbase.conf with this test's ports: the listen address and the two upstream servers."""
    with open(os.path.join(DEPLOY, "markbase.conf")) as f:
        text = f.read()
    subs = [(r"listen 127\.0\.0\.1:8080;", f"listen 127.0.0.1:{listen};"),
            (r"server 127\.0\.0\.1:8081 ", f"server 127.0.0.1:{replicas[0]} "),
            (r"server 127\.0\.0\.1:8082 ", f"server 127.0.0.1:{replicas[1]} ")]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        assert n == 1, f"deploy/markbase.conf no longer has exactly one '{pattern}'"
    return text


class Cluster:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="markbase-deploy-")  # not under pytest's 0700 folders: nobody reads it
        os.chmod(self.dir, 0o755)
        self.ports = [free_port(), free_port()]
        self.listen = free_port()
        self.replicas = {}
        for port in self.ports:
            log = open(os.path.join(self.dir, f"replica-{port}.log"), "wb")
            self.replicas[port] = subprocess.Popen(replica_command(port), stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
        for port, proc in self.replicas.items():
            wait_http(f"http://127.0.0.1:{port}/health", proc, 120, f"replica on port {port}")
        self.start_nginx()
        self.url = f"http://127.0.0.1:{self.listen}"
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def start_nginx(self):
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        prefix = os.path.join(self.dir, "nginx")
        for sub in ("logs", "tmp"):
            os.makedirs(os.path.join(prefix, sub))
        shutil.copy(os.path.join(DEPLOY, "nginx.conf"), prefix)
        with open(os.path.join(prefix, "markbase.conf"), "w") as f:
            f.write(nginx_config(self.listen, self.ports))
        cmd = [nginx, "-p", prefix, "-c", os.path.join(prefix, "nginx.conf"), "-e", os.path.join(prefix, "logs",
               "error.log"), "-g", "daemon off;"]
        if os.geteuid() == 0:  # as a user would run it: no root, nothing written outside the prefix
            nobody = pwd.getpwnam("nobody")
            for base, dirs, files in os.walk(prefix):
                for name in [base] + [os.path.join(base, n) for n in dirs + files]:
                    os.chown(name, nobody.pw_uid, nobody.pw_gid)
            cmd = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"] + cmd
        self.nginx_prefix = prefix
        self.nginx = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir,
                                      "nginx.stderr"), "wb"), start_new_session=True)
        # /health through nginx: answered by whichever replica the (empty-bodied) request hashes to.
        wait_http(f"http://127.0.0.1:{self.listen}/health", self.nginx, 20, "nginx")

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.dir)) + ["nginx/logs/error.log", "nginx/logs/markbase_access.log"]:
            path = os.path.join(self.dir, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out.append(f"--- {name}\n" + f.read()[-4000:].decode("utf-8", "replace"))
        return "\n".join(out)

    def stop(self):
        if self.nginx.poll() is None:
            self.nginx.send_signal(signal.SIGQUIT)  # graceful: finish what is in flight
            try:
                self.nginx.wait(10)
            except subprocess.TimeoutExpired:
                self.nginx.kill()
                self.nginx.wait()
        for proc in self.replicas.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def busy(self, port):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return sum(float(v) for _, v in BUSY_GAUGES.findall(text))

    def answered(self, port):
        """Requests the replica on `port` reports having answered, from its own /metrics."""
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for name in REQUEST_COUNTERS:
            values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+([0-9.eE+]+)\s*$", text, re.M)
            if values:
                return sum(float(v) for v in values)
        raise AssertionError(f"no request counter ({', '.join(REQUEST_COUNTERS)}) in /metrics of port {port}")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def show_logs_on_failure(request, cluster):
    yield
    rep = getattr(request.node, "rep_call", None)  # set by conftest.py
    if rep is not None and rep.failed:
        print(cluster.logs())


def chat(client, model, content, session=None, user=None, system="You are a helpful assistant.", max_tokens=8,
         stream=False, extra=None):
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    body.update(extra or {})
    if user is not None:
        body["user"] = user
    headers = {"X-Session-ID": session} if session else {}
    if not stream:
        r = client.post("/v1/chat/completions", json=body, headers=headers)
        return r.status_code, r.headers.get("x-markbase-upstream", ""), r.text
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        text = "".join(r.iter_lines())
        return r.status_code, r.headers.get("x-markbase-upstream", ""), text


def replica_of(upstream):
    """The port of the replica that answered (the last one tried), from nginx's X-MarkBase-Upstream."""
    assert upstream, "no X-MarkBase-Upstream header: the request did not go through deploy/markbase.conf"
    return int(upstream.split(",")[-1].strip().rsplit(":", 1)[1])


def test_requests_reach_both_replicas(cluster):
    before = {p: cluster.answered(p) for p in cluster.ports}
    seen = {}
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        for s in SESSIONS:
            status, upstream, text = chat(client, cluster.model, f"Hello from {s}.", session=s)
            assert status == 200, text
            assert json.loads(text)["choices"][0]["message"]["role"] == "assistant"
            seen[s] = replica_of(upstream)
    counts = {p: list(seen.values()).count(p) for p in cluster.ports}
    assert all(counts.values()), f"every session went to one replica: {counts}"
    # The replicas' own counters agree with what nginx says it did.
    after = {p: cluster.answered(p) for p in cluster.ports}
    assert {p: after[p] - before[p] for p in cluster.ports} == counts
    cluster.session_replica = seen


def test_a_session_stays_on_its_replica(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        for s in SESSIONS[:8]:
            for turn in range(3):  # other messages, streamed or not: the header alone decides
                status, upstream, text = chat(client, cluster.model, f"Turn {turn} of {s}.", session=s,
                                              stream=turn == 1)
                assert status == 200, text
                assert replica_of(upstream) == cluster.session_replica[s], (s, turn, upstream)


def test_without_a_header_the_user_field_and_the_prompt_decide(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        by_user, by_prefix = {}, {}
        for i in range(12):
            user = f"account-{i % 4}"
            status, upstream, text = chat(client, cluster.model, f"Question {i}.", user=user)
            assert status == 200, text
            by_user.setdefault(user, set()).add(replica_of(upstream))
            # No header, no user: requests that share a long system prompt share a replica (its prefix cache).
            system = f"System prompt {i % 4}: " + "you answer briefly and precisely. " * 20
            status, upstream, text = chat(client, cluster.model, f"Question {i}.", system=system)
            assert status == 200, text
            by_prefix.setdefault(i % 4, set()).add(replica_of(upstream))
    assert all(len(r) == 1 for r in by_user.values()), by_user
    assert all(len(r) == 1 for r in by_prefix.values()), by_prefix


def test_streaming_load_through_nginx(cluster):
    """Many streaming clients through nginx, some hanging up mid-reply: every request answered, no mixed-up stream,
    and nothing in nginx's error log (e.g. a replica closing kept-alive connections under nginx's feet)."""
    error_log = os.path.join(cluster.nginx_prefix, "logs", "error.log")
    start = os.path.getsize(error_log)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_load.py"), "--base-url", cluster.url,
                             "--clients", "16", "--duration", os.environ.get("MARKBASE_DEPLOY_LOAD_SECONDS", "12"),
                             "--system-words", "20,200", "--user-words", "3,100", "--max-tokens", "8,64",
                             "--replay", "8", "--json", "-"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["load"]["completed"] > 0 and report["load"]["disconnected"] > 0, report["load"]
    with open(error_log) as f:
        f.seek(start)
        errors = [line for line in f if "[error]" in line or "[warn]" in line]
    assert not errors, "".join(errors[:5])


def test_a_killed_replica_loses_no_retryable_request(cluster):
    victim, survivor = cluster.ports
    victim_sessions = [s for s, p in cluster.session_replica.items() if p == victim]
    assert victim_sessions
    n = 8
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        start = time.monotonic()
        status, upstream, text = chat(client, cluster.model, "How fast?", session=victim_sessions[0], max_tokens=256,
                                      extra=LONG_REPLY_EXTRA)
        assert status == 200 and replica_of(upstream) == victim, (status, upstream, text)
        tokens_per_s = json.loads(text)["usage"]["completion_tokens"] / (time.monotonic() - start)
    long_reply = int(min(20000, max(256, tokens_per_s * LONG_REPLY_SECONDS)))

    def ask(i):
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            return chat(client, cluster.model, f"In flight {i}.", session=victim_sessions[i % len(victim_sessions)],
                        max_tokens=long_reply, extra=LONG_REPLY_EXTRA)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ask, i) for i in range(n)]
        # Kill the victim once it holds every request (running or queued), or as many as it gets to hold before
        # the first one finishes: each was accepted there, and each must come back answered.
        deadline = time.monotonic() + 20
        while cluster.busy(victim) < n and time.monotonic() < deadline and not any(f.done() for f in futures):
            time.sleep(0.01)
        held = cluster.busy(victim)
        cluster.replicas[victim].send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    assert held >= n // 2, (f"the victim held {held} of {n} requests when it was killed ({long_reply}-token "
                            f"replies): {[(st, u, t[:200]) for st, u, t in results]}")
    retried = 0
    for status, upstream, text in results:
        assert status == 200, (status, upstream, text)
        ports = [replica_of(u) for u in upstream.split(",")]
        # Answered by the victim just before it died, or retried on the survivor.
        assert ports in ([victim], [victim, survivor]), upstream
        retried += ports == [victim, survivor]
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
    assert retried >= 1, f"no request was retried: {[u for _, u, _ in results]}"
    # New requests of the victim's sessions go to the survivor.
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        for s in victim_sessions[:4]:
            status, upstream, text = chat(client, cluster.model, "After the kill.", session=s, stream=True)
            assert status == 200 and replica_of(upstream) == survivor, (status, upstream, text)
            assert text.endswith("data: [DONE]"), text[-200:]
