"""Benchmark scripts of bench/ end to end on tiny models (verify_cost: t(M) from the profile), and the
`verispec bench` runs that replaced the scripts which re-implemented its interleaving and repeats (q8 against
the run's kernels, side by side)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verispec import kernels
from verispec.cli import main

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


@pytest.mark.skipif(not (kernels.available() and kernels.q8_available()),
                    reason="8-bit activations need the fast kernels and AVX-512 VNNI")
def test_q8_kernels_side_by_side(tmp_path: Path, chat_pair: tuple[str, str]) -> None:
    """What bench/run_all.sh's q8 step runs: the int4 pair plainly and speculating, on the run's kernels and on q8,
    every method on each prompt in turn, repeats giving each repeat's ratio to plain decoding."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"category": c, "prompt": p}) + "\n" for c, p in (
        ("code", "def add ( x , y ) : return x + y"), ("chat", "what is the cat ?"))))
    out = tmp_path / "q8"
    assert main(["bench", "--model", chat_pair[0], "--draft", chat_pair[1], "--dtype", "bfloat16", "--weights", "int4",
                 "--draft-weights", "int4", "--methods", "none,hybrid,none:kernels=q8,hybrid:kernels=q8",
                 "--dataset", f"jsonl:{data}", "--max-tokens", "6", "--max-len", "96", "--repeats", "2",
                 "--out", str(out), "--no-progress", "--no-plots"]) == 0
    report = json.loads((out / "report.json").read_text())
    ran = {m["label"]: m for m in report["methods"]}
    assert {label: (m["kernels"], m["matmul_kernels"]) for label, m in ran.items()} == {
        "plain": ("auto", "verispec"), "hybrid": ("auto", "verispec"), "none:kernels=q8": ("q8", "verispec"),
        "hybrid:kernels=q8": ("q8", "verispec")}
    assert ran["none:kernels=q8"]["quantized_kernels"] == kernels.quantized_label("q8") != \
        ran["plain"]["quantized_kernels"]
    # Speculation on q8 must reproduce plain decoding on q8; q8's plain outputs against the run's kernels are
    # reported (8-bit activations move the logits a little), with no warning.
    cons = {c["method"]: c for c in report["consistency"]}
    assert cons["hybrid:kernels=q8"]["reference"] == "none:kernels=q8" and cons["hybrid:kernels=q8"]["exact_match"] == 1
    assert cons["none:kernels=q8"]["reference"] == "plain" and cons["none:kernels=q8"]["exact_match"] is not None
    assert not report["warnings"]
    spread = report["repeat_ratios"]["plain"]
    assert all(len(spread[label]["overall"]) == 2 for label in ("hybrid", "none:kernels=q8", "hybrid:kernels=q8"))
