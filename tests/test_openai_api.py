"""The OpenAI API surface on the real int4 pair, through the ``openai`` client against a `verispec serve` process.

Structured outputs (``response_format`` and vLLM's ``structured_outputs``), tool calls (auto, named, streamed,
a follow-up turn), logprobs (chat and completions, streamed), ``n`` > 1, penalties and logit bias, the errors
bad input gets, and predicted outputs. One server for the module; greedy wherever an exact answer is asserted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from verispec import hub

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MODEL = TARGET  # the served name defaults to --model
SPEC_ON = {"speculative": {"enabled": True}}
SPEC_OFF = {"speculative": {"enabled": False}}
GREEDY = {"temperature": 0}

pytestmark = pytest.mark.real


# -- the server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`verispec serve` on the int4 pair in a subprocess; yields its base URL once /health answers 200.

    A fixed k policy skips the start-up cost profiling; a 2048-token context keeps the KV caches small.
    """
    missing = [n for n in (TARGET, DRAFT) if not hub.is_installed(n)]
    if missing:
        pytest.fail(f"real models not installed ({', '.join(missing)}); run: make models")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("openai_api") / "serve.log"
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", TARGET, "--draft", DRAFT, "--max-len", "2048",
           "--k-policy", "fixed", "-k", "4", "--port", str(port)]
    with open(log_path, "w") as log:  # a file, not a pipe: nobody reads a pipe while the tests run
        proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ),
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"verispec serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"verispec serve did not become healthy:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def spec_usage(r: Any) -> dict[str, Any]:
    """verispec's ``usage.speculative``: which path the request took and what was drafted."""
    return r.usage.model_dump()["speculative"]


def assert_paths(spec: Any, plain: Any) -> None:
    """The comparison is not vacuous: one request speculated (and drafted), the other decoded plainly."""
    assert spec_usage(spec)["path"] == "speculative" and spec_usage(spec)["drafted"] > 0
    assert spec_usage(plain)["path"] == "plain"


def chat(client: OpenAI, content: str | list[dict[str, Any]], **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


# -- a small JSON schema validator (jsonschema is not a dependency) ----------------------------------


_TYPES: dict[str, Any] = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value: Any, schema: dict[str, Any], at: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the keywords the tests' schemas use); empty when it validates."""
    errors: list[str] = []
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is not None:
        ok = isinstance(value, _TYPES[kind])
    else:
        ok = True
    if not ok:
        return [f"{at}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{at}: {value!r} < {schema['minimum']}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{at}: longer than {schema['maxLength']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{at}: unexpected {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{at}.{k}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{at}: {len(value)} items")
        for i, v in enumerate(value):
            errors += schema_errors(v, schema.get("items", {}), f"{at}[{i}]")
    return errors


def test_the_validator_catches_what_it_checks() -> None:  # the helper itself; no server
    assert schema_errors({"name": "A", "age": 3, "address": {"city": "P", "zip": "1"}}, PERSON) == []
    assert len(schema_errors({"name": "A", "age": "3", "address": {"city": "P"}, "x": 1}, PERSON)) == 3
    assert schema_errors({"category": "bug", "priority": "urgent", "summary": "s"}, TICKET) != []
    assert schema_errors({"items": []}, SHOPPING) != []
    assert schema_errors({"items": [{"name": "x", "qty": 0}]}, SHOPPING) != []


# -- structured outputs --------------------------------------------------------------------------------

PERSON = {  # nested objects
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 40},
                                   "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "address"], "additionalProperties": False,
}
SHOPPING = {  # an array of objects
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5,
                             "items": {"type": "object",
                                       "properties": {"name": {"type": "string", "maxLength": 30},
                                                      "qty": {"type": "integer", "minimum": 1}},
                                       "required": ["name", "qty"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}
TICKET = {  # enums
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["bug", "feature", "question"]},
                   "priority": {"enum": ["low", "medium", "high"]},
                   "summary": {"type": "string", "maxLength": 60}},
    "required": ["category", "priority", "summary"], "additionalProperties": False,
}
SCHEMAS = {
    "nested": (PERSON, "Extract the person as JSON: Alice Smith, 34 years old, lives at 12 Rue Cler, 75007 Paris."),
    "array": (SHOPPING, "My shopping list as JSON: 2 apples, 3 bananas and 1 loaf of bread."),
    "enum": (TICKET, "Triage this support ticket as JSON: 'The app crashes every time I click Save. Urgent!'"),
}


@pytest.mark.parametrize("case", list(SCHEMAS))
def test_json_schema_output_validates_and_speculation_is_exact(client: OpenAI, case: str) -> None:
    schema, prompt = SCHEMAS[case]
    fmt = {"type": "json_schema", "json_schema": {"name": case, "schema": schema, "strict": True}}
    spec = chat(client, prompt, response_format=fmt, max_tokens=120, **GREEDY, extra_body=SPEC_ON)
    plain = chat(client, prompt, response_format=fmt, max_tokens=120, **GREEDY, extra_body=SPEC_OFF)
    content = spec.choices[0].message.content
    assert spec.choices[0].finish_reason == "stop", content  # the grammar completed within max_tokens
    value = json.loads(content)
    assert schema_errors(value, schema) == [], content
    assert content == plain.choices[0].message.content  # greedy constrained speculation is exact
    assert_paths(spec, plain)
    assert spec.usage.completion_tokens == plain.usage.completion_tokens


def test_json_object_mode(client: OpenAI) -> None:
    r = chat(client, "Give the capital of France as a JSON object with the key 'capital'.",
             response_format={"type": "json_object"}, max_tokens=60, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_json_extension(client: OpenAI) -> None:
    r = chat(client, SCHEMAS["enum"][1], max_tokens=120, **GREEDY, extra_body={"structured_outputs": {"json": TICKET}})
    assert r.choices[0].finish_reason == "stop"
    assert schema_errors(json.loads(r.choices[0].message.content), TICKET) == []


def test_structured_outputs_regex(client: OpenAI) -> None:
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    r = chat(client, "Make up a US phone number.", max_tokens=30, **GREEDY,
             extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content


def test_structured_outputs_choice(client: OpenAI) -> None:
    choices = ["positive", "negative", "neutral"]
    r = chat(client, "The sentiment of 'I absolutely love this library!' is", max_tokens=10, **GREEDY,
             extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices


def test_structured_outputs_lark_grammar(client: OpenAI) -> None:
    grammar = 'start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,4}/\n'
    r = chat(client, "What is 12 + 30? Answer as an equation.", max_tokens=30, **GREEDY,
             extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\d{1,4} \+ \d{1,4} = \d{1,4}", r.choices[0].message.content), r.choices[0].message.content


class Person(BaseModel):
    name: str
    age: int


def test_parse_into_a_pydantic_model(client: OpenAI) -> None:
    """``client.chat.completions.parse`` sends the model's strict schema and parses the answer into it."""
    r = client.chat.completions.parse(model=MODEL, response_format=Person, max_tokens=60, **GREEDY, messages=[
        {"role": "user", "content": "Extract the person: Bob Jones is 52 years old."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)
    assert person.age == 52 and "Bob" in person.name


# -- tools ------------------------------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a time zone",
                                      "parameters": {"type": "object",
                                                     "properties": {"timezone": {"type": "string"}},
                                                     "required": ["timezone"]}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TRIP = "I'm flying to Tokyo tomorrow and wonder what to pack."
PARIS = "What's the weather in Paris in celsius?"


def test_auto_tool_choice_renders_the_tools(client: OpenAI) -> None:
    """Under "auto" the model decides. This int4 1.5B coder never opens a ``<tool_call>`` for this prompt
    (it answers with the call as a JSON code block instead), so what is asserted is only what holds either way:
    the tools reach the prompt, and a call, if made, is parsed into ``tool_calls``."""
    r = chat(client, PARIS, tools=TOOLS, tool_choice="auto", max_tokens=80, **GREEDY)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert "paris" in json.loads(call.function.arguments)["city"].lower()
    else:
        assert choice.finish_reason == "stop"
        assert "get_weather" in choice.message.content  # named nowhere but in the rendered tools


def test_required_tool_choice_calls_the_fitting_tool(client: OpenAI) -> None:
    """"required" forces calls of listed functions; greedy, the first is the one the question calls for. (This model
    goes on making further calls until max_tokens, which "required" allows: only the first call is asserted on.)"""
    r = chat(client, PARIS, tools=TOOLS, tool_choice="required", max_tokens=60, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice.message
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert schema_errors(arguments, WEATHER_PARAMS) == [], arguments
    assert "paris" in arguments["city"].lower() and arguments["unit"] == "celsius"
    for other in choice.message.tool_calls[1:]:
        assert other.function.name in ("get_weather", "get_time")
        json.loads(other.function.arguments)


def test_no_parallel_tool_calls_means_one_call(client: OpenAI) -> None:
    r = chat(client, PARIS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60, **GREEDY)
    choice = r.choices[0]
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
    assert r.usage.completion_tokens < 60 and not choice.message.content


@pytest.fixture(scope="module")
def named_call(client: OpenAI) -> Any:
    """A non-streamed, greedy, forced call of get_weather (for a prompt that need not call for it)."""
    return chat(client, TRIP, tools=TOOLS, tool_choice=NAMED, max_tokens=120, **GREEDY)


def test_named_tool_choice_forces_a_valid_call(named_call: Any) -> None:
    choice = named_call.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert schema_errors(json.loads(call.function.arguments), WEATHER_PARAMS) == [], call.function.arguments


def test_streamed_named_tool_call_matches_the_non_streamed_one(client: OpenAI, named_call: Any) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish: list[str] = []
    for chunk in chat(client, TRIP, tools=TOOLS, tool_choice=NAMED, max_tokens=120, **GREEDY, stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                if tc.function is not None:
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    assert finish == ["tool_calls"]
    assert list(calls) == [0]
    expected = named_call.choices[0].message.tool_calls[0].function
    assert calls[0]["id"] and calls[0]["name"] == expected.name
    assert json.loads(calls[0]["arguments"]) == json.loads(expected.arguments)


def test_a_tool_result_turn_is_answered_with_text(client: OpenAI, named_call: Any) -> None:
    call = named_call.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": TRIP},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 C"},
    ]
    r = chat(client, messages, tools=TOOLS, max_tokens=40, **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content and r.choices[0].message.content.strip()


# -- logprobs --------------------------------------------------------------------------------------

LOGPROB_PROMPT = "Write a Python function that returns the square of x."


def _logprob_entries(r: Any) -> list[Any]:
    return r.choices[0].logprobs.content


def test_chat_logprobs_per_token_and_exact_under_speculation(client: OpenAI) -> None:
    kw = dict(logprobs=True, top_logprobs=3, max_tokens=24, **GREEDY)
    spec = chat(client, LOGPROB_PROMPT, **kw, extra_body=SPEC_ON)
    plain = chat(client, LOGPROB_PROMPT, **kw, extra_body=SPEC_OFF)
    for r in (spec, plain):
        entries = _logprob_entries(r)
        assert len(entries) == r.usage.completion_tokens
        for e in entries:
            assert isinstance(e.token, str) and e.logprob <= 0 and isinstance(e.bytes, list)
            assert e.bytes == list(e.token.encode("utf-8")) or "\ufffd" in e.token
            tops = [t.logprob for t in e.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
            # Greedy: the chosen token is a likeliest one (ties happen: bf16 logits; either may be listed first).
            assert abs(tops[0] - e.logprob) < 1e-6
            assert e.token in [t.token for t in e.top_logprobs] or abs(tops[-1] - tops[0]) < 1e-6
        assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == r.choices[0].message.content
    assert_paths(spec, plain)
    a, b = _logprob_entries(spec), _logprob_entries(plain)
    assert [e.token for e in a] == [e.token for e in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) < 1e-3, (x.token, x.logprob, y.logprob)
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        for tx, ty in zip(x.top_logprobs, y.top_logprobs, strict=True):
            assert abs(tx.logprob - ty.logprob) < 1e-3, (x.token, tx.token, tx.logprob, ty.logprob)


def test_streamed_chat_logprobs_cover_every_token(client: OpenAI) -> None:
    kw = dict(logprobs=True, top_logprobs=3, max_tokens=24, **GREEDY)
    whole = chat(client, LOGPROB_PROMPT, **kw)
    entries: list[Any] = []
    text, usage = "", None
    for chunk in chat(client, LOGPROB_PROMPT, **kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert usage is not None and len(entries) == usage.completion_tokens
    assert text == whole.choices[0].message.content
    assert [e.token for e in entries] == [e.token for e in _logprob_entries(whole)]
    for x, y in zip(entries, _logprob_entries(whole), strict=True):
        assert abs(x.logprob - y.logprob) < 1e-3 and len(x.top_logprobs) == 3


def test_completion_logprobs(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):\n", max_tokens=24, logprobs=2, **GREEDY)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    for i, (token, logprob, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert logprob <= 0
        assert isinstance(top, dict) and 2 <= len(top) <= 3  # the 2 likeliest (plus the chosen one, if not among)
        assert abs(max(top.values()) - logprob) < 1e-6  # greedy: a likeliest token (ties happen)
        assert abs(top.get(token, logprob) - logprob) < 1e-6
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


# -- n > 1 ---------------------------------------------------------------------------------------------

POEM = "Write a short poem about the sea."


def test_n_sampled_choices(client: OpenAI) -> None:
    r = chat(client, POEM, n=3, temperature=0.8, seed=1234, max_tokens=16, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * 16  # the sum over the choices
    assert len({c.message.content for c in r.choices}) > 1  # each choice its own seed stream


def test_n_streamed(client: OpenAI) -> None:
    finish: dict[int, list[str]] = {0: [], 1: [], 2: []}
    text = {0: "", 1: "", 2: ""}
    usage = None
    stream = chat(client, POEM, n=3, temperature=0.8, seed=99, max_tokens=12, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            assert choice.index in finish
            assert not finish[choice.index], "a chunk after the choice's finish_reason"
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index].append(choice.finish_reason)
    assert finish == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert all(text.values())
    assert usage is not None and usage.completion_tokens == 3 * 12


def test_n_greedy_choices_are_equal(client: OpenAI) -> None:
    r = chat(client, POEM, n=3, max_tokens=16, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1


# -- penalties and logit bias -----------------------------------------------------------------------------


def test_penalties_are_exact_under_speculation(client: OpenAI) -> None:
    kw = dict(presence_penalty=1.5, frequency_penalty=1.0, max_tokens=40, **GREEDY)
    prompt = "List the days of the week, one per line."
    spec = chat(client, prompt, **kw, extra_body=SPEC_ON)
    plain = chat(client, prompt, **kw, extra_body=SPEC_OFF)
    assert spec.choices[0].message.content
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert_paths(spec, plain)


@pytest.fixture(scope="module")
def the_id() -> int:
    """The id of " the" in the target's tokenizer."""
    from verispec.models.loader import load_tokenizer, open_source

    ids = load_tokenizer(open_source(TARGET)).encode(" the", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_logit_bias_keeps_a_token_out(client: OpenAI, the_id: int) -> None:
    prompt = "Describe the sun in two sentences."
    kw = dict(logprobs=True, max_tokens=40, **GREEDY)
    free = chat(client, prompt, **kw)
    assert " the" in [e.token for e in _logprob_entries(free)]  # the prompt does call for it
    biased = chat(client, prompt, **kw, logit_bias={str(the_id): -100})
    assert " the" not in [e.token for e in _logprob_entries(biased)], biased.choices[0].message.content
    assert biased.choices[0].message.content != free.choices[0].message.content


# -- bad input -------------------------------------------------------------------------------------------


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strnig"}}}


@pytest.mark.parametrize(("endpoint", "kwargs", "param"), [
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}),
     "response_format"),
    ("chat", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_stock_price"}}),
     "tool_choice"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(n=1000), "n"),
    ("completions", dict(logprobs=6), "logprobs"),
], ids=["schema", "tool_choice", "top_logprobs", "n", "completion_logprobs"])
def test_bad_input_names_the_field(client: OpenAI, endpoint: str, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            chat(client, "Hi", max_tokens=4, **kwargs)
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, **kwargs)
    error = info.value.response.json()["error"]
    assert info.value.status_code == 400
    assert error["param"] == param or error["param"].startswith(param + "."), error


# -- predicted outputs ---------------------------------------------------------------------------------------

CODE = '''def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def main():
    print(add(2, 3), mul(2, 3))
'''


def test_prediction_is_accepted_and_changes_nothing(client: OpenAI) -> None:
    prompt = ("Rename the function `mul` to `multiply` everywhere in this code. Reply with the complete updated code "
              f"only.\n\n```python\n{CODE}```")
    predicted = "```python\n" + CODE.replace("mul(", "multiply(") + "```"
    kw = dict(max_tokens=80, **GREEDY)
    without = chat(client, prompt, **kw)
    with_prediction = chat(client, prompt, **kw, prediction={"type": "content", "content": predicted})
    assert with_prediction.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert with_prediction.choices[0].message.content == without.choices[0].message.content
