"""Per-category and overall figures of each method, from the per-prompt records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from verispec.bench.harness import Item, Record, metrics_dict
from verispec.engine.metrics import STAGES, Metrics

OVERALL = "overall"
STAGE_NAMES = (*STAGES, "other")


@dataclass(frozen=True)
class MethodStats:
    """One method on one category (or ``overall``).

    ``tokens_per_s`` is generated tokens over summed wall time; ``speedup`` its ratio to the
    baseline's on the same prompts (Spec-Bench's convention). Speculation figures are None for
    methods that do not report them (plain decoding, peer libraries).
    """

    method: str
    kind: str  # "baseline", "verispec" or "peer"
    category: str
    prompts: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None
    mean_ttft_s: float | None
    mean_accepted_length: float | None  # tokens per target forward (1.0 for plain decoding)
    acceptance_rate: float | None
    acceptance_by_position: list[float] = field(default_factory=list)
    stage_share: dict[str, float] = field(default_factory=dict)  # of wall time: prefill/propose/score/verify/other
    stage_ms_per_token: dict[str, float] = field(default_factory=dict)
    draft_cost_ratio: float | None = None  # c = (propose s per drafted token) / (score s per step)
    k: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def draft_cost_ratio(m: Metrics) -> float | None:
    """c: seconds to propose one draft token over seconds of one target scoring step (None without drafts)."""
    if not m.drafted or not m.steps or not m.stage_s.get("score"):
        return None
    return (m.stage_s["propose"] / m.drafted) / (m.stage_s["score"] / m.steps)


def categories(items: list[Item]) -> list[str]:
    """Categories in first-seen order, then ``overall``."""
    return list(dict.fromkeys(i.category for i in items)) + [OVERALL]


def aggregate(items: list[Item], records: dict[str, list[Record]], baseline: str, kinds: dict[str, str],
              ks: dict[str, int] | None = None) -> list[MethodStats]:
    """Rows for every method (baseline first) and category; ``kinds`` maps labels to baseline/verispec/peer."""
    ks = ks or {}
    cats = categories(items)
    base_tps: dict[str, float] = {}
    rows = []
    order = [baseline] + [label for label in records if label != baseline]
    for label in order:
        kind = kinds.get(label, "verispec")
        for cat in cats:
            recs = [r for r in records[label] if cat == OVERALL or items[r.item].category == cat]
            if not recs:
                continue
            m = Metrics()
            for r in recs:
                m.merge(r.metrics)
            tps = m.tokens_per_s
            if label == baseline:
                base_tps[cat] = tps
            summary = metrics_dict(m)
            stage = summary["stage_s"]
            speculative = kind == "verispec" and m.drafted > 0
            timed_stages = kind != "peer"
            rows.append(MethodStats(
                method=label, kind=kind, category=cat, prompts=len(recs), tokens=m.generated_tokens,
                wall_s=m.total_s, tokens_per_s=tps,
                speedup=tps / base_tps[cat] if base_tps.get(cat) else None,
                mean_ttft_s=m.mean_ttft_s if m.ttft_s > 0 else None,
                mean_accepted_length=m.mean_accepted_length if m.steps else None,
                acceptance_rate=m.acceptance_rate if speculative else None,
                acceptance_by_position=summary["acceptance_by_position"] if speculative else [],
                stage_share={s: stage.get(s, 0.0) / m.total_s for s in STAGE_NAMES} if timed_stages and m.total_s
                else {},
                stage_ms_per_token={s: 1e3 * stage.get(s, 0.0) / m.generated_tokens for s in STAGE_NAMES}
                if timed_stages and m.generated_tokens else {},
                draft_cost_ratio=draft_cost_ratio(m) if speculative else None,
                k=ks.get(label)))
    return rows


def repeat_ratios(items: list[Item], records: dict[str, list[Record]], reference: str
                  ) -> dict[str, dict[str, list[float]]]:
    """Per method and category (``overall`` included): each repeat's tokens/s over ``reference``'s in the same
    repeat, so each ratio compares runs of the same prompts seconds apart; their spread is the run-to-run spread.

    A repeat's tokens/s is its generated tokens over its summed wall time (prefill included). Empty when
    ``reference`` did not run.
    """
    if reference not in records:
        return {}
    cats = categories(items)

    def rates(recs: list[Record], cat: str) -> list[float]:
        recs = [r for r in recs if cat == OVERALL or items[r.item].category == cat]
        if not recs:
            return []
        repeats = min(len(r.wall_s) for r in recs)
        return [sum(len(r.samples[i]) for r in recs) / sum(r.wall_s[i] for r in recs) for i in range(repeats)]

    base = {cat: rates(records[reference], cat) for cat in cats}
    out: dict[str, dict[str, list[float]]] = {}
    for label, recs in records.items():
        if label == reference:
            continue
        for cat in cats:
            mine = rates(recs, cat)
            if mine and base[cat]:
                out.setdefault(label, {})[cat] = [a / b for a, b in zip(mine, base[cat], strict=False)]
    return out


def overall(rows: list[MethodStats]) -> list[MethodStats]:
    return [r for r in rows if r.category == OVERALL]


def ratios_by_category(rows: list[MethodStats], peer: str) -> dict[str, dict[str, float]]:
    """tokens/s of every other method over ``peer``'s, per category (those ``peer`` ran, ``overall`` included)."""
    peer_tps = {r.category: r.tokens_per_s for r in rows if r.method == peer and r.tokens_per_s}
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.method != peer and r.category in peer_tps:
            out.setdefault(r.method, {})[r.category] = r.tokens_per_s / peer_tps[r.category]
    return out


def spec_bench_mean(by_category: dict[str, float]) -> float | None:
    """The mean of per-category ratios over Spec-Bench's categories (None if none of them ran)."""
    from verispec.bench.datasets import SPEC_BENCH_CATEGORIES

    values = [v for c, v in by_category.items() if c in SPEC_BENCH_CATEGORIES]
    return sum(values) / len(values) if values else None


def best_method(rows: list[MethodStats]) -> MethodStats | None:
    """The verispec method with the highest overall tokens/s (None if only the baseline ran)."""
    cands = [r for r in overall(rows) if r.kind == "verispec"]
    return max(cands, key=lambda r: r.tokens_per_s, default=None)
