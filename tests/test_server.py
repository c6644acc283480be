"""The HTTP server end to end: a real uvicorn server on a loopback port, tiny models, the openai client."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from tiny_server import make_tiny_pair, metric_value, running_server

from verispec import Engine, SamplingParams
from verispec.config import SpecConfig
from verispec.engine.detok import IncrementalDetokenizer, StreamText
from verispec.errors import VerispecError
from verispec.server import ServerConfig, create_app
from verispec.server.canary import CanaryRouter, routes_to_speculation

MODEL = "tiny"
ADMIN = "test-admin-token"
MAX_LEN = 256
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("server_models"))
    return str(target), str(draft)


@pytest.fixture(scope="module")
def engine(pair: tuple[str, str]) -> Engine:
    return Engine.from_pretrained(pair[0], draft=pair[1], dtype="float32", max_len=MAX_LEN, progress=False)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Any]:
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(k_policy="fixed", method="draft", k=4), spec_fraction=0.5,
                          admin_token=ADMIN, max_queue=64)
    app = create_app(engine, config)
    with running_server(app, config) as srv:
        srv.app_ = app
        yield srv


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: Any) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def spec_usage(obj: Any) -> dict[str, Any]:
    usage = obj.usage.model_dump() if hasattr(obj.usage, "model_dump") else obj.usage
    return usage["speculative"]


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# -- basics --------------------------------------------------------------------------------------


def test_models_and_health(http: httpx.Client, oai: OpenAI) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_LEN
    assert {"draft", "ngram"} <= set(card["speculative_methods"])


def test_completion_is_lossless_and_reports_usage(oai: OpenAI, engine: Engine) -> None:
    kwargs = dict(model=MODEL, prompt="Hello there", max_tokens=24, **GREEDY)
    spec = oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": True}})
    plain = oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": False}})
    ngram = oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": True, "method": "ngram", "k": 3}})
    assert spec.choices[0].text == plain.choices[0].text == ngram.choices[0].text  # greedy speculation is exact
    assert spec.choices[0].finish_reason in ("stop", "length")
    prompt_tokens = len(engine.encode("Hello there"))
    for r in (spec, plain):
        assert r.usage.prompt_tokens == prompt_tokens
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert 1 <= r.usage.completion_tokens <= 24
    s, p, n = spec_usage(spec), spec_usage(plain), spec_usage(ngram)
    assert (s["path"], s["method"], s["k"]) == ("speculative", "draft", 4)
    assert (p["path"], p["method"], p["k"], p["drafted"]) == ("plain", "none", 0, 0)
    assert (n["method"], n["k"]) == ("ngram", 3)
    assert p["mean_accepted_length"] == 1.0
    assert s["drafted"] > 0 and 0 <= s["accepted"] <= s["drafted"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"])
    # Tokens per target forward: each step's accepted drafts plus the target's own token.
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / s["steps"])


def test_chat_completion(oai: OpenAI, engine: Engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert r.usage.prompt_tokens == len(engine.encode(messages, chat=True))
    # Content parts are accepted and mean the same as a plain string.
    parts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                                         {"type": "text",
                                                                                          "text": "there"}]}]
    r2 = oai.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, **GREEDY)
    assert r2.choices[0].message.content == choice.message.content


def test_vanishing_temperature_decodes_greedily(oai: OpenAI) -> None:
    # Found by the fuzzer: dividing logits by 1e-300 overflows, so the server treats it as greedy.
    kwargs = dict(model=MODEL, prompt="Tiny temperature", max_tokens=8)
    tiny = oai.completions.create(**kwargs, temperature=1e-300).choices[0].text
    assert tiny == oai.completions.create(**kwargs, temperature=0).choices[0].text


def test_seeded_sampling_is_reproducible(oai: OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once", max_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
                  extra_body={"speculative": {"enabled": True}})
    a, b = oai.completions.create(**kwargs), oai.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text


def test_n_choices_have_their_own_seed_streams(oai: OpenAI) -> None:
    # Plain decoding: a seeded sample does not depend on what runs beside it (the cost policy's k does).
    kwargs = dict(model=MODEL, prompt="Once", max_tokens=12, temperature=1.0,
                  extra_body={"speculative": {"enabled": False}})
    r = oai.completions.create(**kwargs, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    alone = [oai.completions.create(**kwargs, seed=seed).choices[0].text for seed in (7, 8)]
    assert [c.text for c in r.choices] == alone and alone[0] != alone[1]
    assert r.usage.completion_tokens > 12  # both choices counted
    chunks = list(oai.completions.create(**kwargs, n=2, seed=7, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert streamed == alone
    assert {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason} == {0, 1}


def test_logprobs_are_the_same_with_and_without_drafts(oai: OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello there", max_tokens=16, logprobs=2, **GREEDY)
    runs = [oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": on}}) for on in (True, False)]
    for r in runs:
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == r.usage.completion_tokens  # (the tiny model's bytes need not be whole characters)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)  # (tokens decoding alike share a key)
        assert all(v <= 0 for v in lp.token_logprobs)
    assert spec_usage(runs[0])["accepted"] > 0
    assert runs[0].choices[0].logprobs.tokens == runs[1].choices[0].logprobs.tokens
    assert runs[0].choices[0].logprobs.token_logprobs == pytest.approx(runs[1].choices[0].logprobs.token_logprobs,
                                                                      abs=1e-4)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)


def test_penalties_keep_greedy_speculation_exact(oai: OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello there", max_tokens=24, presence_penalty=1.5, frequency_penalty=1.0,
                  logit_bias={"5": 3.0}, **GREEDY)
    spec, plain = (oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": on}})
                   for on in (True, False))
    assert spec.choices[0].text == plain.choices[0].text
    base = oai.completions.create(model=MODEL, prompt="Hello there", max_tokens=24, **GREEDY)
    assert base.choices[0].text != plain.choices[0].text


# -- streaming -----------------------------------------------------------------------------------


def test_streaming_completion_matches_non_streaming(oai: OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Stream me", max_tokens=40, **GREEDY,
                  extra_body={"ignore_eos": True, "speculative": {"enabled": True}})
    full = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 40
    # A step's accepted tokens travel together: fewer content chunks than tokens.
    assert len([t for t in texts if t]) <= spec_usage(chunks[-1])["steps"] < 40


def test_streaming_chat_with_raw_sse(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "héllo 🌍"}], "max_tokens": 30,
            "stream": True, **GREEDY}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    full = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert streamed == full["choices"][0]["message"]["content"]


def test_detokenizer_never_splits_characters(engine: Engine) -> None:
    tok = engine.tokenizer
    text = "héllo 🌍 wörld ✓ 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    # An unfinished character at the end is flushed as the tokenizer decodes it.
    detok = IncrementalDetokenizer(tok)
    partial = ids[:-1]
    assert "".join(detok.push([i]) for i in partial) + detok.flush() == tok.decode(partial)


def test_stream_text_holds_back_stop_strings(engine: Engine) -> None:
    tok = engine.tokenizer
    ids = tok.encode("abc STOP def", add_special_tokens=False)
    st = StreamText(tok, ("STOP",))
    sent = "".join(st.push([i]) for i in ids)
    assert "S" not in sent and "abc ".startswith(sent)
    assert sent + st.finish("abc ") == "abc "


def test_stop_strings(oai: OpenAI, http: httpx.Client) -> None:
    base = dict(model=MODEL, prompt="Stop test", max_tokens=40, **GREEDY)
    text = oai.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    i = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[i:i + 2]
    cut = text[:text.find(stop)]
    r = oai.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = list(oai.completions.create(**base, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut


# -- errors --------------------------------------------------------------------------------------


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x" * (MAX_LEN + 10)}, 400, "prompt"),
    ({"model": MODEL, "prompt": [MAX_LEN + 9999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, None),
    ({"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "a", "n": 1000}, 400, "n"),
    ({"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "a", "stop": [""]}, 400, None),  # refused by SamplingParams
    ({"model": MODEL, "prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "a", "logprobs": 1, "echo": True}, 400, "echo"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "structured_outputs": {"regex": "a(", "json": {}}}, 400, "structured_outputs"),
    ({"model": MODEL, "prompt": "a", "structured_outputs": {"regex": "a("}}, 400, "structured_outputs"),
    ({"model": MODEL, "prompt": "a", "speculative": {"enabled": True, "method": "nope"}}, 400, "speculative.method"),
    ({"model": MODEL, "prompt": "a", "speculative": {"k": 0}}, 400, "speculative.k"),
    ({"model": MODEL, "prompt": "a", "speculative": {"enable": True}}, 400, None),
    # Integers and booleans are strict, as OpenAI's are.
    ({"model": MODEL, "prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 2.0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": "a", "stream": 1}, 400, "stream"),
    ({"model": MODEL, "prompt": "a", "ignore_eos": "true"}, 400, "ignore_eos"),
    ({"model": MODEL, "prompt": "a", "seed": 1.5}, 400, "seed"),
    ({"model": MODEL, "prompt": "a", "n": True}, 400, "n"),
    ({"model": MODEL, "prompt": "a", "temperature": True}, 400, "temperature"),
    ({"model": MODEL, "prompt": "a", "temperature": "0.5"}, 400, "temperature"),
    ({"model": MODEL, "prompt": [1, True]}, 400, None),
    ({"model": MODEL, "prompt": "a", "speculative": {"k": 2.0}}, 400, "speculative.k"),
    ({"model": MODEL, "prompt": "a", "speculative": {"enabled": "yes"}}, 400, "speculative.enabled"),
    ({"model": MODEL, "prompt": "a", "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ({"prompt": "a"}, 400, "model"),
])
def test_completion_errors(http: httpx.Client, body: dict[str, Any], status: int, param: str | None) -> None:
    _assert_error(http.post("/v1/completions", json=body), status, param)


def test_malformed_requests(http: httpx.Client) -> None:
    err = _assert_error(http.post("/v1/completions", content=b'{"model": ', headers={"content-type":
                                                                                     "application/json"}), 400)
    assert "JSON" in err["message"]
    _assert_error(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard",
                                                                                         "content": "x"}]}), 400)
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400, "messages")
    _assert_error(http.get("/v1/nowhere"), 404)
    _assert_error(http.get("/v1/completions"), 405)
    # A lone surrogate reaches the tokenizer and is refused, not crashed on.
    _assert_error(http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\\ud800"}',
                            headers={"content-type": "application/json"}), 400)


def test_engine_validation_is_what_the_server_applies() -> None:
    # The 400s for sampling values come from verispec's own validation (VerispecError).
    from verispec.sampling import SamplingParams

    with pytest.raises(VerispecError):
        SamplingParams(stop=("",))


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_change_as_expected(http: httpx.Client, oai: OpenAI) -> None:
    spec = {"path": "speculative", "method": "draft"}
    plain = {"path": "plain", "method": "none"}
    before = {name: metric_value(http, name, **spec) for name in (
        "verispec:spec_decode_num_draft_tokens_total", "verispec:spec_decode_num_accepted_tokens_total",
        "verispec:spec_decode_num_accepted_tokens_per_pos_total", "verispec:spec_decode_num_drafts_total",
        "verispec:generation_tokens_total", "verispec:prompt_tokens_total", "verispec:request_success_total",
        "verispec:time_to_first_token_seconds_count", "verispec:e2e_request_latency_seconds_count",
        "verispec:inter_token_latency_seconds_count")}
    plain_before = metric_value(http, "verispec:request_success_total", **plain)
    usages = [oai.completions.create(model=MODEL, prompt=f"metrics {i}", max_tokens=20, **GREEDY,
                                     extra_body={"speculative": {"enabled": True}, "ignore_eos": True}).usage
              for i in range(2)]
    oai.completions.create(model=MODEL, prompt="plain", max_tokens=5, extra_body={"speculative": {"enabled": False}})
    after = {name: metric_value(http, name, **spec) for name in before}
    delta = {name: after[name] - before[name] for name in before}
    drafted = sum(u.model_dump()["speculative"]["drafted"] for u in usages)
    accepted = sum(u.model_dump()["speculative"]["accepted"] for u in usages)
    assert delta["verispec:spec_decode_num_draft_tokens_total"] == drafted
    assert delta["verispec:spec_decode_num_accepted_tokens_total"] == accepted
    assert delta["verispec:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
    assert 0 < delta["verispec:spec_decode_num_drafts_total"] <= drafted
    assert delta["verispec:generation_tokens_total"] == sum(u.completion_tokens for u in usages) == 40
    assert delta["verispec:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert delta["verispec:request_success_total"] == 2
    assert delta["verispec:time_to_first_token_seconds_count"] == 2
    assert delta["verispec:e2e_request_latency_seconds_count"] == 2
    assert delta["verispec:inter_token_latency_seconds_count"] > 0
    assert metric_value(http, "verispec:request_success_total", **plain) == plain_before + 1
    assert metric_value(http, "verispec:num_requests_running") == 0
    assert metric_value(http, "verispec:kv_cache_usage_perc") == 0
    # Every series names its path and method.
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name.startswith("verispec:"):
            for sample in family.samples:
                assert sample.labels.get("path") in ("speculative", "plain"), sample
                assert "method" in sample.labels, sample
    stats = http.get("/stats").json()
    assert stats["paths"]["speculative"]["window"]["acceptance_rate"] is not None
    # Plain decoding makes one token per step, the EOS a last step may make included.
    assert stats["paths"]["plain"]["window"]["mean_accepted_length"] == 1.0


def test_predicted_outputs_through_the_openai_client(http: httpx.Client, oai: OpenAI, engine: Engine) -> None:
    messages = [{"role": "user", "content": "Repeat after me"}]
    spec = {"enabled": True, "method": "draft", "k": 4}  # the fixed k policy: counts that do not depend on timing
    kwargs = dict(model=MODEL, messages=messages, max_tokens=40, **GREEDY,
                  extra_body={"ignore_eos": True, "speculative": spec})
    plain = oai.chat.completions.create(**kwargs)
    answer = plain.choices[0].message.content
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    labels = {"path": "speculative", "outcome": "accepted"}
    before = metric_value(http, "verispec:prediction_tokens_total", **labels)
    # The byte-level tokenizer's random answers are rarely valid UTF-8, so the text a client sees does not
    # tokenize back to the answer everywhere: the engine in process, given the same text, says what to expect.
    alone = engine.generate(engine.encode(messages, chat=True), SamplingParams(max_tokens=40, ignore_eos=True),
                            SpecConfig(method="draft", k=4, k_policy="fixed"), prediction=answer)[0].metrics
    assert alone.accepted_prediction_tokens > 0
    for prediction in (answer, answer[:12] + "something else entirely" + answer[20:], "zzzz qqqq " * 8):
        r = oai.chat.completions.create(**kwargs, prediction={"type": "content", "content": prediction})
        assert r.choices[0].message.content == answer  # a prediction changes the speed, never the answer
        details = r.usage.completion_tokens_details
        if prediction == answer:
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == \
                (alone.accepted_prediction_tokens, alone.rejected_prediction_tokens)
    # Text parts, streamed, on the completions endpoint too.
    parts = [{"type": "text", "text": answer[:10]}, {"type": "text", "text": answer[10:]}]
    chunks = list(oai.chat.completions.create(**kwargs, prediction={"type": "content", "content": parts},
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == alone.accepted_prediction_tokens
    completion = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=20, **GREEDY)
    predicted = {"type": "content", "content": completion.choices[0].text}
    # On the speculative path: routed by the canary, a predicted request on the plain path would draft there.
    again = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=20, **GREEDY,
                                   extra_body={"prediction": predicted, "speculative": spec})
    assert again.choices[0].text == completion.choices[0].text
    assert metric_value(http, "verispec:prediction_tokens_total", **labels) >= \
        before + 2 * alone.accepted_prediction_tokens


@pytest.mark.parametrize("prediction, param", [
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "text", "content": "a"}, "prediction.type"),
    ({"content": "a"}, "prediction.type"),
    ("just a string", "prediction"),
    ({"type": "content", "content": "x" * (2 * MAX_LEN)}, "prediction"),  # one token per byte: past the context
])
def test_bad_predictions_are_a_400_naming_the_field(http: httpx.Client, prediction: Any, param: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions",
                                                               {"messages": [{"role": "user", "content": "a"}]})):
        _assert_error(http.post(path, json={"model": MODEL, "max_tokens": 4, "prediction": prediction, **body}),
                      400, param)


def test_a_plain_request_ending_on_eos_reports_one_token_per_step(http: httpx.Client) -> None:
    # The step that makes the EOS counts, though the EOS is not output: tokens per step stay exactly 1.
    body = {"model": MODEL, "max_tokens": 120, "speculative": {"enabled": False}, **GREEDY}
    for i in range(40):
        r = http.post("/v1/completions", json={**body, "prompt": f"eos {i}"}).json()
        if r["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no prompt ended on EOS")
    usage = r["usage"]
    assert usage["speculative"]["steps"] == usage["completion_tokens"] + 1
    assert usage["speculative"]["mean_accepted_length"] == 1.0
    assert http.get("/stats").json()["paths"]["plain"]["total"]["mean_accepted_length"] == 1.0


# -- canary routing ------------------------------------------------------------------------------


def test_canary_router_statistics() -> None:
    keys = [f"user-{i}" for i in range(20000)]
    for fraction in (0.0, 0.1, 0.5, 0.9, 1.0):
        share = sum(routes_to_speculation(k, fraction) for k in keys) / len(keys)
        assert share == pytest.approx(fraction, abs=0.015)
    # Stable per key, and raising the fraction only moves keys onto speculation.
    low = {k for k in keys if routes_to_speculation(k, 0.3)}
    assert low == {k for k in keys if routes_to_speculation(k, 0.3)}
    assert low <= {k for k in keys if routes_to_speculation(k, 0.6)}
    router = CanaryRouter(0.0)
    assert router.speculate("anyone", override=True) and not router.speculate("anyone")
    with pytest.raises(VerispecError):
        router.set_fraction(1.5)


def _path(oai: OpenAI, user: str | None = None, **extra: Any) -> str:
    r = oai.completions.create(model=MODEL, prompt="route", max_tokens=2, user=user, extra_body=extra or None)
    return spec_usage(r)["path"]


def test_canary_routing_and_admin(http: httpx.Client, oai: OpenAI) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    _assert_error(http.post("/admin/spec-fraction", json={"fraction": 0.2}), 401)
    _assert_error(http.post("/admin/spec-fraction", json={"fraction": 0.2}, headers={"Authorization": "Bearer no"}),
                  403)
    _assert_error(http.post("/admin/spec-fraction", json={"fraction": 1.5}, headers=auth), 400)
    try:
        assert http.post("/admin/spec-fraction", json={"fraction": 0.0}, headers=auth).json()["fraction"] == 0.0
        assert {_path(oai, f"u{i}") for i in range(6)} == {"plain"}
        assert _path(oai, "u1", speculative={"enabled": True}) == "speculative"  # a request may override
        http.post("/admin/spec-fraction", json={"fraction": 1.0}, headers=auth).raise_for_status()
        assert {_path(oai, f"u{i}") for i in range(6)} == {"speculative"}
        assert _path(oai, "u1", speculative={"enabled": False}) == "plain"
        r = http.post("/admin/spec-fraction", json={"fraction": 0.5}, headers=auth).json()
        assert r == {"fraction": 0.5, "previous": 1.0}
        users = [f"canary-{i}" for i in range(12)]
        for user in users:  # each user's path follows the hash, and stays put
            expected = "speculative" if routes_to_speculation(user, 0.5) else "plain"
            assert _path(oai, user) == _path(oai, user) == expected
        assert len({_path(oai, u) for u in users}) == 2
        # Without a user, the client's X-Request-Id is the key.
        rid = next(f"rid-{i}" for i in range(100) if routes_to_speculation(f"rid-{i}", 0.5))
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                      headers={"X-Request-Id": rid})
        assert r.headers["x-request-id"] == rid and r.json()["usage"]["speculative"]["path"] == "speculative"
    finally:
        http.post("/admin/spec-fraction", json={"fraction": 0.5}, headers=auth)


# -- cancellation and load ----------------------------------------------------------------------


def _slow_generate(monkeypatch: pytest.MonkeyPatch, engine: Engine, delay_s: float) -> None:
    """Make every engine step take at least ``delay_s`` (so a test can act mid-generation)."""
    import verispec.engine.engine as engine_module

    original_step = engine_module.speculative_step

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return original_step(*args, **kwargs)

    monkeypatch.setattr(engine_module, "speculative_step", slow_step)


def test_client_disconnect_cancels_the_request(http: httpx.Client, engine: Engine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_generate(monkeypatch, engine, 0.01)
    cancelled = {"finished_reason": "cancelled"}
    before = metric_value(http, "verispec:request_success_total", **cancelled)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True, **GREEDY}
    with httpx.Client(base_url=str(http.base_url), timeout=30) as own:  # its own connection, to close it
        with own.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert metric_value(http, "verispec:num_requests_running") == 1
    # The connection is gone: the engine stops at its next step, long before 200 tokens (2 s here).
    assert wait_until(lambda: metric_value(http, "verispec:request_success_total", **cancelled) == before + 1,
                      timeout=1.5)
    assert metric_value(http, "verispec:num_requests_running") == 0
    assert metric_value(http, "verispec:kv_cache_usage_perc") == 0
    tokens = metric_value(http, "verispec:generation_tokens_total")
    time.sleep(0.1)
    assert metric_value(http, "verispec:generation_tokens_total") == tokens  # nothing runs any more
    # A client that gives up on a non-streamed request frees the engine as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(http.base_url).rstrip("/") + "/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(30, read=0.3))
    assert wait_until(lambda: metric_value(http, "verispec:request_success_total", **cancelled) == before + 2,
                      timeout=1.5)
    assert metric_value(http, "verispec:num_requests_running") == 0


def test_concurrent_requests_are_batched_and_match_alone(server: Any, http: httpx.Client, engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [{"enabled": False}, {"enabled": True, "method": "draft"}, {"enabled": True, "method": "ngram", "k": 3}]
    bodies = [{"model": MODEL, "prompt": f"batch {i} " * (1 + i % 4), "max_tokens": 32, "ignore_eos": i % 2 == 0,
               "speculative": specs[i % 3], **GREEDY} for i in range(6)]

    def send(body: dict[str, Any]) -> tuple[str, int]:
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

    alone = [send(body) for body in bodies]
    before = http.get("/stats").json()["batch"]
    _slow_generate(monkeypatch, engine, 0.01)  # every step lasts long enough for all requests to overlap
    running_seen = []
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(send, body) for body in bodies]
        while not all(f.done() for f in futures):
            running_seen.append(metric_value(http, "verispec:num_requests_running"))
            time.sleep(0.02)
        together = [f.result() for f in futures]
    assert together == alone  # greedy outputs do not depend on batch companions
    after = http.get("/stats").json()["batch"]
    multi = {n: c - before["rows_steps"].get(n, 0) for n, c in after["rows_steps"].items() if int(n) > 1}
    assert sum(multi.values()) > 0, (before, after)  # some steps ran several rows at once
    assert max(running_seen) > 1
    assert after["max_batch"] == ServerConfig(model_name=MODEL).max_batch and after["running"] == 0
    assert after["kv_used_tokens"] == 0 and metric_value(http, "verispec:kv_cache_usage_perc") == 0


def test_load_many_concurrent_clients(server: Any, http: httpx.Client) -> None:
    n_requests, n_clients = 200, 32
    before = metric_value(http, "verispec:request_success_total")

    def one(i: int) -> tuple[int, str]:
        chat = i % 2 == 0
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "user": f"load-{i % 17}", "stream": i % 3 == 0}
        if chat:
            body["messages"] = [{"role": "user", "content": f"request {i}"}]
        else:
            body["prompt"] = f"request {i}"
        if i % 5 == 0:
            body["speculative"] = {"enabled": True, "method": "ngram"}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = client.post(path, json=body)
        if r.status_code == 200 and body["stream"]:
            assert r.text.rstrip().endswith("data: [DONE]")
        return r.status_code, r.text[:200]

    limits = httpx.Limits(max_connections=n_clients, max_keepalive_connections=n_clients)
    with httpx.Client(base_url=server.base_url, timeout=60, limits=limits) as client:
        with ThreadPoolExecutor(n_clients) as pool:
            results = list(pool.map(one, range(n_requests)))
    errors = [r for r in results if r[0] != 200]
    assert not errors, errors[:3]
    assert metric_value(http, "verispec:request_success_total") == before + n_requests
    for gauge in ("verispec:num_requests_running", "verispec:num_requests_waiting", "verispec:kv_cache_usage_perc"):
        assert metric_value(http, gauge) == 0, gauge


# -- fuzzing -------------------------------------------------------------------------------------


def test_fuzz_openapi_schema_finds_no_server_errors(server: Any, http: httpx.Client) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    document = copy.deepcopy(server.app_.openapi())
    # Pin the model name, or nearly every generated request would stop at 404 before the engine.
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        document["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schema = schemathesis.openapi.from_dict(document)
    failures: list[str] = []
    statuses: Counter[tuple[str, int]] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=15, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def fuzz(case: Any) -> None:
                response = case.call(base_url=server.base_url, timeout=30,
                                     headers={"Authorization": f"Bearer {ADMIN}"})
                statuses[case.path, response.status_code] += 1
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.path} -> {response.status_code}: "
                                    f"{case.body!r:.2000} {response.text[:200]}")

            try:
                fuzz()
            except Unsatisfiable:  # nothing invalid to send (a GET without parameters)
                assert mode == GenerationMode.NEGATIVE
    http.post("/admin/spec-fraction", json={"fraction": 0.5}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert not failures, failures[:5]
    # The fuzzer got through validation to the engine, and was turned away with 400s too.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert statuses[path, 200] > 0 and statuses[path, 400] > 0, statuses


# -- overload and shutdown (a second server with a one-slot queue) -------------------------------


@pytest.mark.parametrize("max_batch", [1, 2])
def test_overload_then_graceful_shutdown(pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
                                         max_batch: int) -> None:
    engine = Engine.from_pretrained(pair[0], draft=pair[1], dtype="float32", max_len=MAX_LEN, progress=False)
    _slow_generate(monkeypatch, engine, 0.01)
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(k_policy="fixed", method="draft", k=4),
                          max_batch=max_batch, max_queue=1,
                          retry_after_s=2)
    app = create_app(engine, config)
    long = {"model": MODEL, "prompt": "busy", "max_tokens": 200, "ignore_eos": True, **GREEDY}
    with running_server(app, config) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as client:
        # No admin token configured: the admin endpoint is disabled.
        _assert_error(client.post("/admin/spec-fraction", json={"fraction": 0.1}), 403)
        with ExitStack() as stack:
            streams = []
            for _ in range(max_batch):  # fill every slot
                streaming = stack.enter_context(httpx.Client(base_url=srv.base_url, timeout=30))
                running = stack.enter_context(streaming.stream("POST", "/v1/completions",
                                                               json={**long, "stream": True}))
                lines = running.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # it runs
                streams.append(lines)
            assert metric_value(client, "verispec:num_requests_running") == max_batch
            queued: dict[str, Any] = {}
            waiter = threading.Thread(target=lambda: queued.update(
                r=httpx.post(f"{srv.base_url}/v1/completions", json=long, timeout=30)))
            waiter.start()
            assert wait_until(lambda: metric_value(client, "verispec:num_requests_waiting") == 1)
            refused = client.post("/v1/completions", json=long)
            _assert_error(refused, 429)
            assert refused.headers["retry-after"] == "2"
            # Shut down while requests run and one waits: all end promptly and cleanly.
            t0 = time.monotonic()
            srv.should_exit = True
            rests = [list(sse_events(lines)) for lines in streams]
            waiter.join(10)
        assert time.monotonic() - t0 < 5
        for rest in rests:
            assert "error" in rest[-2] and rest[-1] == "[DONE]"
            assert rest[-2]["error"]["code"] == "shutting_down"
        _assert_error(queued["r"], 503)
        assert wait_until(lambda: app.state.verispec.worker.join(0), timeout=5)


def test_an_unavailable_method_is_a_clean_400_and_layerskip_batches(pair: tuple[str, str]) -> None:
    # No draft model: the server cannot default to "draft", and a request asking for it gets a 400.
    engine = Engine.from_pretrained(pair[0], dtype="float32", max_len=MAX_LEN, progress=False)
    with pytest.raises(VerispecError, match="draft model"):
        create_app(engine, ServerConfig(model_name=MODEL, spec=SpecConfig(k_policy="fixed", method="draft", k=3)))
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(k_policy="fixed", method="ngram", k=3), max_batch=3)
    app = create_app(engine, config)
    assert "draft" not in app.state.verispec.worker.available_methods
    assert "layerskip" in app.state.verispec.worker.available_methods  # each row drafts on its own cache row
    with running_server(app, config) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as client:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 6, "temperature": 0,
                "speculative": {"enabled": True, "method": "draft"}}
        err = _assert_error(client.post("/v1/completions", json=body), 400, "speculative.method")
        assert "draft" in err["message"]
        plain = client.post("/v1/completions", json={**body, "speculative": {"enabled": False}}).json()
        skip = client.post("/v1/completions", json={**body, "speculative": {"method": "layerskip", "k": 2}})
        assert skip.status_code == 200 and skip.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        assert client.get("/stats").json()["batch"]["max_batch"] == 3


# -- the command line ----------------------------------------------------------------------------


def test_cli_serve_runs_and_stops_on_interrupt(pair: tuple[str, str]) -> None:
    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", pair[0], "--draft", pair[1], "--dtype", "float32",
           "--max-len", "128", "-k", "3", "--spec-fraction", "0.5", "--port", str(port), "--served-model-name", MODEL]
    env = {**os.environ, "VERISPEC_ADMIN_TOKEN": ADMIN}
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None  # stop waiting if it died
        assert wait_until(healthy, timeout=90) and proc.poll() is None, proc.communicate(timeout=5)
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "cli", "max_tokens": 4,
                                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(f"{base}/admin/spec-fraction", json={"fraction": 0.25},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.json() == {"fraction": 0.25, "previous": 0.5}
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "Traceback" not in err, err  # uvicorn re-raises the interrupt
        # Start-up progress shows at the default log level: loading, profiling, then where it is ready.
        lines = [line for line in err.splitlines() if line.startswith("verispec: ")]
        starts = [next(i for i, line in enumerate(lines) if line.startswith(f"verispec: {what}"))
                  for what in ("loading ", "warming up: profiling", f"ready on http://127.0.0.1:{port}")]
        assert starts == sorted(starts), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
