"""Run several decoding methods over the same prompts, side by side, and summarise.

Methods run prompt by prompt in turn (prompt 1 with every method, then prompt 2, ...), so
slow drifts of a noisy machine hit every method alike; a warm-up generation per method runs
first and is not counted.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from datetime import date
from typing import Any

import torch

from verispec.bench.datasets import BenchPrompt
from verispec.config import SpecConfig
from verispec.engine.engine import Engine, GenerationResult
from verispec.engine.metrics import Metrics
from verispec.sampling import SamplingParams


@dataclass
class Row:
    """One method on one category (or ``overall``)."""

    method: str
    category: str
    prompts: int
    tokens: int
    tokens_per_s: float
    speedup: float
    mean_accepted_length: float
    acceptance_rate: float
    exact_match: float  # share of prompts whose tokens equal the baseline's
    stage_share: dict[str, float]


def run_methods(engine: Engine, prompts: list[BenchPrompt], methods: dict[str, SpecConfig],
                params: SamplingParams, progress: bool = True) -> dict[str, list[GenerationResult]]:
    """Generate every prompt with every method; return the results per method label."""
    from tqdm import tqdm

    warm = prompts[0]
    for spec in methods.values():
        engine.generate(warm.text, SamplingParams(max_tokens=8), spec, chat=warm.chat)
    runs: dict[str, list[GenerationResult]] = {label: [] for label in methods}
    for p in tqdm(prompts, desc="prompts", disable=not progress or None):
        for label, spec in methods.items():
            runs[label].append(engine.generate(p.text, params, spec, chat=p.chat)[0])
    return runs


def summarize(prompts: list[BenchPrompt], runs: dict[str, list[GenerationResult]], baseline: str) -> list[Row]:
    """Per-category and overall rows; speedups are tokens/s ratios against ``baseline``."""
    cats = list(dict.fromkeys(p.category for p in prompts)) + ["overall"]
    base_tps: dict[str, float] = {}
    rows = []
    for label, results in [(baseline, runs[baseline])] + [(k, v) for k, v in runs.items() if k != baseline]:
        for cat in cats:
            idx = [i for i, p in enumerate(prompts) if cat in ("overall", p.category)]
            m = Metrics()
            for i in idx:
                m.merge(results[i].metrics)
            same = sum(results[i].token_ids == runs[baseline][i].token_ids for i in idx)
            if label == baseline:
                base_tps[cat] = m.tokens_per_s
            stage = {**m.stage_s, "other": m.other_s}  # not m.summary(): see harness.acceptance_by_position
            rows.append(Row(label, cat, len(idx), m.generated_tokens, m.tokens_per_s,
                            m.tokens_per_s / base_tps[cat] if base_tps[cat] else 0.0, m.mean_accepted_length,
                            m.acceptance_rate, same / len(idx),
                            {k: v / m.total_s if m.total_s else 0.0 for k, v in stage.items()}))
    return rows


def markdown_table(rows: list[Row]) -> str:
    head = ("| method | category | prompts | tokens/s | speedup | mean accepted length | acceptance | "
            "same tokens as plain |\n|---|---|---:|---:|---:|---:|---:|---:|\n")
    return head + "\n".join(
        f"| {r.method} | {r.category} | {r.prompts} | {r.tokens_per_s:.2f} | {r.speedup:.2f}x | "
        f"{r.mean_accepted_length:.2f} | {r.acceptance_rate:.1%} | {r.exact_match:.0%} |" for r in rows)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import transformers

    from verispec.config import cpu_has_fast_bf16

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": date.today().isoformat(), "cpu": cpu, "threads": torch.get_num_threads(),
            "bf16_native": cpu_has_fast_bf16(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def plot_speedup(rows: list[Row], path: str, title: str) -> None:
    """Bar chart of speedup by category, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r.method for r in rows))
    cats = list(dict.fromkeys(r.category for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cats) + 2), 4))
    for i, meth in enumerate(methods):
        vals = [next((r.speedup for r in rows if r.method == meth and r.category == c), 0.0) for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=meth)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(cats))], cats)
    ax.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rows_as_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
