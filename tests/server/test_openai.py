"""The official `openai` client against `markbase serve`: what it sends and parses is the interop."""
import concurrent.futures
import json

import openai
import pytest
import requests

from conftest import Server, TOOL_CALLER, GEMMA3

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


def stream_text(stream):
    text, finish, usage, roles = {}, {}, None, 0
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles += 1
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return text, finish, usage, roles


def test_models(gemma3, client_for):
    models = client_for(gemma3).models.list().data
    assert [m.id for m in models] == [gemma3.model]
    assert gemma3.model == "gemma-3-270m-q4_k_m.gguf"


def test_chat_nonstream_and_stream_agree(gemma3, client_for):
    client = client_for(gemma3)
    r = client.chat.completions.create(model=gemma3.model, messages=HELLO, max_tokens=24, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The prompt is the model's own chat template (its tokens, as /tokenize renders them).
    tok = requests.post(gemma3.url + "/tokenize", json={"messages": HELLO}).json()
    assert r.usage.prompt_tokens == tok["count"]
    # Greedy: the stream carries the same text in pieces, then usage when asked for.
    text, finish, usage, roles = stream_text(client.chat.completions.create(
        model=gemma3.model, messages=HELLO, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert text[0] == choice.message.content and finish[0] == choice.finish_reason and roles == 1
    assert usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_and_logprobs(gemma3, client_for):
    client = client_for(gemma3)
    r = client.completions.create(model=gemma3.model, prompt="The capital of France is", max_tokens=8,
                                  temperature=0, logprobs=3)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text
    assert len(c.logprobs.tokens) == r.usage.completion_tokens == len(c.logprobs.token_logprobs)
    assert "".join(c.logprobs.tokens) == c.text
    for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert lp <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) >= lp - 1e-4  # greedy picks the most likely token
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model=gemma3.model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True)]
    assert "".join(pieces) == c.text
    # A prompt given as token ids is used as given.
    ids = requests.post(gemma3.url + "/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    r2 = client.completions.create(model=gemma3.model, prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == c.text and r2.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model=gemma3.model, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + c.text
    assert requests.post(gemma3.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == \
        "<bos>The capital of France is"


def test_chat_logprobs(gemma3, client_for):
    r = client_for(gemma3).chat.completions.create(model=gemma3.model, messages=HELLO, max_tokens=6, temperature=0,
                                                   logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and bytes(t.bytes).decode("utf-8", "replace") is not None


def test_sampling_options(gemma3, client_for):
    client = client_for(gemma3)
    kw = dict(model=gemma3.model, messages=HELLO, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, n=2)
    a = client.chat.completions.create(**kw, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    b = client.chat.completions.create(**kw, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    # Streamed, the two choices interleave by index and add up to the same texts.
    text, finish, _, roles = stream_text(client.chat.completions.create(
        **kw, stream=True, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}))
    assert [text[0], text[1]] == [c.message.content for c in a.choices] and roles == 2
    r = client.chat.completions.create(model=gemma3.model, messages=HELLO, max_tokens=1)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    # A stop string ends the reply without itself.
    full = client.chat.completions.create(model=gemma3.model, messages=HELLO, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = client.chat.completions.create(model=gemma3.model, messages=HELLO, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # logit_bias steers the first token.
    tok = requests.post(gemma3.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()
    biased = client.completions.create(model=gemma3.model, prompt="I like", max_tokens=1, temperature=0,
                                       logit_bias={str(tok["tokens"][0]): 100})
    assert biased.choices[0].text == " banana"
    penalised = client.chat.completions.create(model=gemma3.model, messages=HELLO, max_tokens=12, temperature=0,
                                               presence_penalty=1.5, frequency_penalty=1.0)
    assert penalised.choices[0].message.content


def test_errors_are_the_clients_own_types(gemma3, client_for):
    client = client_for(gemma3)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    assert e.value.body["code"] == "model_not_found"
    for bad in [dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=0), dict(top_logprobs=3),
                dict(logit_bias={"99999999": 1}), dict(presence_penalty=5), dict(stop=3)]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=gemma3.model, messages=HELLO, **bad)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error", bad
        assert e.value.body["param"] == next(iter(bad)), (bad, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=gemma3.model, messages=[{"role": "user", "content": "x " * 3000}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=gemma3.model, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=gemma3.model, prompt=[999999999])
    assert requests.get(gemma3.url + "/health").json() == {"status": "ok"}


def test_api_key_and_full_queue(client_for):
    s = Server(GEMMA3, "--api-key", "sesame", "--max-seqs", 1, "--max-queue", 1, "--ctx", 512)
    try:
        with pytest.raises(openai.AuthenticationError):
            client_for(s, api_key="wrong").models.list()
        r = requests.post(s.url + "/v1/chat/completions", json={"messages": HELLO})  # no key at all
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert requests.get(s.url + "/health").status_code == 200  # open, for load balancers
        client = client_for(s, api_key="sesame")
        assert client.models.list().data[0].id == s.model

        def one(_):
            try:
                client.chat.completions.create(model=s.model, messages=HELLO, max_tokens=48,
                                               extra_body={"ignore_eos": True})
                return "ok"
            except openai.RateLimitError as e:
                assert e.response.headers.get("retry-after") == "1"
                return "429"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        assert "429" in results and "ok" in results, results
    finally:
        assert s.stop() == 0, s.log()


def test_gemma4_template_tools_and_thinking(e2b_like, client_for):
    """e2b_like: random weights under the real Gemma 4 template; what reaches the template is checked."""
    client = client_for(e2b_like)
    assert e2b_like.model == "gemma4-tiny"
    plain = requests.post(e2b_like.url + "/tokenize", json={"messages": HELLO}).json()["count"]
    with_tools = requests.post(e2b_like.url + "/tokenize", json={"messages": HELLO, "tools": TOOLS}).json()["count"]
    thinking = requests.post(e2b_like.url + "/tokenize", json={
        "messages": HELLO, "chat_template_kwargs": {"enable_thinking": True}}).json()["count"]
    assert with_tools > plain + 20 and thinking != plain
    r = client.chat.completions.create(model="gemma4-tiny", messages=HELLO, tools=TOOLS, max_tokens=8,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.usage.prompt_tokens == requests.post(e2b_like.url + "/tokenize", json={
        "messages": HELLO, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}}).json()["count"]
    # A conversation with an earlier tool call and its result renders.
    history = HELLO + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model="gemma4-tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert r.usage.prompt_tokens > with_tools


def test_tool_calls(tool_caller, client_for):
    client = client_for(tool_caller)
    msgs = [{"role": "user", "content": "What time is it in UTC?"}]
    r = client.chat.completions.create(model=tool_caller.model, messages=msgs, tools=TOOLS, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_time" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"tz": "UTC"}
    assert choice.message.content is None and choice.message.reasoning_content is None
    # Streamed: the call arrives as one tool_calls delta, none of its markup as content.
    calls, content, finish = [], "", None
    for chunk in client.chat.completions.create(model=tool_caller.model, messages=msgs, tools=TOOLS, max_tokens=64,
                                                stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    got = [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert got == [(0, "get_time", {"tz": "UTC"})]
    # With thinking on, the thought channel comes back apart, as reasoning_content.
    r = client.chat.completions.create(model=tool_caller.model, messages=msgs, tools=TOOLS, max_tokens=64,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    m = r.choices[0].message
    assert m.reasoning_content == "ok" and m.tool_calls[0].function.name == "get_time"
    reasoning = ""
    for chunk in client.chat.completions.create(model=tool_caller.model, messages=msgs, max_tokens=64, stream=True,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": True}}):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            assert not c.delta.content
    assert reasoning == "ok"
    # The raw output, markup and all, is what completions return.
    raw = client.completions.create(model=tool_caller.model, prompt=requests.post(tool_caller.url + "/tokenize", json={
        "messages": msgs}).json()["tokens"], max_tokens=64, extra_body={"skip_special_tokens": False})
    assert raw.choices[0].text == '<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|>'
