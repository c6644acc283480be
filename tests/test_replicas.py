"""Replicas on Ray Serve end to end: 2 replicas of a tiny model on a local Ray, one ingress, the openai client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_dashboard import CHROMIUM, CHROMIUM_ARGS
from tiny_server import make_tiny_pair

ray = pytest.importorskip("ray")

from verispec.config import SpecConfig  # noqa: E402
from verispec.errors import VerispecError  # noqa: E402
from verispec.server import ServerConfig  # noqa: E402
from verispec.server.ingress import REPLICA_HEADER  # noqa: E402
from verispec.server.replicas import ReplicasConfig, app_builder, shutdown, start, wait_ready  # noqa: E402

MODEL = "tiny"
MAX_LEN = 4096
GREEDY = {"temperature": 0}
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    # Wide enough that prefilling a few thousand tokens dominates a request's fixed costs (the hops
    # through Ray), so time to first token shows what prefix reuse saves.
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("replica_models"), layers=4, dim=256,
                                   max_positions=MAX_LEN)
    return str(target), str(draft)


@pytest.fixture(scope="class")
def cluster(pair: tuple[str, str]) -> Iterator[SimpleNamespace]:
    port = free_port()
    server = ServerConfig(model_name=MODEL, port=port, spec=SpecConfig(k_policy="fixed", method="draft", k=4),
                          max_batch=4, max_queue=64)
    config = ReplicasConfig(replicas=2, model=pair[0], draft=pair[1], server=server,
                            engine={"dtype": "float32", "max_len": MAX_LEN}, replica_cpus=0, threads=1)
    handle, started_ray = start(config, num_cpus=2)
    try:
        assert wait_ready(handle, config), "the replicas did not become ready"
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", config=config)
    finally:
        shutdown(started_ray)


@pytest.fixture(scope="class")
def http(cluster: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="class")
def oai(cluster: SimpleNamespace) -> OpenAI:
    return OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120)


def replicas(http: httpx.Client) -> list[dict[str, Any]]:
    return http.get("/stats").json()["replicas"]


def first_token_s(http: httpx.Client, messages: list[dict[str, str]], headers: dict[str, str] | None = None
                  ) -> tuple[float, int]:
    """Seconds to the first generated token of a streamed chat answer (its first chunk with log-probabilities:
    every generated token has them, while its text may wait for more bytes), and the replica that answered."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True, "logprobs": True, **GREEDY}
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as response:
        assert response.status_code == 200
        replica = int(response.headers[REPLICA_HEADER])
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"] and chunk["choices"][0].get("logprobs"):
                    elapsed = time.perf_counter() - t0
                    break
        else:
            raise AssertionError("the stream ended without a token")
        for _ in lines:  # read to the end: the replica is idle again afterwards
            pass
    return elapsed, replica


class TestTwoReplicas:
    def test_openai_client_through_the_ingress(self, http: httpx.Client, oai: OpenAI) -> None:
        assert http.get("/health").json() == {"status": "ok"}
        assert [m.id for m in oai.models.list().data] == [MODEL]
        kwargs = dict(model=MODEL, prompt="Hello there", max_tokens=12, **GREEDY)
        spec = oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": True}})
        plain = oai.completions.create(**kwargs, extra_body={"speculative": {"enabled": False}})
        assert spec.choices[0].text == plain.choices[0].text  # greedy speculation is exact on a replica too
        assert spec.usage.model_dump()["speculative"]["method"] == "draft"
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           **GREEDY)
        assert chat.choices[0].finish_reason in ("stop", "length")
        chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=8, stream=True, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        # Errors are the single server's, status and body.
        missing = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        invalid = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "invalid_request_error"
        too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert http.post("/v1/completions", content=b"{").status_code == 400
        big = http.post("/v1/completions", content=b"x" * (ServerConfig.max_body_bytes + 1),
                        headers={"content-type": "application/json"})
        assert big.status_code == 413
        pinned = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                           headers={REPLICA_HEADER: "7"})
        assert pinned.status_code == 400 and pinned.json()["error"]["param"] == REPLICA_HEADER
        admin = http.post("/admin/spec-fraction", json={"fraction": 0.5}, headers={"Authorization": "Bearer x" * 9})
        assert admin.status_code == 403 and admin.json()["error"]["code"] == "admin_disabled"

    def test_32_concurrent_requests_without_errors(self, http: httpx.Client, oai: OpenAI) -> None:
        before = {r["replica"]: r["requests"] for r in replicas(http)}

        def one(i: int) -> tuple[str, str]:
            if i % 4 == 3:  # a quarter streamed
                chunks = list(oai.completions.create(model=MODEL, prompt=f"request {i} " * 8, max_tokens=16,
                                                     stream=True, **GREEDY))
                return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason
            r = oai.completions.create(model=MODEL, prompt=f"request {i} " * 8, max_tokens=16, **GREEDY)
            return r.choices[0].text, r.choices[0].finish_reason

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        assert len(results) == 32 and all(reason in ("stop", "length") for _, reason in results)
        after = {r["replica"]: r["requests"] for r in replicas(http)}
        served = {i: after[i] - before[i] for i in after}
        assert sum(served.values()) == 32
        assert all(n > 0 for n in served.values()), served  # distinct prompts spread over both replicas by load

    def test_metrics_stats_and_dashboard_cover_the_replicas(self, http: httpx.Client) -> None:
        stats = http.get("/stats").json()
        assert [r["replica"] for r in stats["replicas"]] == [0, 1]
        for r in stats["replicas"]:
            assert r["ready"] and r["slots"] == 4 and r["requests"] > 0
            assert 0 <= r["acceptance_rate"] <= 1
        total = sum(r["requests"] for r in stats["replicas"])
        assert sum(p["total"]["requests"] for p in stats["paths"].values()) == total
        assert stats["batch"]["max_batch"] == 8
        router = stats["router"]
        assert sum(router["decisions"].values()) > 0 and router["overhead_p99_s"] is not None
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        done = families["verispec:request_success"]
        by_replica = {s.labels["replica"]: 0.0 for s in done.samples}
        for s in done.samples:
            if s.name.endswith("_total"):
                by_replica[s.labels["replica"]] += s.value
        assert by_replica == {str(r["replica"]): float(r["requests"]) for r in stats["replicas"]}
        assert "verispec:router_overhead_seconds" in families
        page = http.get("/dashboard")
        assert page.status_code == 200 and 'id="replicas"' in page.text

    def test_dashboard_lists_the_replicas(self, cluster: SimpleNamespace, tmp_path: Path) -> None:
        if not Path(CHROMIUM).exists():
            pytest.skip(f"{CHROMIUM} is missing (`make chromium` installs it)")
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                           headless=True, args=CHROMIUM_ARGS)
            try:
                page = context.new_page()
                page.goto(f"{cluster.url}/dashboard?interval=250")
                page.wait_for_function("() => document.querySelectorAll('#replicas tbody tr').length === 2",
                                       timeout=30_000)
                rows = page.eval_on_selector_all("#replicas tbody tr",
                                                 "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
                assert page.is_visible("#replicas-card")
                assert "routed by prefix" in page.text_content("#router")
            finally:
                context.close()
        assert [(r[0], r[1]) for r in rows] == [("0", "ready"), ("1", "ready")]
        assert all(int(r[7]) > 0 for r in rows)  # requests: both served the concurrent batch

    def test_follow_up_lands_on_its_prefix_and_starts_5x_sooner(self, http: httpx.Client) -> None:
        # A byte-level tokenizer: a character is a token, so this is a prompt of about 3,500 tokens.
        long = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(64))
        first = [{"role": "user", "content": long}]
        # The first turn is pinned to replica 1: on idle replicas, routing by load alone would pick replica 0.
        answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": first, "max_tokens": 8,
                                                         **GREEDY}, headers={REPLICA_HEADER: "1"})
        assert answer.status_code == 200
        home = int(answer.headers[REPLICA_HEADER])
        assert home == 1
        # Once the home replica has reported its cache (it holds the whole first turn), routing rests on
        # that report: the ingress drops its own record of what it sent before the report was asked for.
        assert wait_until(lambda: replicas(http)[home]["cached_blocks"] >= len(long) // 64, 30)
        follow = [*first, {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and then?"}]
        before = http.get("/stats").json()["router"]["decisions"]["prefix"]
        warm_s, replica = first_token_s(http, follow)
        assert replica == home  # routed to the replica whose cache holds the conversation ...
        assert http.get("/stats").json()["router"]["decisions"]["prefix"] == before + 1  # ... for that reason
        cold_s, other = first_token_s(http, follow, headers={REPLICA_HEADER: str(1 - home)})
        assert other == 1 - home
        assert cold_s >= 5 * warm_s, (warm_s, cold_s)
        assert replicas(http)[home]["prefix_reused_tokens"] >= len(long)

    def test_a_client_that_leaves_cancels_its_request_on_the_replica(self, http: httpx.Client,
                                                                    cluster: SimpleNamespace) -> None:
        body = {"model": MODEL, "prompt": "leave", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=cluster.url, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=body) as stream:
            replica = int(stream.headers[REPLICA_HEADER])
            lines = stream.iter_lines()  # held: closing the iterator would close the response
            assert next(line for line in lines if line.startswith("data: {"))
            assert replicas(http)[replica]["running"] == 1
        # The connection is closed: the ingress cancels the request on its replica, whose slot is free again.
        assert wait_until(lambda: replicas(http)[replica]["running"] == 0, 30)
        text = http.get("/metrics").text
        cancelled = [f for f in text_string_to_metric_families(text) if f.name == "verispec:request_success"][0]
        assert any(s.labels["replica"] == str(replica) and s.labels["finished_reason"] == "cancelled"
                   and s.name.endswith("_total") and s.value >= 1 for s in cancelled.samples)

    def test_a_killed_replica_loses_no_request_and_is_replaced(self, http: httpx.Client, oai: OpenAI) -> None:
        pids = {r["replica"]: r["pid"] for r in replicas(http)}
        # A long stream in flight, then non-streamed requests on both replicas; then the stream's replica dies.
        body = {"model": MODEL, "prompt": "stream", "max_tokens": 3000, "ignore_eos": True, "stream": True,
                "speculative": {"enabled": False}}
        with ThreadPoolExecutor(16) as pool, http.stream("POST", "/v1/completions", json=body) as stream:
            victim = int(stream.headers[REPLICA_HEADER])
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            # Long enough that some are still running (or waiting) on the victim when it dies.
            futures = [pool.submit(oai.completions.create, model=MODEL, prompt=f"load {i} " * 8, max_tokens=128,
                                   extra_body={"ignore_eos": True}, **GREEDY) for i in range(12)]
            assert wait_until(lambda: replicas(http)[victim]["running"] >= 2, 60)
            os.kill(pids[victim], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]  # ends: no hang
            results = [f.result(timeout=180) for f in futures]
        errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[0]["error"]["code"] == "replica_failed", rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 128
                   for r in results)  # none lost, none cut short
        assert http.get("/stats").json()["router"]["retries"] >= 1
        # Ray Serve starts a new process for the dead replica; the ingress routes to it again once it is ready.
        assert wait_until(lambda: all(r["ready"] for r in replicas(http))
                          and replicas(http)[victim]["pid"] not in (None, pids[victim]), 180)
        r = oai.completions.create(model=MODEL, prompt="after", max_tokens=4, **GREEDY,
                                   extra_headers={REPLICA_HEADER: str(victim)})
        assert r.choices[0].finish_reason in ("stop", "length")


def test_application_builder_for_serve_run_and_kuberay(pair: tuple[str, str]) -> None:
    app = app_builder({"model": pair[0], "draft": pair[1], "replicas": "3", "max_len": "512"})
    assert type(app).__name__ == "Application"
    with pytest.raises(VerispecError, match="needs model"):
        app_builder({"replicas": "2"})
    with pytest.raises(VerispecError, match="unknown application arguments: colour"):
        app_builder({"model": pair[0], "colour": "red"})


@pytest.mark.parametrize("bad", [dict(replicas=0), dict(replica_cpus=-1), dict(threads=0),
                                 dict(engine={"device": "cuda"}), dict(engine={"draft_device": "cuda:1"})])
def test_replicas_config_is_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(VerispecError):
        ReplicasConfig(**{"replicas": 2, "model": "m", "server": ServerConfig(model_name=MODEL), **bad})


def test_a_model_that_cannot_load_fails_before_ray_starts(tmp_path: Path) -> None:
    server = ServerConfig(model_name=MODEL, port=free_port())
    with pytest.raises(VerispecError):
        start(ReplicasConfig(replicas=2, model=str(tmp_path / "missing"), server=server))
    assert not ray.is_initialized()


def test_ctrl_c_stops_every_process(pair: tuple[str, str]) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", pair[0], "--draft", pair[1], "--dtype",
           "float32", "--max-len", "512", "--replicas", "2", "--replica-cpus", "0", "--replica-threads", "1",
           "--port", str(port), "--method", "draft", "-k", "4", "--k-policy", "fixed"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        assert wait_until(lambda: any("ready on" in line for line in lines) or proc.poll() is not None, 240), \
            "the replicated server did not become ready"
        assert proc.poll() is None, "".join(lines)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert client.get("/health").json() == {"status": "ok"}
            assert len(client.get("/stats").json()["replicas"]) == 2
            r = client.post("/v1/completions", json={"model": pair[0], "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200
        family = psutil.Process(proc.pid).children(recursive=True)
        assert len(family) >= 4  # Ray's own processes, the proxy, the ingress and the replicas
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
