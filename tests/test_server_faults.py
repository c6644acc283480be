"""Server faults on tiny random-weight models, each met while the rest of the server stays healthy.

Every fault runs under two watchers: ``/health`` polled every 50 ms from another thread (each answer
200, none taking a second or more), and greedy streaming completions run back to back (chunks never a
second or more apart, each stream finishing with "length", every token, and the text the engine
gives for the prompt alone). The faults: k at the API's maximum (64) as the first speculative request
of a fresh cost-policy server, a multi-megabyte prompt, a body over the server's limit, requests half
sent (head or body), and a drafter raising in one of four running requests.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch
from tiny_server import make_tiny_pair, running_server

import verispec.engine.costs
import verispec.engine.engine
from verispec import Engine
from verispec.config import SpecConfig
from verispec.drafters.base import Drafter, Proposal
from verispec.engine.costs import PROFILE_K
from verispec.sampling import SamplingParams
from verispec.server import ServerConfig, create_app

MODEL = "tiny"
MAX_LEN = 256
FIXED = SpecConfig(k_policy="fixed", method="draft", k=3)
BODY_LIMIT = 8 * 2**20  # over the multi-megabyte prompt below, so that prompt reaches the context check
READ_TIMEOUT = 0.6
LIVENESS_S = 1.0  # the longest a health answer or the gap between two stream chunks may take
POLL_S = 0.05
STREAM_PROMPT = "A stream that outlasts the fault: "
STREAM_TOKENS = 200
K64_PROMPT = "The first speculative request drafts up to"
K64_TOKENS = 120
FAULT_MARKER = "<<inject a drafter fault>>"
BATCH_TOKENS = 120
# The healthy requests sharing the engine with the faulty one, and how each decodes.
BATCH = [("plain decoding goes on", {"enabled": False}),
         ("a drafted request goes on", {"enabled": True, "method": "draft"}),
         ("a looked-up request goes on, goes on", {"enabled": True, "method": "ngram"})]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Expected:
    """What the engine generates greedily for each prompt alone (plain decoding), computed before any server runs."""

    texts: dict[str, str]
    ids: dict[str, list[int]]  # prompt token ids


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("faults_models"))
    return Engine.from_pretrained(str(target), draft=str(draft), dtype="float32", max_len=MAX_LEN, progress=False)


@pytest.fixture(scope="module")
def expected(engine: Engine) -> Expected:
    jobs = [(STREAM_PROMPT, STREAM_TOKENS), (K64_PROMPT, K64_TOKENS)] + [(p, BATCH_TOKENS) for p, _ in BATCH]
    results = engine.generate([p for p, _ in jobs], [_greedy(n) for _, n in jobs])
    for (_, n), r in zip(jobs, results, strict=True):
        assert r.finish_reason == "length" and len(r.token_ids) == n
    return Expected({p: r.text for (p, _), r in zip(jobs, results, strict=True)},
                    {p: r.prompt_token_ids for (p, _), r in zip(jobs, results, strict=True)})


@pytest.fixture(scope="module")
def server(engine: Engine, expected: Expected) -> Iterator[Any]:
    config = ServerConfig(model_name=MODEL, spec=FIXED, max_batch=6, max_body_bytes=BODY_LIMIT,
                          read_timeout_s=READ_TIMEOUT)
    app = create_app(engine, config)
    with running_server(app, config) as srv:
        srv.app_ = app
        yield srv


# -- the watchers ----------------------------------------------------------------------------------


@dataclass
class HealthPolls:
    """Each poll's seconds and outcome (a status code, or the transport error)."""

    polls: list[tuple[float, int | str]] = field(default_factory=list)


@contextmanager
def watch_health(base_url: str) -> Iterator[HealthPolls]:
    """Poll ``GET /health`` every 50 ms (a new connection each time) while the body runs.

    Yields once the first poll has answered; on leaving, at least one more poll runs after the body,
    and every poll must have answered 200 in under :data:`LIVENESS_S`.
    """
    stats, stop, first = HealthPolls(), threading.Event(), threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base_url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            while True:
                t0 = time.monotonic()
                try:
                    outcome: int | str = c.get("/health").status_code
                except httpx.HTTPError as e:
                    outcome = repr(e)
                stats.polls.append((time.monotonic() - t0, outcome))
                first.set()
                if stop.is_set():
                    return
                stop.wait(POLL_S)

    thread = threading.Thread(target=poll, name="health-poll", daemon=True)
    thread.start()
    try:
        assert first.wait(15), "the first health poll did not answer"
        yield stats
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive(), "a health poll hung"
    assert len(stats.polls) >= 2
    bad = [outcome for _, outcome in stats.polls if outcome != 200]
    assert not bad, f"health answered {bad}"
    slowest = max(s for s, _ in stats.polls)
    assert slowest < LIVENESS_S, f"a health poll took {slowest:.2f} s"


@dataclass
class Streams:
    """Arrival times of every chunk over the back-to-back streams, and what went wrong in any of them."""

    chunk_times: list[float] = field(default_factory=list)
    finished: int = 0
    problems: list[str] = field(default_factory=list)


def _stream_once(client: httpx.Client, body: dict[str, Any], text: str, streams: Streams,
                 first: threading.Event) -> None:
    """One streamed completion: record each chunk's arrival; note any way it differs from a whole answer."""
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            streams.problems.append(f"status {r.status_code}: {r.read().decode(errors='replace')}")
            return
        parts: list[str] = []
        finish, usage, done = None, None, False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            streams.chunk_times.append(time.monotonic())
            first.set()
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                streams.problems.append(f"error event: {event}")
                continue
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                parts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    got = "".join(parts)
    path = "speculative" if body["speculative"]["enabled"] else "plain"
    if not done or finish != "length" or usage is None or usage["completion_tokens"] != body["max_tokens"]:
        streams.problems.append(f"{path} stream ended early: [DONE] {done}, finish {finish}, usage {usage}")
    elif got != text:
        at = next((i for i, (a, b) in enumerate(zip(got, text, strict=False)) if a != b), min(len(got), len(text)))
        streams.problems.append(f"{path} stream text differs from the engine's from character {at} on: "
                                f"{got[at:at + 20]!r} instead of {text[at:at + 20]!r}")
    elif usage["speculative"]["path"] != path:
        streams.problems.append(f"a {path} stream ran on the {usage['speculative']['path']} path")
    else:
        streams.finished += 1


@contextmanager
def keep_streaming(base_url: str, text: str, speculative: tuple[bool, ...] = (False, True)) -> Iterator[Streams]:
    """Run greedy streamed completions of :data:`STREAM_PROMPT` back to back while the body runs.

    The streams alternate between the paths in ``speculative`` (lossless: every one must give
    ``text``). Yields once the first chunk has arrived; on leaving, the stream running then is
    read to its end. No gap between chunks (within a stream or across two) may reach
    :data:`LIVENESS_S`, and chunks must still be arriving after the body ended.
    """
    streams, stop, first = Streams(), threading.Event(), threading.Event()

    def run() -> None:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            for i in itertools.count():
                body = {"model": MODEL, "prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                        "speculative": {"enabled": speculative[i % len(speculative)]}}
                try:
                    _stream_once(client, body, text, streams, first)
                except Exception as e:  # noqa: BLE001 (reported on leaving)
                    streams.problems.append(f"the stream broke: {e!r}")
                if streams.problems or stop.is_set():
                    first.set()
                    return

    thread = threading.Thread(target=run, name="background-stream", daemon=True)
    thread.start()
    try:
        assert first.wait(30) and streams.chunk_times, f"the background stream did not start: {streams.problems}"
        yield streams
    finally:
        ended = time.monotonic()
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "the background stream hung"
    assert not streams.problems, streams.problems
    assert streams.finished >= 1
    assert streams.chunk_times[-1] > ended, "the stream had ended before the fault did"
    gaps = [b - a for a, b in zip(streams.chunk_times, streams.chunk_times[1:], strict=False)]
    assert max(gaps) < LIVENESS_S, f"the stream paused {max(gaps):.2f} s"


def _error(r: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object of ``r``, checked for its status, shape, code and param."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["message"] and err["code"] == code and err["param"] == param
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return err


def _raw(server: Any) -> socket.socket:
    port = int(server.base_url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- the faults ------------------------------------------------------------------------------------


def test_k_at_the_api_maximum_as_the_first_speculative_request(engine: Engine, expected: Expected,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(method="draft", k_policy="cost"), max_batch=2)
    app = create_app(engine, config)
    worker_engine = app.state.verispec.worker.engine
    assert worker_engine.costs is None  # fresh: the warm-up is what profiles
    with running_server(app, config) as srv:
        assert worker_engine.costs is not None
        profiled: list[Any] = []

        def no_profiling(*args: Any, **kwargs: Any) -> Any:
            profiled.append(args)
            raise AssertionError("costs were profiled while serving")

        # Past start-up, costs are only ever corrected, never profiled: a request's k never sizes a profile.
        monkeypatch.setattr(Engine, "profile", no_profiling)
        monkeypatch.setattr(verispec.engine.engine, "profile_costs", no_profiling)
        monkeypatch.setattr(verispec.engine.costs, "profile_costs", no_profiling)
        body = {"model": MODEL, "prompt": K64_PROMPT, "max_tokens": K64_TOKENS, "temperature": 0,
                "ignore_eos": True, "speculative": {"enabled": True, "k": 64}}
        # The background stream decodes plainly, so the k=64 request is the first to speculate.
        with watch_health(srv.base_url), keep_streaming(srv.base_url, expected.texts[STREAM_PROMPT], (False,)):
            r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == expected.texts[K64_PROMPT]  # lossless: plain decoding's greedy text
        assert out["choices"][0]["finish_reason"] == "length"
        usage = out["usage"]
        assert usage["completion_tokens"] == K64_TOKENS
        assert usage["speculative"]["path"] == "speculative" and usage["speculative"]["k"] == 64
        assert usage["speculative"]["method"] == "draft"
        assert profiled == []
        # The curves still end where the start-up profile measured them (max_batch rows of PROFILE_K + 1
        # tokens): k=64 is priced by extending them.
        curves = worker_engine.costs.target.curves
        assert max(curves) == config.max_batch
        assert max(curves[config.max_batch].points) == (PROFILE_K + 1) * config.max_batch


def test_a_multi_megabyte_prompt_is_refused_without_tokenizing(server: Any, expected: Expected,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    state = server.app_.state.verispec
    prompt = "x" * (5 * 2**20)
    encoded: list[int] = []
    original = state.engine.encode

    def encode(prompt: Any, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append(len(prompt))
        return original(prompt, *args, **kwargs)

    monkeypatch.setattr(state.engine, "encode", encode)
    with watch_health(server.base_url), keep_streaming(server.base_url, expected.texts[STREAM_PROMPT]):
        r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                       timeout=30)
    err = _error(r, 400, "context_length_exceeded", "prompt")
    assert str(len(prompt)) in err["message"] and str(state.prompt_byte_limit) in err["message"]
    assert encoded and max(encoded) < 1000  # the background streams' prompts only: the long one never was


def test_a_body_over_the_limit_gets_413(server: Any, expected: Expected) -> None:
    prompt = "y" * BODY_LIMIT

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "max_tokens": 4, "prompt": "'
        for _ in range(BODY_LIMIT // 2**16 + 1):
            yield b"z" * 2**16
        yield b'"}'

    with watch_health(server.base_url), keep_streaming(server.base_url, expected.texts[STREAM_PROMPT]):
        declared = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        chunked = httpx.post(f"{server.base_url}/v1/completions", timeout=30, content=chunks(),
                             headers={"content-type": "application/json"})
    assert int(declared.request.headers["content-length"]) > BODY_LIMIT
    assert "content-length" not in chunked.request.headers  # counted as it arrives, not declared
    for r in (declared, chunked):
        err = _error(r, 413, "request_too_large")
        assert str(BODY_LIMIT) in err["message"] and r.headers["connection"] == "close"


def test_half_sent_requests_are_cut_off_at_the_read_timeout(server: Any, expected: Expected) -> None:
    with watch_health(server.base_url), keep_streaming(server.base_url, expected.texts[STREAM_PROMPT]):
        with _raw(server) as head, _raw(server) as body:
            head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", \"prompt\": \"")
            head_reply = _read_all(head)  # the socket's own 10 s timeout raises if the server never cuts it off
            body_reply = _read_all(body)
    assert head_reply == b""  # an unfinished head: the connection is closed, with nothing to answer
    status, _, rest = body_reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", body_reply
    err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == "request_timeout" and f"within {READ_TIMEOUT:g} s" in err["message"]


class _FaultAmongOthers(Drafter):
    """Proposes nothing until its request runs alongside every one of ``others`` (prompt ids), then raises.

    A drafter fault in the middle of a batch: the step it raises in also steps the other requests.
    """

    name = "fault"

    def __init__(self, running: Callable[[], list[list[int]]], others: list[list[int]]) -> None:
        self.running, self.others = running, others
        self.raised_among: list[list[int]] | None = None

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        running = self.running()
        if all(other in running for other in self.others):
            self.raised_among = running
            raise RuntimeError("injected drafter fault")
        return Proposal([])


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_step_fault_fails_one_of_four_requests_alone(server: Any, expected: Expected,
                                                      monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    worker_engine = server.app_.state.verispec.worker.engine
    others = [expected.ids[p] for p, _ in BATCH]
    marker = worker_engine.encode(FAULT_MARKER)
    injected: list[_FaultAmongOthers] = []
    submit = worker_engine.submit

    def running() -> list[list[int]]:
        return [list(req.prompt) for req in worker_engine._running.values()]

    def submit_with_fault(prompt: list[int], *args: Any, **kwargs: Any) -> Any:
        # Only the request whose prompt holds the marker gets the faulty drafter.
        if any(prompt[i:i + len(marker)] == marker for i in range(len(prompt))):
            injected.append(_FaultAmongOthers(running, others))
            kwargs["drafter"] = injected[-1]
        return submit(prompt, *args, **kwargs)

    monkeypatch.setattr(worker_engine, "submit", submit_with_fault)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": BATCH_TOKENS, "temperature": 0, "ignore_eos": True,
               "speculative": spec} for p, spec in BATCH]
    faulty = {"model": MODEL, "prompt": f"this one fails {FAULT_MARKER}", "max_tokens": BATCH_TOKENS,
              "temperature": 0, "ignore_eos": True, "stream": stream, "speculative": {"enabled": True}}
    replies: dict[int, httpx.Response] = {}

    def send(i: int, body: dict[str, Any]) -> None:
        replies[i] = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)

    with watch_health(server.base_url), keep_streaming(server.base_url, expected.texts[STREAM_PROMPT]):
        senders = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate([*bodies, faulty])]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
    assert len(injected) == 1 and injected[0].raised_among is not None, "the fault was never injected"
    assert all(other in injected[0].raised_among for other in others)  # it failed while the others ran
    failed = replies[len(bodies)]
    if stream:  # the stream had started: the error is its last event, then [DONE]
        assert failed.status_code == 200 and failed.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in failed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == {"error": {"message": "the engine failed on this request",
                                                    "type": "server_error", "param": None, "code": "engine_error"}}
        assert all("error" not in json.loads(e) for e in events[:-2])
    else:
        err = _error(failed, 500, "engine_error")
        assert err["message"] == "the engine failed on this request"
    for i, (prompt, spec) in enumerate(BATCH):
        r = replies[i]
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == expected.texts[prompt], spec
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == BATCH_TOKENS
        assert out["usage"]["speculative"]["path"] == ("speculative" if spec["enabled"] else "plain")
    # The engine serves on: a request after the fault, the faulty prompt included, is answered whole.
    monkeypatch.undo()
    again = httpx.post(f"{server.base_url}/v1/completions", json={**faulty, "stream": False}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == BATCH_TOKENS
