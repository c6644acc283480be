"""Benchmark scripts of bench/ end to end on tiny models: sampling_speed (every mode side by side, ratios
against greedy plain decoding's repeat, verification against scoring), verify_cost (t(M) from the profile) and
q8_speed (both kernels side by side)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from verispec import kernels

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


Q8_SPEED = Path(__file__).resolve().parents[1] / "bench" / "q8_speed.py"


@pytest.mark.skipif(not (kernels.available() and kernels.q8_available()),
                    reason="8-bit activations need the fast kernels and AVX-512 VNNI")
def test_q8_speed_side_by_side(tmp_path, qwen2_tiny, qwen2_noisy_draft_tiny):
    """bench/q8_speed.py decodes every prompt under both kernels, plainly and with the defaults, and divides
    each method's tokens/s by the bf16 kernels' per repeat."""
    r = subprocess.run([sys.executable, str(Q8_SPEED), "--model", qwen2_tiny.path, "--draft",
                        qwen2_noisy_draft_tiny.path, "--dtype", "bfloat16", "--weights", "int4", "--draft-weights",
                        "int4", "--max-tokens", "6", "--max-len", "512", "--per-set", "1", "--repeats", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((tmp_path / "q8_speed.json").read_text())
    rows = {(x["kernels"], x["method"]): x for x in data["rows"]}
    assert list(rows) == [(kern, method) for kern in ("auto", "q8") for method in ("plain", "hybrid (defaults)")]
    for (kern, method), x in rows.items():
        assert len(x["vs_auto_runs"]) == 2 and x["tokens_per_s"] > 0 and x["decode_tokens_per_s"] >= x["tokens_per_s"]
        if kern == "auto":
            assert x["vs_auto_runs"] == [1.0, 1.0]
        assert x["mean_accepted_length"] == 1.0 if method == "plain" else x["mean_accepted_length"] >= 1.0
    assert data["prompts"] == 6 + 3 and 0 <= data["plain_identical"] <= data["prompts"]
    assert "| q8 | hybrid (defaults) |" in (tmp_path / "q8_speed.md").read_text()
