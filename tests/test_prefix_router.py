"""The replicas' router and ingress without Ray: block hashing, the routing rule, retries and stream failures."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from verispec.errors import VerispecError
from verispec.server import ServerConfig
from verispec.server.ingress import REPLICA_HEADER, Ingress, IngressConfig, ReplicaGone
from verispec.server.prefix_router import PrefixRouter, RouterConfig, block_hashes
from verispec.server.replica_host import Forwarded

ROOT = Path(__file__).resolve().parent.parent


def test_block_hashes_are_chained_over_full_blocks() -> None:
    text = "abcdefghij" * 4  # 40 characters
    a = block_hashes(text, 16)
    assert len(a) == 2  # the last 8 characters make no block
    b = block_hashes(text[:16] + "X" + text[17:], 16)
    assert a[0] == b[0] and a[1] != b[1]
    c = block_hashes(text[16:32] + text[:16], 16)
    assert c[1] != a[0]  # the same block after another prefix hashes differently
    assert block_hashes("\ud800" * 16, 16)  # a lone surrogate (valid JSON) is hashed, not an error


def test_block_hashes_are_the_same_in_every_process() -> None:
    code = "from verispec.server.prefix_router import block_hashes; print(block_hashes('héllo wörld ' * 20))"
    runs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert runs == {f"{block_hashes('héllo wörld ' * 20)}\n"}


def ready_router(n: int, **config: Any) -> PrefixRouter:
    router = PrefixRouter(n, RouterConfig(**config))
    for i in range(n):
        router.report(i, load=0, held=[])
    return router


CONVERSATION = "".join(chr(ord("a") + i % 26) for i in range(256))


def test_longest_cached_prefix_wins() -> None:
    router = ready_router(3, block_chars=16)
    h = router.hashes(CONVERSATION)
    router.report(1, load=0, held=h[:4])  # replica 1's cache holds 4 blocks of it
    router.sent(2, h[:10])  # replica 2 was just sent 10 blocks of it
    router.finished(2)
    choice = router.choose(h)
    assert (choice.replica, choice.reason, choice.matched_blocks) == (2, "prefix", 10)
    # A prompt that diverges after 4 blocks matches 4 blocks on both: the less loaded one of them.
    other = router.hashes(CONVERSATION[:64] + "0123456789" * 10)
    router.sent(2, [])  # one request in flight on 2
    assert router.choose(other).replica == 1


def test_a_report_replaces_what_was_sent_before_it_was_asked_for() -> None:
    router = ready_router(2, block_chars=16)
    old, new = router.hashes(CONVERSATION), router.hashes(CONVERSATION[::-1])
    router.sent(0, old)
    since = router.clock  # the report is asked for now ...
    router.sent(0, new)  # ... and this request reaches replica 0 after it was taken
    router.report(0, load=0, held=[], since=since)  # replica 0 no longer holds the first prompt
    assert router.matched(0, old) == 0
    assert router.matched(0, new) == len(new)


def test_user_then_load_when_no_prefix_is_cached() -> None:
    router = ready_router(3, block_chars=16)
    router.sent(2, [], user="alice")
    router.finished(2)
    fresh = router.hashes("an unseen prompt, long enough to make blocks")
    assert router.choose(fresh, user="alice").reason == "user"
    assert router.choose(fresh, user="alice").replica == 2
    router.report(0, load=3, held=[])
    choice = router.choose(fresh, user="bob")
    assert (choice.replica, choice.reason) == (1, "load")


def test_affinity_yields_to_load_past_the_imbalance() -> None:
    router = ready_router(2, block_chars=16, max_imbalance=2)
    h = router.hashes(CONVERSATION)
    router.report(0, load=2, held=h)
    assert router.choose(h).replica == 0  # 2 busier than replica 1: within the bound
    router.report(0, load=3, held=h)
    assert router.choose(h).replica == 1  # past it: the least loaded


def test_a_replica_taken_out_is_skipped_and_forgotten() -> None:
    router = ready_router(2, block_chars=16)
    h = router.hashes(CONVERSATION)
    router.sent(0, h, user="alice")
    router.mark_down(0)
    assert router.healthy() == [1]
    assert router.choose(h, user="alice").replica == 1
    assert router.choose(h, exclude=[1]) is None
    router.report(0, load=0, held=[])  # back: its cache starts empty
    assert router.matched(0, h) == 0


@pytest.mark.parametrize("bad", [dict(block_chars=0), dict(min_match_blocks=0), dict(max_imbalance=-1),
                                 dict(max_users=0)])
def test_router_config_is_validated(bad: dict[str, int]) -> None:
    with pytest.raises(VerispecError):
        RouterConfig(**bad)


# -- the ingress over a fake fleet ----------------------------------------------------------------


def _answer(status: int, body: bytes, content_type: bytes) -> list[dict[str, Any]]:
    return [{"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]},
            {"type": "http.response.body", "body": body, "more_body": False}]


class FakeFleet:
    """Replicas scripted per index: "ok" answers, "dead" raises ReplicaGone at once, "dies-mid-stream"
    sends its head and one event and then raises."""

    def __init__(self, behaviour: list[str]) -> None:
        self.behaviour = behaviour
        self.size = len(behaviour)
        self.calls: list[int] = []
        self.closed: list[int] = []

    async def forward(self, replica: int, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
        self.calls.append(replica)
        kind = self.behaviour[replica]
        try:
            if kind == "dead":
                raise ReplicaGone("gone")
            if kind == "raises":
                raise RuntimeError("a bug in the replica")
            if kind == "dies-mid-stream":
                yield {"type": "http.response.start", "status": 200,
                       "headers": [(b"content-type", b"text/event-stream")]}
                yield {"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True}
                raise ReplicaGone("gone")
            for message in _answer(200, json.dumps({"replica": replica}).encode(), b"application/json"):
                yield message
        finally:
            self.closed.append(replica)

    async def report(self, replica: int) -> dict[str, Any]:
        if self.behaviour[replica] == "dead":
            raise ReplicaGone("gone")
        return {"ready": True, "state": "ready", "load": 0, "blocks": [], "requests": 0, "slots": 1}

    async def metrics(self, replica: int) -> bytes:
        return b""


async def _serve(fleet: FakeFleet, requests: list[tuple[str, dict[str, Any], dict[str, str]]]) -> list[httpx.Response]:
    ingress = Ingress(fleet, ServerConfig(model_name="m"), config=IngressConfig(report_interval_s=0.05))
    for i in range(fleet.size):
        ingress.router.report(i, load=0, held=[])
    transport = httpx.ASGITransport(app=ingress.asgi)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        out = [await client.post(path, json=body, headers=headers) for path, body, headers in requests]
    await ingress.stop()
    return out


def test_a_request_whose_replica_died_before_answering_is_retried() -> None:
    fleet = FakeFleet(["dead", "ok"])
    (r,) = asyncio.run(_serve(fleet, [("/v1/completions", {"model": "m", "prompt": "x"}, {})]))
    assert r.status_code == 200 and r.json() == {"replica": 1}
    assert r.headers[REPLICA_HEADER] == "1"
    assert fleet.calls == [0, 1]


def test_no_replica_left_is_a_503_not_a_hang() -> None:
    fleet = FakeFleet(["dead", "dead"])
    (r,) = asyncio.run(_serve(fleet, [("/v1/completions", {"model": "m", "prompt": "x"}, {})]))
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    assert "retry-after" in r.headers


def test_a_stream_that_loses_its_replica_ends_with_an_error_event() -> None:
    fleet = FakeFleet(["dies-mid-stream", "ok"])
    (r,) = asyncio.run(_serve(fleet, [("/v1/completions", {"model": "m", "prompt": "x", "stream": True},
                                       {REPLICA_HEADER: "0"})]))
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0]) == {"choices": []}
    assert json.loads(events[1])["error"]["code"] == "replica_failed"
    assert events[-1] == "[DONE]"
    assert fleet.calls == [0]  # started streams are not retried


def test_a_replica_that_raises_fails_the_request_alone() -> None:
    fleet = FakeFleet(["raises", "ok"])
    pinned = ("/v1/completions", {"model": "m", "prompt": "x"}, {REPLICA_HEADER: "0"})
    rs = asyncio.run(_serve(fleet, [pinned, pinned]))
    assert rs[0].status_code == 500 and rs[0].json()["error"]["code"] == "replica_error"
    assert rs[1].status_code == 500  # not 503: replica 0 was not taken out of routing for one failed request
    assert fleet.calls == [0, 0]


def test_pinning_names_a_replica() -> None:
    fleet = FakeFleet(["ok", "ok", "ok"])
    rs = asyncio.run(_serve(fleet, [("/v1/completions", {"model": "m", "prompt": "x"}, {REPLICA_HEADER: "2"}),
                                    ("/v1/completions", {"model": "m", "prompt": "x"}, {REPLICA_HEADER: "x"})]))
    assert rs[0].json() == {"replica": 2}
    assert rs[1].status_code == 400


def test_replicas_without_ray_say_how_to_install_it(tmp_path: Path) -> None:
    # ray hidden from the import system: the CLI must answer with one line, not a traceback.
    code = ("import sys; sys.modules['ray'] = None; from verispec.cli import main; "
            "sys.exit(main(['serve', '--model', sys.argv[1], '--replicas', '2']))")
    model = tmp_path / "no-such-model-needed"
    model.mkdir()
    proc = subprocess.run([sys.executable, "-c", code, str(model)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'verispec[replicas]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_router_bench_reports_its_percentiles(tmp_path: Path) -> None:
    from tiny_server import make_tiny_pair

    target, _ = make_tiny_pair(tmp_path / "models")
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "bench" / "replicas.py"), "router", "--model", str(target),
                    "--replicas", "2", "--chats", "4", "--turns", "2", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    result = json.loads((out / "router.json").read_text())
    assert result["requests"] == 8 and sum(result["decisions"].values()) == 8
    assert result["decisions"]["prefix"] >= 4  # every second turn finds its first turn's blocks
    for key in ("total_ms", "parse_and_render_ms", "hash_and_choose_ms", "tokenizing_instead_ms"):
        assert 0 < result[key]["p50"] <= result[key]["p99"] <= result[key]["max"]
    assert result["machine"]["cpu"]
