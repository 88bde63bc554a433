"""`markbase chat`: several turns on one runtime (the second reuses the first's KV), thinking and tool
calls shown apart, Ctrl-C stops a reply but not the program."""
import re
import signal
import subprocess
import threading

from conftest import BIN, GEMMA3, TOOL_CALLER, wait_for


def stats(stderr):
    return [dict(tokens=int(m[0]), prompt=int(m[1]), cached=int(m[2]), finish=m[3])
            for m in re.findall(r"\((\d+) tokens.*? \| prompt (\d+) tokens, (\d+) cached, .*? \| (\w+)\)", stderr)]


def test_turns_thinking_and_tool_calls():
    r = subprocess.run([BIN, "chat", "-m", TOOL_CALLER, "--think", "--threads", "1"],
                       input="What time is it?\nAnd now?\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ('[thinking] ok\n[tool call] get_time({"tz":"UTC"})\n' * 2), r.stdout
    first, second = stats(r.stderr)
    assert first["finish"] == second["finish"] == "tool_calls"
    assert second["prompt"] > first["prompt"] and second["cached"] >= first["prompt"] // 2, (first, second)


def test_ctrl_c_stops_a_reply_not_the_program():
    p = subprocess.Popen([BIN, "chat", "-m", GEMMA3, "-n", "4000", "--ctx", "8192", "--threads", "2"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    out, err = [], []
    threading.Thread(target=lambda: out.extend(iter(lambda: p.stdout.read(1), "")), daemon=True).start()
    threading.Thread(target=lambda: err.extend(iter(p.stderr.readline, "")), daemon=True).start()
    p.stdin.write("Count from one to a thousand, one number per line.\n")
    p.stdin.flush()
    assert wait_for(lambda: len(out) > 40, timeout=60), "".join(err)
    p.send_signal(signal.SIGINT)
    assert wait_for(lambda: len(stats("".join(err))) == 1, timeout=10), "".join(err)
    # The program is still there: a second turn, on the first one's pages, stopped the same way.
    seen = len(out)
    p.stdin.write("Go on.\n")
    p.stdin.flush()
    assert wait_for(lambda: len(out) > seen + 20, timeout=60), "".join(err)
    p.send_signal(signal.SIGINT)
    assert wait_for(lambda: len(stats("".join(err))) == 2, timeout=10), "".join(err)
    p.stdin.write("/exit\n")
    p.stdin.close()
    assert p.wait(30) == 0, "".join(err)
    first, second = stats("".join(err))
    assert first["finish"] == second["finish"] == "stopped" and first["tokens"] < 4000
    assert second["cached"] >= first["prompt"] // 2, (first, second)
