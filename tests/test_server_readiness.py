"""Readiness: /health and the /v1 endpoints answer 503 `loading` until the start-up warm-up (cost profiling) ends,
which profiles for the server's k, never a request's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from tiny_server import make_tiny_pair, running_server

from verispec import Engine
from verispec.config import SpecConfig
from verispec.engine.costs import PROFILE_K
from verispec.server import ServerConfig, create_app

MODEL = "tiny"
MAX_LEN = 256
BODY = {"model": MODEL, "prompt": "ready?", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("readiness_models"))
    return str(target), str(draft)


def _engine(pair: tuple[str, str]) -> Engine:
    return Engine.from_pretrained(pair[0], draft=pair[1], dtype="float32", max_len=MAX_LEN, progress=False)


def _loading(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "loading" and r.headers["retry-after"] == "3"


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_health_is_loading_until_the_warm_up_ends(pair: tuple[str, str], caplog: pytest.LogCaptureFixture,
                                                  max_batch: int) -> None:
    caplog.set_level(logging.INFO, logger="verispec")
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(k_policy="fixed", method="draft", k=3),
                          max_batch=max_batch, retry_after_s=3)
    app = create_app(_engine(pair), config)
    worker = app.state.verispec.worker
    release, started = threading.Event(), threading.Event()
    seen_k: list[int] = []

    def slow_warm_up(k_max: int) -> None:
        seen_k.append(k_max)
        started.set()
        assert release.wait(30)

    worker.warm_up = slow_warm_up
    with running_server(app, config, wait_ready=False) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        assert started.wait(10)
        _loading(c.get("/health"))  # the event loop answers while the warm-up runs
        _loading(c.post("/v1/completions", json=BODY))
        _loading(c.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": "hi"}]}))
        _loading(c.get("/v1/models"))
        assert c.get("/metrics").status_code == 200 and c.get("/stats").status_code == 200
        assert "ready on" not in caplog.text
        release.set()
        assert _wait(lambda: c.get("/health").status_code == 200)
        assert c.get("/health").json() == {"status": "ok"}
        assert c.post("/v1/completions", json=BODY).status_code == 200
        port = srv.base_url.rsplit(":", 1)[1]
        assert _wait(lambda: f"ready on http://127.0.0.1:{port}" in caplog.text)
    assert seen_k == [PROFILE_K]  # the server's k (3) is under PROFILE_K
    assert caplog.text.index("listening on") < caplog.text.index("ready on")


def test_a_failed_warm_up_keeps_the_server_unready(pair: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(k_policy="fixed", method="ngram", k=3))
    app = create_app(_engine(pair), config)

    def broken(k_max: int) -> None:
        raise RuntimeError("no device")

    app.state.verispec.worker.warm_up = broken
    with running_server(app, config) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        for r in (c.get("/health"), c.post("/v1/completions", json=BODY)):
            assert r.status_code == 503 and r.json()["error"]["code"] == "warm_up_failed"
            assert "no device" in r.json()["error"]["message"]
    assert "the warm-up failed" in caplog.text


def _count_profiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record each k_max an engine profiles for."""
    seen: list[int] = []
    original = Engine.profile

    def profile(self: Any, k_max: int = PROFILE_K, *a: Any, **k: Any) -> Any:
        seen.append(k_max)
        return original(self, k_max, *a, **k)

    monkeypatch.setattr(Engine, "profile", profile)
    return seen


@pytest.mark.parametrize("max_batch, k", [(1, 3), (2, 3), (2, 12)])
def test_costs_are_profiled_at_start_up_for_the_servers_k_only(pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
                                                               max_batch: int, k: int) -> None:
    engine = _engine(pair)
    seen = _count_profiles(monkeypatch)
    config = ServerConfig(model_name=MODEL, spec=SpecConfig(method="draft", k=k, k_policy="cost"),
                          max_batch=max_batch)
    app = create_app(engine, config)
    k_max = max(PROFILE_K, k)
    with running_server(app, config) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert seen == [k_max]  # once, for the server's k, whatever the slots
        # A request asking for a far larger k is priced by extending the curves, not by profiling again.
        for method in ("draft", "ngram"):
            r = c.post("/v1/completions", json={**BODY, "max_tokens": 8,
                                                "speculative": {"enabled": True, "method": method, "k": 64}})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["speculative"]["k"] == 64
        assert seen == [k_max]


def test_fixed_k_servers_profile_nothing(pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(pair)
    seen = _count_profiles(monkeypatch)
    for max_batch in (1, 2):
        config = ServerConfig(model_name=MODEL, spec=SpecConfig(method="draft", k=4, k_policy="fixed"),
                              max_batch=max_batch)
        with running_server(create_app(engine, config), config) as srv:
            assert httpx.get(f"{srv.base_url}/health").status_code == 200
    assert seen == []
