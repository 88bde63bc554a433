"""Images, audio and video through `markbase serve`'s chat endpoint with the official OpenAI client: data:
URLs, the answer equal to what transformers' processor and model give for the same chat
(tests/fixtures/mm_e2b_like/reference.json and video_reference.json "chat"), video as a file (video_url,
input_video) or as frames, and the refusals: URLs are never fetched, local paths only under
--allowed-media-dir (no `..` or symlink escape), bad media is a 400."""
import base64
import json
import os
import pathlib

import openai
import pytest

from conftest import ROOT, Server

MM = ROOT / "tests/fixtures/mm_e2b_like"
VIDEOS = ROOT / "tests/fixtures/videos"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "image_0.png").write_bytes((MM / "image_0.png").read_bytes())
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.png").write_bytes((MM / "image_1.png").read_bytes())
    os.symlink(outside / "secret.png", d / "link.png")
    return d, outside


@pytest.fixture(scope="module")
def mm_server(media_dir):
    s = Server(MM, "--ctx", 512, "--allowed-media-dir", media_dir[0])
    yield s
    assert s.stop() == 0, s.log()


def data_url(path, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(pathlib.Path(path).read_bytes()).decode()


def ask(client, model, parts, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                          max_tokens=8, temperature=0, **kw)


def test_image_chat_matches_transformers(mm_server, client_for):
    ref = json.loads((MM / "reference.json").read_text())
    c = client_for(mm_server)
    tok = json.loads((MM / "tokenizer.json").read_text())
    id_to_piece = {i: t for t, i in tok["model"]["vocab"].items()}
    for case in ref["chat"]:
        parts = [{"type": "image_url", "image_url": {"url": data_url(MM / f)}} for f in case["images"]]
        parts.append({"type": "text", "text": case["text"]})
        r = ask(c, mm_server.model, parts, logprobs=True)
        got = r.choices[0].logprobs.content
        assert r.usage.prompt_tokens == len(case["prompt_ids"])
        assert len(got) == len(case["greedy"])
        for g, want_id in zip(got, case["greedy"]):
            piece = id_to_piece[want_id]
            if piece.startswith("<0x") and piece.endswith(">"):  # a byte token: compare its byte
                assert g.bytes == [int(piece[3:5], 16)], (g, piece)
            else:
                assert g.token == piece.replace("\u2581", " "), (g, piece)
        # The same image again: its KV comes from the prefix cache.
        r2 = ask(c, mm_server.model, parts)
        assert r2.choices[0].message.content == r.choices[0].message.content
        assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_local_files_only_under_the_allowed_dir(mm_server, media_dir, client_for):
    c = client_for(mm_server)
    inside, outside = media_dir
    ok = ask(c, mm_server.model, [{"type": "image_url", "image_url": {"url": f"file://{inside}/image_0.png"}},
                                  {"type": "text", "text": "Hi"}])
    assert ok.choices[0].finish_reason == "length"
    for url, words in [(str(outside / "secret.png"), "allowed-media-dir"),
                       (f"{inside}/../{outside.name}/secret.png", "allowed-media-dir"),
                       (str(inside / "link.png"), "allowed-media-dir"),
                       ("https://example.com/cat.png", "does not fetch URLs"),
                       (str(inside / "missing.png"), "no such file")]:
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, mm_server.model, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}])
        assert words in str(e.value), (url, str(e.value))


def test_bad_media_is_a_400(mm_server, client_for):
    c = client_for(mm_server)
    bad = [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n\0\0").decode()}},
         "cannot decode"),
        ({"type": "image_url", "image_url": {"url": data_url(MM / "audio_0.wav", "image/png")}}, "content[0]"),
        ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF\0\0\0\0WAVE").decode(), "format": "wav"}},
         "audio"),
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "content[0]"),
        ({"type": "input_video", "input_video": {"frames": []}}, "frames"),
        ({"type": "input_video", "input_video": {"frames": [data_url(MM / "image_0.png"), data_url(MM / "image_1.png")]}},
         "share one size"),
        ({"type": "input_visual", "input_visual": {}}, "content parts are"),
    ]
    for part, words in bad:
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, mm_server.model, [part, {"type": "text", "text": "x"}])
        assert words in str(e.value), (part["type"], str(e.value))
    # The server is still fine afterwards.
    ok = ask(c, mm_server.model, [{"type": "text", "text": "Hi"}])
    assert ok.choices[0].finish_reason == "length"


def pieces_of(ids):
    tok = json.loads((MM / "tokenizer.json").read_text())
    id_to_piece = {i: t for t, i in tok["model"]["vocab"].items()}
    return [id_to_piece[i] for i in ids]


def test_video_chat_matches_transformers(mm_server, client_for):
    ref = json.loads((MM / "video_reference.json").read_text())
    c = client_for(mm_server)
    case = next(x for x in ref["chat"] if ref["videos"][x["video"]]["file"] == "short.mov")  # fits --ctx 512
    url = data_url(VIDEOS / "short.mov", "video/quicktime")
    b64 = url.split(",", 1)[1]
    for part in [{"type": "video_url", "video_url": {"url": url}},
                 {"type": "input_video", "input_video": {"data": b64, "format": "mov"}}]:
        r = ask(c, mm_server.model, [part, {"type": "text", "text": case["text"]}], logprobs=True)
        assert r.usage.prompt_tokens == len(case["prompt_ids"])
        got = [g.token for g in r.choices[0].logprobs.content][:len(case["greedy"])]
        want = [p.replace("\u2581", " ") for p in pieces_of(case["greedy"])]
        assert [g for g, w in zip(got, want) if not w.startswith("<0x")] == [w for w in want if not w.startswith("<0x")]


def test_video_as_frames(mm_server, client_for):
    c = client_for(mm_server)
    frames = sorted((VIDEOS / "frames").iterdir())
    part = {"type": "input_video", "input_video": {"frames": [data_url(f) for f in frames]}}
    r = ask(c, mm_server.model, [part, {"type": "text", "text": "What happens?"}])
    assert r.choices[0].finish_reason == "length"
    # Three frames of 63 soft tokens, each with its begin/end markers and timestamp.
    assert r.usage.prompt_tokens > 3 * 65
