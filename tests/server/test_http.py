"""Raw HTTP against `markbase serve`: bodies no client library would send, disconnects, timeouts,
metrics and shutdown."""
import http.client
import json
import signal
import socket
import threading
import time

import requests

from conftest import GEMMA3, Server, wait_for

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Count from one to a hundred."}]


def post_raw(server, path, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def assert_error(status, data, want_status, param=None):
    assert status == want_status, (status, data)
    e = json.loads(data)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    if param is not None:
        assert e["param"] == param, e
    return e


def test_bad_bodies_get_openai_errors(gemma3):
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"messages": "hi"}', 400, "messages"),
        (b'{"model": "x"}', 404, "model"),
        (b'{}', 400, "messages"),
        (b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
         "messages[0].content[0].image_url"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": null, "top_k": 1.5}', 400, "top_k"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools[0]"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}', 400,
         "response_format"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1e300}', 400, "seed"),
        ('{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"), 400, None),  # not UTF-8
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ]
    for body, status, param in cases:
        assert_error(*post_raw(gemma3, CHAT, body), status, param)
    assert_error(*post_raw(gemma3, "/v1/completions", b'{"prompt": 7}'), 400, "prompt")
    assert_error(*post_raw(gemma3, "/v1/completions", b'{"prompt": ["a", "b"]}'), 400, "prompt")
    assert_error(*post_raw(gemma3, "/tokenize", b'{"prompt": 1}'), 400, "prompt")
    assert_error(*post_raw(gemma3, "/detokenize", b'{"tokens": [-1]}'), 400, "tokens")
    # Larger than --max-body (1M): 413, before the body is read into memory.
    assert_error(*post_raw(gemma3, CHAT, b'{"messages": "' + b"x" * (2 << 20) + b'"}'), 413)
    r = requests.get(gemma3.url + "/v1/nothing")
    assert_error(r.status_code, r.content, 404)
    # The server is unharmed: a well-formed request is answered.
    status, data = post_raw(gemma3, CHAT, json.dumps({"messages": HELLO, "max_tokens": 2}).encode())
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2


def test_disconnect_cancels_and_frees_pages(gemma3):
    before = gemma3.metrics()
    body = json.dumps({"messages": HELLO, "max_tokens": 900, "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", gemma3.port))
    sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 4:  # the role chunk and some tokens
        got += sock.recv(4096)
    assert b"200 OK" in got
    assert wait_for(lambda: gemma3.metrics()["markbase_num_requests_running"] >= 1)
    sock.close()
    # Cancelled at once: nothing running, the request's KV pages back to where they were.
    assert wait_for(lambda: gemma3.metrics()["markbase_num_requests_running"] == 0, timeout=5), gemma3.metrics()
    assert wait_for(lambda: gemma3.metrics()["markbase_kv_pages_used"] == before["markbase_kv_pages_used"], timeout=5)
    assert wait_for(lambda: any("stream" in l and "cancelled" in l for l in gemma3.lines), timeout=5), gemma3.log()
    line = next(l for l in gemma3.lines if "stream" in l and "cancelled" in l)
    assert "chatcmpl-" in line and "prompt=" in line and "completion=" in line and "ttft=" in line
    assert int(line.split("completion=")[1].split()[0]) < 900


def test_timeout(gemma3):
    t0 = time.monotonic()
    r = requests.post(gemma3.url + CHAT, json={"messages": HELLO, "max_tokens": 900, "ignore_eos": True,
                                               "timeout": 0.5})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "timeout"
    assert time.monotonic() - t0 < 10


def test_metrics_text(gemma3):
    requests.post(gemma3.url + CHAT, json={"messages": HELLO, "max_tokens": 3})
    text = requests.get(gemma3.url + "/metrics").text
    for name in ["markbase_num_requests_waiting", "markbase_num_requests_running", "markbase_num_preemptions_total",
                 "markbase_kv_pages_used", "markbase_kv_pages_free", "markbase_prefix_cache_hit_rate",
                 "markbase_generation_tokens_per_second", "markbase_time_to_first_token_seconds_bucket",
                 "markbase_inter_token_latency_seconds_count"]:
        assert f"\n{name}{{" in "\n" + text, name
    assert "# TYPE markbase_time_to_first_token_seconds histogram" in text
    for hist in ["markbase_time_to_first_token_seconds", "markbase_inter_token_latency_seconds"]:
        buckets = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(hist + "_bucket{")]
        count = next(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(hist + "_count{"))
        assert len(buckets) == 13 and buckets == sorted(buckets) and buckets[-1] == count > 0, (hist, buckets, count)


def test_prefix_cache_reports_cached_tokens(gemma3):
    system = "You are a helpful assistant who answers in full sentences. " * 12
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    first = requests.post(gemma3.url + CHAT, json={"messages": msgs, "max_tokens": 4}).json()["usage"]
    msgs[1]["content"] = "Name a fruit."
    second = requests.post(gemma3.url + CHAT, json={"messages": msgs, "max_tokens": 4}).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] > first["prompt_tokens"] // 2, (first, second)


def test_sigterm_finishes_in_flight_requests_and_exits_0():
    s = Server(GEMMA3, "--ctx", 512)
    result = {}

    def stream():
        r = requests.post(s.url + CHAT, json={"messages": HELLO, "max_tokens": 40, "ignore_eos": True,
                                              "stream": True}, stream=True)
        result["lines"] = [l for l in r.iter_lines() if l.startswith(b"data: ")]  # not ": keep-alive"
    t = threading.Thread(target=stream)
    t.start()
    assert wait_for(lambda: s.metrics()["markbase_num_requests_running"] >= 1)
    assert s.stop(signal.SIGTERM) == 0, s.log()
    t.join(30)
    assert result["lines"][-1] == b"data: [DONE]"
    finish = [json.loads(l[6:])["choices"][0]["finish_reason"] for l in result["lines"][:-1]]
    assert finish[-1] == "length"  # finished, not cut
    assert "SIGTERM" in s.log()
    try:
        requests.get(s.url + "/health", timeout=2)
        assert False, "still listening"
    except requests.ConnectionError:
        pass


def test_sigterm_right_after_start():
    for _ in range(3):
        s = Server(GEMMA3, "--ctx", 256)
        t0 = time.monotonic()
        assert s.stop(signal.SIGTERM, timeout=20) == 0, s.log()
        assert time.monotonic() - t0 < 10


def test_chat_page_is_served(gemma3):
    r = requests.get(gemma3.url + "/")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and 'id="stop"' in r.text
