"""The dashboard in headless Chromium: it loads with no network but the server, polls /stats and draws data."""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_server import make_tiny_pair, running_server

from verispec import Engine
from verispec.config import SpecConfig
from verispec.server import ServerConfig, create_app

CHROMIUM = "/usr/bin/chromium"  # Debian's; `make test` installs it. Playwright never downloads a browser here.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
DOCS_SHOT = ROOT / "docs" / "dashboard.png"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("dashboard_models"))
    engine = Engine.from_pretrained(str(target), draft=str(draft), dtype="float32", max_len=256, progress=False)
    config = ServerConfig(model_name="tiny", spec=SpecConfig(k_policy="fixed", method="draft", k=4), spec_fraction=0.5)
    with running_server(create_app(engine, config), config) as srv:
        yield srv


def _request(client: httpx.Client, i: int) -> None:
    body: dict[str, Any] = {"model": "tiny", "prompt": f"dashboard {i}", "max_tokens": 24 + i % 17,
                            "ignore_eos": True, "temperature": 0.7, "seed": i, "user": f"user-{i}"}
    client.post("/v1/completions", json=body).raise_for_status()


def test_dashboard_page_is_self_contained(server: Any) -> None:
    html = httpx.get(f"{server.base_url}/dashboard").text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"@import|url\(", html)


def test_dashboard_charts_show_data(server: Any, tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (`make chromium` installs it)")
    from playwright.sync_api import sync_playwright

    stop = threading.Event()
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for i in range(12):  # both paths have finished requests before the page opens
            _request(client, i)

        def traffic() -> None:
            for i in range(12, 400):  # bounded; stops as soon as the screenshot is taken
                if stop.is_set():
                    return
                _request(client, i)

        background = threading.Thread(target=traffic, daemon=True)
        background.start()
        urls: list[str] = []
        try:
            with sync_playwright() as p:
                context = p.chromium.launch_persistent_context(
                    str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                    viewport={"width": 1280, "height": 860})
                try:
                    page = context.new_page()
                    page.on("request", lambda r: urls.append(r.url))
                    page.goto(f"{server.base_url}/dashboard?interval=250")
                    # Every chart has several polled points, and both paths have a line on the latency chart.
                    page.wait_for_function(
                        "() => [...document.querySelectorAll('svg.chart')]"
                        ".every(s => Number(s.dataset.points) >= 6)", timeout=20000)
                    assert page.locator("#chart-latency polyline").count() == 4  # p50 and p95 of both paths
                    assert page.locator("#chart-mal polyline").count() == 2
                    assert re.search(r"speculative \d\.\d\d", page.inner_text("#latest-acceptance"))
                    assert page.locator("#paths tbody tr").count() == 2
                    assert "error" not in page.inner_text("#status")
                    ARTIFACTS.mkdir(exist_ok=True)
                    shot = ARTIFACTS / "dashboard.png"
                    page.screenshot(path=str(shot), full_page=True)
                finally:
                    context.close()
        finally:
            stop.set()
            background.join(30)
    assert shot.stat().st_size > 10_000
    # The README's picture is refreshed only on request, so test runs do not rewrite a tracked file.
    if not DOCS_SHOT.exists() or os.environ.get("VERISPEC_UPDATE_DOCS") == "1":
        DOCS_SHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SHOT)
    assert urls and all(u.startswith(server.base_url) for u in urls), [u for u in urls if
                                                                       not u.startswith(server.base_url)][:3]
