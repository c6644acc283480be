"""OpenAI tool calling (verispec/server/tools.py): validation, output parsing, streaming, the template, the grammar."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from llguidance import LLMatcher

from verispec.server.tools import ToolCallStream, ToolError, ToolSpec, parse_tool_calls, parse_tools, template_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = call_text("get_weather", '{"city": "Paris", "days": 3}')
UTC = call_text("get_time", '{"tz": "UTC"}')


def fn(name: str, **params: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **params}}


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(("tools", "choice", "param", "says"), [
    ({"type": "function"}, None, "tools", "list"),
    (["get_weather"], None, "tools[0]", "object"),
    ([{"type": "retrieval"}], None, "tools[0].type", "retrieval"),
    ([{"type": "function"}], None, "tools[0].function", "function"),
    ([WEATHER, fn("get weather")], None, "tools[1].function.name", "get weather"),
    ([fn("x" * 65)], None, "tools[0].function.name", "64"),
    ([fn("")], None, "tools[0].function.name", "64"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name", "None"),
    ([WEATHER, TIME, fn("get_weather")], None, "tools[2].function.name", "twice"),
    ([fn("f", description=5)], None, "tools[0].function.description", "string"),
    ([fn("f", strict="yes")], None, "tools[0].function.strict", "boolean"),
    ([fn("f", parameters=["a"])], None, "tools[0].function.parameters", "object"),
    ([fn("f", parameters={"type": "string"})], None, "tools[0].function.parameters", "'string'"),
    ([WEATHER, fn("f", parameters={"type": "object", "properties": {"a": {"type": "foo"}}})], None,
     "tools[1].function.parameters", "foo"),
    ([fn("f", parameters={"type": "object", "properties": {"a": {"not": {"type": "string"}}}})], None,
     "tools[0].function.parameters", "not"),
    ([fn("f", parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}})], None,
     "tools[0].function.parameters", "Missing"),
    ([fn("f", parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}})],
     None, "tools[0].function.parameters", "look-around"),
    (TOOLS, "always", "tool_choice", "always"),
    (TOOLS, 5, "tool_choice", "function"),
    (TOOLS, {"type": "function"}, "tool_choice", "function"),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "tool_choice", "get_news"),
    (TOOLS, {"type": "other", "function": {"name": "get_time"}}, "tool_choice", "function"),
    (None, "required", "tool_choice", "needs tools"),
    (None, "auto", "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "get_time"}}, "tool_choice", "needs tools"),
    (None, {"type": "function", "function": {"name": "none"}}, "tool_choice", "needs tools"),
    ([fn("auto"), fn("f")], {"type": "function", "function": {"name": "auto"}}, "tool_choice", "required"),
    ([fn("f")], {"type": "function", "function": {"name": "required"}}, "tool_choice", "not among"),
    ([fn("f", parameters={"type": ["object", "null"]})], None, "tools[0].function.parameters", "object"),
])
def test_invalid_tools_and_choices_name_their_param(tools: Any, choice: Any, param: str, says: str) -> None:
    with pytest.raises(ToolError) as e:
        parse_tools(tools, choice)
    assert e.value.param == param
    assert says in e.value.message and says in str(e.value)
    assert isinstance(e.value, ValueError)


def test_no_tools_is_no_spec() -> None:
    assert parse_tools(None, None) is None
    assert parse_tools([], None) is None
    assert parse_tools(None, "none") is None


def test_spec_defaults_and_template_tools() -> None:
    spec = parse_tools([WEATHER, {"type": "function", "function": {"name": "ping"}}], None)
    assert spec is not None and spec.choice == "auto"
    assert [t.name for t in spec.tools] == ["get_weather", "ping"]
    assert spec.tools[1].parameters == {"type": "object", "properties": {}} and spec.tools[1].description is None
    assert spec.template_tools() == [WEATHER, {"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    assert spec.grammar() is None
    none = parse_tools(TOOLS, "none")
    assert none is not None and none.choice == "none" and none.template_tools() is None and none.grammar() is None
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named.choice == "get_time" and len(named.template_tools() or []) == 2
    assert parse_tools(TOOLS, "required").choice == "required"  # type: ignore[union-attr]
    spec.tools[1].parameters["properties"]["x"] = {}
    assert parse_tools([fn("ping")], None).tools[0].parameters["properties"] == {}  # type: ignore[union-attr]
    # strict and an untyped object schema are accepted; so are functions named like choices, unless forced
    assert parse_tools([fn("auto"), fn("none")], "required").choice == "required"  # type: ignore[union-attr]
    assert parse_tools([fn("f", strict=True, parameters={"properties": {"a": {"type": "string"}}})], "auto")


def test_grammars_compile() -> None:
    for choice in ("required", "get_time", "get_weather"):
        named = {"type": "function", "function": {"name": choice}}
        spec = parse_tools(TOOLS, choice if choice == "required" else named)
        assert spec is not None
        grammar = spec.grammar()
        assert grammar is not None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        assert not is_error and all("special_token" in m for m in messages)  # the tags need a tokenizer to check
        assert LLMatcher.validate_grammar_with_warnings(spec.grammar(tags_as_tokens=False) or "") == (False, [])


# -- parsing output ----------------------------------------------------------------------------

SPEC = ToolSpec(parse_tools(TOOLS, None).tools, "auto")  # type: ignore[union-attr]


def functions(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_one_call() -> None:
    content, calls = parse_tool_calls(PARIS, SPEC)
    assert content is None
    assert functions(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0]["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    assert isinstance(calls[0]["function"]["arguments"], str)


def test_two_calls_have_distinct_ids() -> None:
    content, calls = parse_tool_calls(PARIS + "\n" + UTC + "\n", SPEC)
    assert content is None
    assert functions(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
    assert calls[0]["id"] != calls[1]["id"]


def test_malformed_or_unknown_calls_stay_content() -> None:
    bad_json = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": }\n</tool_call>"
    unknown = call_text("get_news", "{}")
    assert parse_tool_calls(bad_json, SPEC) == (bad_json, [])
    assert parse_tool_calls(unknown, SPEC) == (unknown, [])
    not_object = call_text("get_time", "[1]")
    assert parse_tool_calls(not_object, SPEC) == (not_object, [])
    content, calls = parse_tool_calls(bad_json + "\n" + UTC, SPEC)
    assert content == bad_json and functions(calls) == [("get_time", {"tz": "UTC"})]
    unclosed = "Let me check.\n<tool_call>\n{\"name\": \"get_time\""
    assert parse_tool_calls(unclosed, SPEC) == (unclosed, [])


def test_content_around_calls() -> None:
    content, calls = parse_tool_calls("Let me check the weather.\n" + PARIS, SPEC)
    assert content == "Let me check the weather." and functions(calls) == [("get_weather", {"city": "Paris",
                                                                                            "days": 3})]
    content, calls = parse_tool_calls("First:\n" + PARIS + "\nThen the time.\n" + UTC + "\n", SPEC)
    assert content == "First:\nThen the time." and len(calls) == 2
    plain = "  No tools needed.\n"
    assert parse_tool_calls(plain, SPEC) == (plain, [])


def test_lenient_call_shapes() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>',
                                SPEC)
    assert functions(calls) == [("get_time", {"tz": "CET"})]
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time"}</tool_call>', SPEC)
    assert functions(calls) == [("get_time", {})]
    _, calls = parse_tool_calls(call_text("get_weather", '{"city": "Zürich"}'), SPEC)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_nothing_is_parsed_under_none() -> None:
    spec = ToolSpec(SPEC.tools, "none")
    assert parse_tool_calls(PARIS, spec) == (PARIS, [])
    stream = ToolCallStream(spec)
    assert stream.feed(PARIS) == [("content", PARIS)] and stream.finish() == []


# -- streaming ---------------------------------------------------------------------------------

SAMPLES = [
    PARIS,
    PARIS + "\n" + UTC,
    PARIS + "\n" + UTC + "\n\n",
    "Let me check the weather.\n" + PARIS,
    "First:\n" + PARIS + "\nThen the time.\n" + UTC + " ",
    "  leading and trailing space  \n",
    "",
    "a < b and <tool but not a call <tool_cal",
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": }\n</tool_call>\n" + UTC,
    call_text("get_news", "{}") + "\n" + PARIS,
    "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\"",
    PARIS + "\n<tool_call>\n{\"name\": \"get_time\"",
    "x</tool_call>" + PARIS + "<tool_call><tool_call>" + UTC,
    PARIS + "trailing",
    "\n\n" + UTC + "\t\n" + PARIS,
]


def run_stream(chunks: list[str], spec: ToolSpec = SPEC) -> tuple[str | None, list[dict[str, Any]]]:
    stream = ToolCallStream(spec)
    events = [e for c in chunks for e in stream.feed(c)] + stream.finish()
    content = "".join(e[1] for e in events if e[0] == "content")  # type: ignore[misc]
    calls = [e for e in events if e[0] == "tool_call"]
    for n, (_, index, delta) in enumerate(calls):  # type: ignore[misc]
        assert index == n == delta["index"] and delta["type"] == "function"
        assert re.fullmatch(r"call_[0-9a-f]{24}", delta["id"])
    assert stream.calls == len(calls)
    return (content or None) if calls else content, [c[2] for c in calls]  # type: ignore[misc]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_matches_parse_for_any_chunking(text: str) -> None:
    want_content, want_calls = parse_tool_calls(text, SPEC)
    rng = random.Random(text)
    chunkings = [[text], list(text)] + [random_chunks(text, rng) for _ in range(30)]
    for chunks in chunkings:
        assert "".join(chunks) == text
        content, calls = run_stream(chunks)
        assert content == want_content, chunks
        assert functions(calls) == functions(want_calls), chunks


def test_stream_holds_back_a_possible_tag() -> None:
    stream = ToolCallStream(SPEC)
    assert stream.feed("Sure. <tool") == [("content", "Sure.")]
    assert stream.feed("_call>\n{\"name\": \"get_time\", ") == []
    assert stream.feed("\"arguments\": {\"tz\": \"UTC\"}}\n</tool_") == []
    [(kind, index, delta)] = stream.feed("call>\n")
    assert (kind, index) == ("tool_call", 0)
    assert delta["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    assert set(delta) == {"index", "id", "type", "function"}
    assert stream.feed("Done") == [("content", "\nDone")]
    assert stream.feed(" <b>") == [("content", " <b>")]
    assert stream.feed(" <") == []
    assert stream.finish() == [("content", " <")]
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("more")


# -- chat history ------------------------------------------------------------------------------

HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "}, {"type": "text", "text": "and time?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
    {"role": "assistant", "content": "Sunny and 21 C; it is 14:05."},
]


def test_template_messages_shapes() -> None:
    out = template_messages(HISTORY)
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[1] == {"role": "user", "content": "Weather in Paris and time?"}
    assert out[2]["content"] is None
    assert out[2]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert out[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    assert out[4]["content"] == "14:05" and out[5] == HISTORY[5]
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input left alone


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": "}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                        "arguments": "{}"}},
                                           {"id": "d", "type": "function"}]}], "messages[0].tool_calls[1].function"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": "f()"}], "messages[0].tool_calls"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    (["hi"], "messages[0]"),
])
def test_template_messages_errors_name_their_param(messages: list[Any], param: str) -> None:
    with pytest.raises(ToolError) as e:
        template_messages(messages)
    assert e.value.param == param


# -- the real tokenizer (Qwen2.5-Coder's chat template and vocabulary) ---------------------------

TARGET = "qwen2.5-coder-1.5b-instruct"


@pytest.fixture(scope="module")
def qwen() -> tuple[Any, Any]:
    """The target's Hugging Face tokenizer and its llguidance tokenizer."""
    import llguidance.hf

    from verispec import hub
    from verispec.models.loader import load_tokenizer, open_source

    if not hub.is_installed(TARGET):
        pytest.fail(f"real model {TARGET} not installed; run: make models")
    tok = load_tokenizer(open_source(TARGET))
    return tok, llguidance.hf.from_tokenizer(tok)


def model_tokens(tok: Any, text: str) -> list[int]:
    """``text`` as the model sees and writes it: added tokens such as ``<tool_call>`` whole, no BOS."""
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.real
def test_tool_call_tags_are_single_added_tokens(qwen: tuple[Any, Any]) -> None:
    tok, ll = qwen
    for tag in ("<tool_call>", "</tool_call>"):
        [tid] = model_tokens(tok, tag)
        assert tok.convert_ids_to_tokens(tid) == tag
        assert tag not in tok.all_special_tokens  # Hugging Face: not special, kept when decoding ...
        assert tok.decode([tid], skip_special_tokens=True) == tag
        assert ll.is_special_token(tid)  # ... but llguidance lexes it as a special token, never as text


@pytest.mark.real
def test_template_renders_history_and_tools(qwen: tuple[Any, Any]) -> None:
    tok, _ = qwen
    spec = parse_tools(TOOLS, "auto")
    assert spec is not None
    text = tok.apply_chat_template(template_messages(HISTORY), tools=spec.template_tools(), tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for tool in TOOLS:
        assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n" in text
    assert "<|im_start|>user\nWeather in Paris and time?<|im_end|>\n" in text
    calls = (call_text("get_weather", '{"city": "Paris"}') + "\n" + call_text("get_time", '{"tz": "CET"}'))
    assert "<|im_start|>assistant\n" + calls + "<|im_end|>\n" in text
    assert ("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n14:05\n"
            "</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\nSunny and 21 C; it is 14:05.<|im_end|>\n<|im_start|>assistant\n")
    # what the template teaches parses back to the calls it rendered
    _, parsed = parse_tool_calls(calls, spec)
    assert functions(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert [c["function"]["arguments"] for c in parsed] == ['{"city": "Paris"}', '{"tz": "CET"}']
    none = parse_tools(TOOLS, "none")
    plain = tok.apply_chat_template(template_messages(HISTORY[:2]), tools=none.template_tools(),  # type: ignore
                                    tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in plain


def accepted(ll: Any, grammar: str, tokens: list[int]) -> int:
    """How many of ``tokens`` the grammar lets through."""
    matcher = LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.validate_tokens(tokens)


def assert_complete(ll: Any, grammar: str, tokens: list[int]) -> None:
    matcher = LLMatcher(ll, grammar)
    assert matcher.validate_tokens(tokens) == len(tokens)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    assert matcher.consume_token(ll.eos_token) and not matcher.is_error()  # the model may end its turn here


@pytest.mark.real
def test_grammar_for_a_named_function(qwen: tuple[Any, Any]) -> None:
    tok, ll = qwen
    spec = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    grammar = spec.grammar()  # type: ignore[union-attr]
    assert grammar is not None
    for good in (PARIS, call_text("get_weather", '{"city": "Zürich"}')):
        assert_complete(ll, grammar, model_tokens(tok, good))
    bad = [UTC,  # another listed function than the one named
           call_text("get_wether", '{"city": "Paris"}'),  # wrong name
           call_text("get_weather", '{"city": 5}'),  # wrong type
           call_text("get_weather", '{"city": "Paris", "days": 0}'),  # below the minimum
           call_text("get_weather", '{"days": 2}'),  # missing the required city
           call_text("get_weather", '{"city":"Paris"}'),  # not the template's JSON layout
           PARIS + "\n" + PARIS,  # one call only
           "The weather in Paris is sunny."]
    for text in bad:
        tokens = model_tokens(tok, text)
        assert accepted(ll, grammar, tokens) < len(tokens), text
    # the tag spelled out as text ("<", "tool", "_call", ">") is not the model's token: refused
    spelled = model_tokens(tok, "<") + model_tokens(tok, "tool_call>")
    assert accepted(ll, grammar, spelled) == 0


@pytest.mark.real
def test_grammar_for_required(qwen: tuple[Any, Any]) -> None:
    tok, ll = qwen
    spec = parse_tools(TOOLS, "required")
    grammar = spec.grammar()  # type: ignore[union-attr]
    assert grammar is not None
    for good in (PARIS, UTC, PARIS + "\n" + UTC, UTC + "\n" + UTC + "\n" + PARIS):
        tokens = model_tokens(tok, good)
        assert_complete(ll, grammar, tokens)
        assert functions(parse_tool_calls(good, spec)[1])  # and what it forces parses as calls
    bad = [call_text("get_news", "{}"),
           call_text("get_time", '{"tz": "PST"}'),  # not in the enum
           call_text("get_time", '{"tz": "UTC", "dst": true}'),  # additionalProperties: false
           PARIS + UTC,  # calls are separated by a newline
           "Let me check.\n" + PARIS,  # no content before the calls
           ""]
    for text in bad:
        tokens = model_tokens(tok, text)
        if tokens:
            assert accepted(ll, grammar, tokens) < len(tokens), text
    matcher = LLMatcher(ll, grammar)
    assert not matcher.is_accepting()  # at least one call


@pytest.mark.real
def test_the_template_rendered_calls_satisfy_the_grammar(qwen: tuple[Any, Any]) -> None:
    """The assistant turn the template renders from a history is exactly what the grammar forces."""
    tok, ll = qwen
    spec = parse_tools(TOOLS, "required")
    history = [{"role": "user", "content": "hi"}, HISTORY[2]]
    prompt = tok.apply_chat_template(template_messages(history[:1]), tools=spec.template_tools(),  # type: ignore
                                     tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(template_messages(history), tools=spec.template_tools(),  # type: ignore
                                   tokenize=False)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    answer = full[len(prompt):-len("<|im_end|>\n")]
    assert_complete(ll, spec.grammar(), model_tokens(tok, answer))  # type: ignore[union-attr, arg-type]


def test_without_parallel_calls_one_call_at_most() -> None:
    spec = parse_tools(TOOLS, "required", parallel=False)
    assert spec is not None and not spec.parallel
    assert "start: call\n" in spec.grammar() and '("\\n" call)*' not in spec.grammar()
    text = ('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, spec)
    assert len(calls) == 1 and "CET" in (content or "")
    stream = ToolCallStream(spec)
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert sum(e[0] == "tool_call" for e in events) == 1
    assert len(parse_tool_calls(text, parse_tools(TOOLS, "required"))[1]) == 2
