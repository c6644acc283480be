"""``verispec bench --clients`` on tiny models: N clients in flight at once, repeats alternating the methods,
summarised by medians and paired ratios to plain decoding."""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from verispec.bench import clients
from verispec.bench.report import CLIENTS_REPORT_KEYS
from verispec.cli import main


def _prompts(path: Path, n: int) -> Path:
    words = ["what is the cat ?", "say 3 things", "write code to print hello world", "def add ( x , y ) :"]
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": words[i % len(words)]}) + "\n" for i in range(n)))
    return path


def test_clients_sweep_runs_n_clients_at_once(chat_pair: tuple[str, str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    most_in_flight: dict[int, int] = {}
    runs: list[tuple[str, str]] = []
    closed_loop, one_at_a_time = clients.closed_loop, clients.one_at_a_time

    def spy_loop(be: Any, prompts: list[list[int]], n: int, params: Any, spec: Any) -> dict[str, Any]:
        step = be.step
        peak = 0

        def counting_step() -> bool:
            nonlocal peak
            peak = max(peak, be.num_running + be.num_waiting)
            return step()

        be.step = counting_step
        try:
            out = closed_loop(be, prompts, n, params, spec)
        finally:
            del be.step
        if params.max_tokens > 8:  # a timed run, not the warm-up
            most_in_flight[n] = max(most_in_flight.get(n, 0), peak)
            runs.append((str(n), spec.method if spec.enabled else "none"))
        return out

    def spy_alone(engine: Any, prompts: list[list[int]], params: Any, spec: Any) -> dict[str, Any]:
        if params.max_tokens > 8:
            runs.append(("alone", spec.method if spec.enabled else "none"))
        return one_at_a_time(engine, prompts, params, spec)

    monkeypatch.setattr(clients, "closed_loop", spy_loop)
    monkeypatch.setattr(clients, "one_at_a_time", spy_alone)
    out = tmp_path / "conc"
    rc = main(["bench", "--model", chat_pair[0], "--draft", chat_pair[1], "--methods", "none,draft:policy=fixed,k=3",
               "--dataset", f"jsonl:{_prompts(tmp_path / 'p.jsonl', 3)}", "--clients", "alone,1,2", "--repeats", "2",
               "--max-tokens", "10", "--dtype", "float32", "--max-len", "96", "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert set(CLIENTS_REPORT_KEYS) <= set(report) and report["prompts"] == 3
    rows = report["clients"]
    assert [(x["clients"], x["method"]) for x in rows] == [
        (level, method) for level in ("alone", "1", "2") for method in ("plain", "draft:policy=fixed,k=3")]
    # Each level serves at least two requests per client: the 3 prompts at one client, 4 at two.
    assert [x["requests"] for x in rows] == [3, 3, 3, 3, 4, 4]
    # Two clients really keep two requests in flight, steps of two rows; one client one.
    assert most_in_flight == {1: 1, 2: 2}
    two = [x for x in rows if x["clients"] == "2"]
    assert all(1.0 < x["mean_rows"] <= 2.0 for x in two)
    assert all(x["mean_rows"] == 1.0 for x in rows if x["clients"] == "1")
    # Every other repeat runs the methods in reverse order (a drifting host favours none).
    assert runs[:4] == [("alone", "none"), ("alone", "draft"), ("alone", "draft"), ("alone", "none")]
    assert runs[4:8] == [("1", "none"), ("1", "draft"), ("1", "draft"), ("1", "none")]
    for x in rows:
        tps = x["runs_tokens_per_s"]
        assert len(tps) == 2 and x["tokens_per_s"] == sorted(tps)[0]  # the lower median: one real run
        plain = next(p for p in rows if p["clients"] == x["clients"] and p["method"] == "plain")
        assert x["vs_plain_runs"] == pytest.approx([t / p for t, p in zip(tps, plain["runs_tokens_per_s"],
                                                                          strict=True)])
        # Beyond prefill: the same pairing over the wall time outside the target's prompt prefill.
        beyond = x["runs_beyond_prefill_tokens_per_s"]
        assert x["prefill_s"] > 0 and all(b > t for b, t in zip(beyond, tps, strict=True))
        assert x["beyond_prefill_vs_plain"] == pytest.approx(statistics.median(
            b / p for b, p in zip(beyond, plain["runs_beyond_prefill_tokens_per_s"], strict=True)))
        assert {"gc_s", "gc_collections"} <= set(x) and x["rss_bytes"] > 2**20
        if x["clients"] != "alone":  # what the draft model read on its own: nothing plainly
            assert (x["catch_up_tokens"] > 0) == (x["method"] != "plain")
    fixed = next(x for x in rows if x["clients"] == "2" and x["method"] != "plain")
    assert fixed["accepted_per_step"] > 1.0 and {int(w) for w in fixed["width"]} <= {1, 2, 3, 4}
    md = (out / "report.md").read_text()
    assert "| clients | method |" in md and "vs plain beyond prefill" in md and "2 runs per level" in md
    assert report["plots"] == ["clients.png"] and (out / "clients.png").read_bytes()[:4] == b"\x89PNG"


def test_clients_levels_and_options_are_checked(chat_pair: tuple[str, str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert clients.parse_clients("alone,1,2,2,8") == [clients.ALONE, 1, 2, 8]
    assert [clients.level_name(c) for c in (0, 4)] == ["alone", "4"]
    base = ["bench", "--model", chat_pair[0], "--out", str(tmp_path), "--dataset", "humaneval", "--n", "1"]
    assert main([*base, "--clients", "0"]) == 2
    assert main([*base, "--clients", "2", "--stability"]) == 2
    err = capsys.readouterr().err
    assert "'alone'" in err and "--clients runs the closed-loop sweep alone" in err
    assert clients.served([[1], [2], [3]], 4) == [[1], [2], [3], [1], [2], [3], [1], [2]]


def test_gc_clock_counts_collections_only_while_in_use() -> None:
    with clients.GcClock() as clock:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after the block: not counted
    assert clock.collections == 2 and clock.seconds > 0
    assert clock not in gc.callbacks
