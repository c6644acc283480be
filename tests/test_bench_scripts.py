"""Benchmark scripts of bench/ end to end on tiny models: sampling_speed (every mode side by side, ratios
against greedy plain decoding's repeat, verification against scoring) and verify_cost (t(M) from the profile)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sampling_speed.py"


def test_modes_side_by_side_with_verify_share(tmp_path, qwen2_tiny, qwen2_noisy_draft_tiny):
    out = tmp_path / "sampling"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", qwen2_tiny.path, "--draft", qwen2_noisy_draft_tiny.path,
                        "--dtype", "float32", "--weights", "dense", "--draft-weights", "dense", "--max-tokens", "6",
                        "--max-len", "512",
                        "--chat-code", "1", "--repeats", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((out / "sampling_speed.json").read_text())["rows"]
    assert [x["mode"] for x in rows] == [
        "plain, greedy", "plain, temperature 0.8", "plain, temperature 0.8, top-p 0.9",
        "hybrid (defaults), greedy", "hybrid (defaults), temperature 0.8, top-p 0.9"]
    assert rows[0]["vs_greedy_runs"] == [1.0, 1.0]
    for x in rows:
        assert len(x["vs_greedy_runs"]) == 2 and x["tokens_per_s"] > 0
        assert x["score_ms_per_step"] > 0 and x["verify_ms_per_step"] > 0
        assert x["verify_over_score"] == pytest.approx(statistics.median(x["verify_over_score_runs"]))
    # Plain decoding makes one token per step, speculation at least one.
    assert [x["mean_accepted_length"] for x in rows[:3]] == [1.0] * 3
    assert all(x["mean_accepted_length"] >= 1.0 for x in rows[3:])
    table = (out / "sampling_speed.md").read_text()
    assert "| plain, greedy |" in table and "verify / score" in table


VERIFY_COST = Path(__file__).resolve().parents[1] / "bench" / "verify_cost.py"


def test_verify_cost_curve_from_the_engine_profile(tmp_path, qwen2_tiny):
    """bench/verify_cost.py reads t(M) for M = 1..m_max from the engine's one-row profile and plots it."""
    r = subprocess.run([sys.executable, str(VERIFY_COST), "--model", qwen2_tiny.path, "--formats", "dense",
                        "--dtype", "float32", "--m-max", "5", "--reps", "1", "--decode-tokens", "0",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    row = json.loads((tmp_path / "verify_cost.json").read_text())["rows"][0]
    assert len(row["t_ms"]) == 5 and all(t > 0 for t in row["t_ms"])
    assert row["ratio"][0] == 1.0 and row["ratio"][4] == pytest.approx(row["t_ms"][4] / row["t_ms"][0])
    assert (tmp_path / "verify_cost.png").is_file() and "| M=5 |" in r.stdout and "M=6" not in r.stdout
