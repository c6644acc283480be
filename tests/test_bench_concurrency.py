"""bench/concurrency.py end to end on tiny models: repeats alternate modes and are summarised by medians."""

from __future__ import annotations

import gc
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "concurrency.py"


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_repeats_report_medians_and_paired_ratios(tmp_path, qwen2_tiny, qwen2_noisy_draft_tiny):
    out = tmp_path / "conc"
    r = run(["--model", qwen2_tiny.path, "--draft", qwen2_noisy_draft_tiny.path, "--dtype", "float32",
             "--device", "cpu", "--max-tokens", "6", "--max-len", "512", "--concurrency", "1,2", "--requests", "3",
             "--repeats", "2", "--once", "fixed", "--out", str(out)])
    if r.returncode != 0 and "question.jsonl" in r.stderr:
        pytest.fail("Spec-Bench prompts missing: " + r.stderr[-500:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((out / "concurrency.json").read_text())["rows"]
    # One request after another through generate ("alone") runs at one client only.
    assert [(x["concurrency"], x["mode"]) for x in rows] == [
        (1, "plain"), (1, "fixed"), (1, "policy"), (1, "alone"), (2, "plain"), (2, "fixed"), (2, "policy")]
    # Each level serves at least two prompts per client: 3 requests at one client, 4 at two.
    assert [x["requests"] for x in rows] == [3] * 4 + [4] * 3
    alone = rows[3]
    assert alone["tokens"] > 0 and alone["policy_k"]
    for x in rows:
        runs = x["runs_tokens_per_s"]
        assert len(runs) == (1 if x["mode"] == "fixed" else 2)
        assert x["tokens_per_s"] in runs  # the row is one real run: the lower median of the repeats
        assert x["tokens_per_s"] == sorted(runs)[(len(runs) - 1) // 2]
        if x["mode"] == "plain":
            assert x["vs_plain_runs"] == [1.0] * 2 and x["vs_plain"] == 1.0
        else:  # each run against plain decoding's run of the same repeat
            plain = next(p for p in rows if p["concurrency"] == x["concurrency"] and p["mode"] == "plain")
            expected = [t / p for t, p in zip(runs, plain["runs_tokens_per_s"], strict=False)]
            assert x["vs_plain_runs"] == pytest.approx(expected)
        # Beyond prefill: the same pairing over the wall time outside the target's prompt prefill,
        # which every mode spends ("alone" included) and which is taken out.
        beyond = x["runs_beyond_prefill_tokens_per_s"]
        assert x["prefill_s"] > 0 and len(beyond) == len(runs)
        assert all(b > t for b, t in zip(beyond, runs, strict=True))
        plain = next(p for p in rows if p["concurrency"] == x["concurrency"] and p["mode"] == "plain")
        expected = [b / p for b, p in zip(beyond, plain["runs_beyond_prefill_tokens_per_s"], strict=False)]
        assert x["beyond_prefill_vs_plain_runs"] == pytest.approx(expected)
        assert x["beyond_prefill_vs_plain"] == pytest.approx(statistics.median(expected))
        # Process-wide costs no stage timer shows: garbage collection and resident memory, per run.
        assert {"gc_s", "gc_collections"} <= set(x) and x["rss_gib"] > 0.01
        # What the draft model read on its own is reported: nothing plainly, every prompt at fixed k.
        if x["mode"] == "plain":
            assert x["catch_up_tokens"] == 0 and x["catch_up_s"] == 0
        elif x["mode"] == "fixed":
            assert x["catch_up_tokens"] > 0 and x["catch_up_s"] > 0
    md = (out / "concurrency.md").read_text()
    assert "2 runs per concurrency and mode" in md and "draft catch-up s (tokens)" in md
    assert "vs plain beyond prefill" in md and "outside the target's prompt prefill" in md
    # Every other repeat runs the modes in reverse order (a drifting host favours no mode).
    order = [line.split()[1:5] for line in r.stdout.splitlines() if line.startswith("C=")]  # C, mode, "run", n
    assert [(m, n) for c, m, _, n in order if c == "1"] == [
        ("plain", "1/2"), ("fixed", "1/2"), ("policy", "1/2"), ("alone", "1/2"),
        ("alone", "2/2"), ("policy", "2/2"), ("plain", "2/2")]


def test_bad_repeat_options_are_refused(tmp_path):
    for bad in (["--repeats", "0"], ["--once", "plain"], ["--modes", "plain,turbo"]):
        r = run([*bad, "--out", str(tmp_path)])
        assert r.returncode == 2 and "--repeats >= 1" in r.stderr, r.stderr[-500:]


def test_gc_clock_counts_collections_only_while_in_use():
    spec = importlib.util.spec_from_file_location("concurrency_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with bench.GcClock() as clock:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after the block: not counted
    assert clock.collections == 2 and clock.seconds > 0
    assert clock not in gc.callbacks
