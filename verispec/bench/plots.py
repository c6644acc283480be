"""PNG plots of a benchmark report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verispec.bench.stats import OVERALL, STAGE_NAMES, MethodStats


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def speedup_by_category(rows: list[MethodStats], path: Path, title: str, hide: frozenset[str] = frozenset()) -> Path:
    """Grouped bars: speedup over plain decoding per category (and overall), one bar per method not in ``hide``."""
    plt = _pyplot()
    rows = [r for r in rows if r.kind != "baseline" and r.speedup is not None and r.method not in hide]
    methods = list(dict.fromkeys(r.method for r in rows))
    cats = list(dict.fromkeys(r.category for r in rows))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.25 * len(cats) * len(methods) + 4), 4.2))
    for i, meth in enumerate(methods):
        vals = [next((r.speedup for r in rows if r.method == meth and r.category == c), 0.0) for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=meth)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_title(title, fontsize=9)
    if methods:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def acceptance_by_position(rows: list[MethodStats], path: Path, title: str,
                           hide: frozenset[str] = frozenset()) -> Path:
    """Lines: share of drafted tokens accepted at each draft position, per speculative method (overall)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    for r in rows:
        if r.category == OVERALL and r.acceptance_by_position and r.method not in hide:
            xs = list(range(1, len(r.acceptance_by_position) + 1))
            ax.plot(xs, r.acceptance_by_position, marker="o", label=r.method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate at position")
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def stage_breakdown(rows: list[MethodStats], path: Path, title: str) -> Path:
    """Stacked bars: milliseconds per generated token in each stage, per method (overall)."""
    plt = _pyplot()
    rows = [r for r in rows if r.category == OVERALL and r.stage_ms_per_token]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 3), 4.2))
    bottom = [0.0] * len(rows)
    xs = list(range(len(rows)))
    for stage in STAGE_NAMES:
        vals = [r.stage_ms_per_token.get(stage, 0.0) for r in rows]
        ax.bar(xs, vals, 0.6, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(xs, [r.method for r in rows], rotation=20)
    ax.set_ylabel("ms per generated token")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def speedup_vs_k(rows: list[MethodStats], families: dict[str, str], path: Path, title: str) -> Path | None:
    """Lines: overall speedup against k for every method family run at two or more k (None if none was)."""
    plt = _pyplot()
    points: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.category == OVERALL and r.k is not None and r.speedup is not None and r.method in families:
            points.setdefault(families[r.method], []).append((r.k, r.speedup))
    points = {f: sorted(p) for f, p in points.items() if len({k for k, _ in p}) > 1}
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for fam, pts in points.items():
        ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=fam)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def clients_sweep(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Lines per method against the number of clients: total throughput, and request latency p50 / p95
    (rows of :func:`verispec.bench.clients.summarize`; the level ``alone`` is left out). None without a level."""
    plt = _pyplot()
    rows = [r for r in rows if r["clients"] != "alone"]
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        xs = [int(r["clients"]) for r in rs]
        ax1.plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=method)
        line = ax2.plot(xs, [r["latency_p50_s"] for r in rs], marker="o", label=f"{method} p50")[0]
        ax2.plot(xs, [r["latency_p95_s"] for r in rs], marker="x", linestyle="--", color=line.get_color(),
                 label=f"{method} p95")
    levels = sorted({int(r["clients"]) for r in rows})
    for ax, ylabel in ((ax1, "total throughput (tokens/s)"), (ax2, "request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)
