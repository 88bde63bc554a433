#!/usr/bin/env python3
"""Generate chat-template reference cases for tests/test_chat.cpp, rendered by transformers itself.

Rerun:  python3 tools/reference/make_chat_cases.py   (needs transformers, tokenizers, jinja2)
Output: tests/fixtures/chat/templates/*.jinja   copies of the templates the cases were rendered with
        tests/fixtures/chat/render_cases.json   inputs + the exact text apply_chat_template(tokenize=False)
                                                returned (or the error it raised)
        tests/fixtures/chat/parse_cases.json    Gemma 4 model outputs + what transformers' response parser
                                                (the "gemma4" response template of `transformers serve`) made of them

Rendering goes through PreTrainedTokenizerFast.apply_chat_template, so the Jinja environment, globals,
filters and template kwargs are exactly transformers'. The tokenizer is built with bos_token="<bos>" and
eos_token="<eos>" and nothing else, so its special_tokens_map is exactly what mb::ChatTemplateInputs
passes (bos_token, eos_token); enable_thinking is always passed, as the C++ side does.
"""

import copy
import json
import os
import shutil
import sys

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
OUT = os.path.join(ROOT, "tests", "fixtures", "chat")

TEMPLATES = {
    "gemma-4-31B-it.jinja": "gemma4-tokenizer.json",
    "gemma-4-31B-it-interleaved.jinja": "gemma4-tokenizer.json",
    "gemma-3-it.jinja": "gemma3-tokenizer.json",
}

# --------------------------------------------------------------------------------------------
# Tools (OpenAI function schemas) with nested parameters

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Tokyo"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                "days": {"type": "integer", "description": "Forecast length in days"},
            },
            "required": ["city"],
        },
    },
}

FLIGHTS = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Search flights between two airports.",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "description": "Origin and destination",
                    "properties": {
                        "from": {"type": "string", "description": "IATA code"},
                        "to": {"type": "string", "description": "IATA code"},
                        "via": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["from", "to"],
                },
                "passengers": {
                    "type": "array",
                    "description": "Who flies",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "age": {"type": "integer", "description": "Age in years"},
                            "Seat": {"type": "string", "enum": ["aisle", "window"]},
                        },
                        "required": ["name"],
                    },
                },
                "max_price": {"type": "number", "description": "Upper bound in EUR", "nullable": True},
                "flexible": {"type": "boolean"},
                "cabin": {"type": ["string", "null"], "description": "Cabin class"},
                "Airline": {"type": "string", "description": "Preferred carrier — “any” if none"},
            },
            "required": ["route", "passengers"],
        },
    },
}

NO_PARAMS = {"type": "function", "function": {"name": "get_time", "description": "Return the current time."}}

WITH_RESPONSE = {
    "type": "function",
    "function": {
        "name": "lookup_user",
        "description": "Look a user up by id.",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        "response": {"type": "object", "description": "The user record"},
    },
}


def call(name, arguments, id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id is not None:
        c["id"] = id
    return c


def user(content):
    return {"role": "user", "content": content}


def assistant(content, **kw):
    return {"role": "assistant", "content": content, **kw}


def system(content):
    return {"role": "system", "content": content}


NESTED_ARGS = {
    "route": {"from": "CDG", "to": "NRT", "via": ["HEL"]},
    "passengers": [{"name": "Ada", "age": 36}, {"name": "Émile", "Seat": "window"}],
    "max_price": 1234.5,
    "flexible": True,
    "cabin": None,
    "Airline": "any",
    "ratio": 1e-05,
}

# --------------------------------------------------------------------------------------------
# Conversations: (name, messages, tools)

GEMMA4_CHATS = [
    ("user_only", [user("Hi")], None),
    ("system_user", [system("You are a helpful assistant."), user("What is 2+2?")], None),
    ("developer_user", [{"role": "developer", "content": "  Be terse.  "}, user("Name a prime.")], None),
    (
        "multi_turn_strip_thinking",
        [
            system("You are helpful."),
            user("Hello!"),
            assistant("<|channel>thought\nThe user greets me.<channel|>Hi! How can I help?"),
            user("  Tell me a joke.\n"),
            assistant("Why did the chicken cross the road?  "),
            user("Why?"),
        ],
        None,
    ),
    ("unicode_whitespace", [user("\n  Привет, мир! 你好 🌍\tcafé  \n")], None),
    (
        "multimodal_parts",
        [
            user(
                [
                    {"type": "image", "url": "cat.png"},
                    {"type": "text", "text": " What is in this image? "},
                    {"type": "image", "url": "dog.png"},
                ]
            ),
            assistant([{"type": "text", "text": "A cat and a dog."}]),
            user([{"type": "audio", "url": "a.wav"}, {"type": "text", "text": "Transcribe this."}]),
            user([{"type": "video", "url": "v.mp4"}, {"type": "text", "text": "Describe the video."}]),
        ],
        None,
    ),
    ("tools_declared", [system("Use tools when useful."), user("Weather in Paris?")], [WEATHER, FLIGHTS]),
    ("tools_no_system", [user("What time is it?")], [NO_PARAMS, WITH_RESPONSE]),
    (
        "tool_call_and_response",
        [
            user("What's the weather in Tokyo?"),
            assistant("", tool_calls=[call("get_weather", {"city": "Tokyo", "unit": "celsius"}, id="call_1")]),
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
            assistant("It is 21 °C and clear in Tokyo."),
            user("And in Osaka?"),
        ],
        [WEATHER],
    ),
    (
        "tool_call_pending_response",
        [
            user("Weather in Oslo and Bergen?"),
            assistant(
                "",
                tool_calls=[
                    call("get_weather", {"city": "Oslo"}, id="a"),
                    call("get_weather", {"city": "Bergen", "days": 3}, id="b"),
                ],
            ),
            {"role": "tool", "tool_call_id": "b", "name": "ignored", "content": "rain"},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "snow, "}, {"type": "text", "text": "-3 C"}]},
        ],
        [WEATHER],
    ),
    (
        "tool_call_nested_args",
        [
            user("Book me something."),
            assistant("Let me search.", tool_calls=[call("search_flights", NESTED_ARGS, id="f1")]),
            {"role": "tool", "tool_call_id": "f1", "content": "3 flights found"},
        ],
        [FLIGHTS],
    ),
    (
        "tool_call_unanswered",
        [user("Time?"), assistant(None, tool_calls=[call("get_time", {})])],
        [NO_PARAMS],
    ),
    (
        "tool_call_string_arguments",
        [
            user("Weather?"),
            assistant("", tool_calls=[call("get_weather", '{"city": "Lima"}', id="s1")]),
            {"role": "tool", "name": "get_weather", "tool_call_id": "s1", "content": "warm"},
            assistant("Warm."),
        ],
        [WEATHER],
    ),
    (
        "legacy_tool_responses",
        [
            user("Look up user 7."),
            assistant(
                "",
                tool_calls=[call("lookup_user", {"id": 7})],
                tool_responses=[{"name": "lookup_user", "response": {"name": "Ada", "admin": False, "tags": ["x", 1.5]}}],
            ),
            assistant("", tool_responses=[{"name": "lookup_user", "response": "not found"}]),
            assistant("User 7 is Ada."),
        ],
        [WITH_RESPONSE],
    ),
    (
        "reasoning_content_on_tool_turn",
        [
            user("Weather in Rome?"),
            assistant(
                "",
                reasoning_content="I should call the weather tool.",
                tool_calls=[call("get_weather", {"city": "Rome"}, id="r1")],
            ),
            {"role": "tool", "tool_call_id": "r1", "content": "sunny"},
        ],
        [WEATHER],
    ),
    (
        "later_system_message",
        [user("Hi"), assistant("Hello."), system("Switch to French."), user("Bonjour")],
        None,
    ),
    ("system_as_parts", [system([{"type": "text", "text": "Parts system."}]), user("Hi")], None),
    ("ends_with_assistant", [user("Say yes."), assistant("Yes.")], None),
]

GEMMA3_CHATS = [
    ("user_only", [user("Hi")], None),
    ("system_user", [system("You are a helpful assistant."), user("What is 2+2?")], None),
    (
        "multi_turn",
        [user("  Hello!  "), assistant("Hi! How can I help?"), user("Tell me a joke.")],
        None,
    ),
    (
        "images",
        [
            system([{"type": "text", "text": "Describe images."}]),
            user([{"type": "image", "url": "a.png"}, {"type": "text", "text": " What is this? "}, {"type": "image"}]),
        ],
        None,
    ),
    ("tools_ignored", [user("Weather?")], [WEATHER]),
    ("unicode", [user("日本語のテキスト 🙂")], None),
    ("bad_alternation", [user("a"), user("b")], None),
    ("bad_content", [user(None)], None),
]

GEMMA4_ERRORS = [
    # A tool message with neither a name nor a matching tool_call_id makes the template add str + None.
    (
        "tool_response_without_name",
        [user("x"), assistant("", tool_calls=[call("get_time", {}, id="t1")]), {"role": "tool", "tool_call_id": "zz", "content": "ok"}],
        [NO_PARAMS],
    ),
]

# Model outputs for the Gemma 4 parser (what the model generates after the prompt).
Q = '<|"|>'
PARSE_OUTPUTS = [
    ("plain", "The answer is 4.<turn|>"),
    ("plain_no_stop", "  Just text, cut off by max_tokens"),
    ("thinking", "<|channel>thought\nLet me add 2 and 2.\nThat is 4.<channel|>The answer is 4.<turn|>"),
    ("empty_thinking", "<|channel>thought\n<channel|>Hello!<turn|>"),
    ("unterminated_thinking", "<|channel>thought\nStill thinking about"),
    ("tool_call", f"<|tool_call>call:get_weather{{city:{Q}Tokyo{Q},unit:{Q}celsius{Q}}}<tool_call|><|tool_response>"),
    (
        "thinking_and_tool_call",
        f"<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather{{city:{Q}Paris, France{Q},days:3}}<tool_call|><|tool_response>",
    ),
    (
        "two_tool_calls",
        f"<|tool_call>call:get_time{{}}<tool_call|><|tool_call>call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|><|tool_response>",
    ),
    (
        "nested_arguments",
        f"<|tool_call>call:search_flights{{flexible:true,max_price:1234.5,passengers:[{{age:36,name:{Q}Ada{Q}}},{{Seat:{Q}window{Q},name:{Q}Émile{Q}}}],route:{{from:{Q}CDG{Q},to:{Q}NRT{Q},via:[{Q}HEL{Q}]}},neg:-2,sci:1e-05,empty:{{}},none:[]}}<tool_call|><|tool_response>",
    ),
    ("content_then_tool_call", f"Let me check.<|tool_call>call:get_time{{}}<tool_call|><|tool_response>"),
    ("string_with_delims", f"<|tool_call>call:echo{{text:{Q}a, b: {{c}} [d]{Q}}}<tool_call|>"),
    ("quoted_key_json_string", f'<|tool_call>call:f{{{Q}k{Q}:"v"}}<tool_call|>'),
]


# --------------------------------------------------------------------------------------------


def render(tok, source, messages, tools, add_generation_prompt, enable_thinking):
    try:
        text = tok.apply_chat_template(
            copy.deepcopy(messages),
            tools=copy.deepcopy(tools),
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tokenize=False,
        )
        return {"expected": text}
    except jinja2.exceptions.TemplateError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    except TypeError as e:
        return {"error": f"TypeError: {e}"}


def render_cases():
    cases = []
    for template, tokenizer_file in TEMPLATES.items():
        source = open(os.path.join(SHARED, "chat-templates", template), encoding="utf-8").read()
        tok = PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(SHARED, "tokenizer", tokenizer_file), bos_token="<bos>", eos_token="<eos>"
        )
        assert tok.special_tokens_map == {"bos_token": "<bos>", "eos_token": "<eos>"}, tok.special_tokens_map
        gemma4 = template.startswith("gemma-4")
        chats = GEMMA4_CHATS + GEMMA4_ERRORS if gemma4 else GEMMA3_CHATS
        for name, messages, tools in chats:
            # Thinking on and off (the E2B/E4B templates differ from these only with thinking off);
            # the generation prompt on, and off where the chat ends with a model turn.
            settings = [(True, False), (True, True)] if gemma4 else [(True, False)]
            if messages[-1]["role"] == "assistant" or name in ("multi_turn", "system_user"):
                settings.append((False, False))
            for add_gen, thinking in settings:
                case = {
                    "name": f"{template.removesuffix('.jinja')}/{name}/gen{int(add_gen)}_think{int(thinking)}",
                    "template": template,
                    "messages": messages,
                    "tools": tools,
                    "add_generation_prompt": add_gen,
                    "enable_thinking": thinking,
                    "bos_token": "<bos>",
                    "eos_token": "<eos>",
                }
                case.update(render(tok, source, messages, tools, add_gen, thinking))
                if "expected" in case:
                    # apply_chat_template(tokenize=True) tokenizes the rendering without adding
                    # special tokens: the template's own <bos> is the only one.
                    case["ids"] = tok.encode(case["expected"], add_special_tokens=False)
                cases.append(case)
        shutil.copyfile(os.path.join(SHARED, "chat-templates", template), os.path.join(OUT, "templates", template))
    return cases


def parse_cases():
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    from transformers.utils.chat_parsing.response_parser import parse_response

    schema = _RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)]
    cases = []
    for name, text in PARSE_OUTPUTS:
        msg = parse_response(text, schema, prefix="<|turn>model\n")
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg.get("tool_calls", [])
        ]
        cases.append(
            {
                "name": name,
                "text": text,
                "thinking": msg.get("thinking", ""),
                "content": msg.get("content", ""),
                "tool_calls": calls,
            }
        )
    return cases


def main():
    os.makedirs(os.path.join(OUT, "templates"), exist_ok=True)
    header = {
        "generator": "tools/reference/make_chat_cases.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
    }
    rc = render_cases()
    with open(os.path.join(OUT, "render_cases.json"), "w", encoding="utf-8") as f:
        json.dump({**header, "cases": rc}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    pc = parse_cases()
    with open(os.path.join(OUT, "parse_cases.json"), "w", encoding="utf-8") as f:
        json.dump({**header, "cases": pc}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum("error" in c for c in rc)
    print(f"{len(rc)} render cases ({errors} expected errors), {len(pc)} parse cases -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
