"""``verispec advise``: measure first, then decide whether speculation pays on this machine.

Speculation trades extra arithmetic for fewer passes over the weights, so the deciding facts
are local: memory bandwidth, what a target forward of m tokens costs relative to one token,
what a draft token costs, and how often drafts are accepted on the user's own prompts. This
measures all four, predicts the speedup of every (method, k), checks the prediction for the
recommended setting against a real run, and plots predicted vs measured speedup over k.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from verispec.bench.hardware import read_bandwidth, weight_bytes_per_token
from verispec.config import PLAIN, SpecConfig
from verispec.engine.costs import CostModel
from verispec.engine.engine import Engine
from verispec.engine.metrics import Metrics
from verispec.engine.policy import expected_tokens
from verispec.sampling import SamplingParams

DEFAULT_PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain the difference between a process and a thread in three sentences.",
    "def quicksort(xs):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
]


@dataclass
class MethodAdvice:
    method: str
    acceptance: float  # accepted / drafted in calibration
    hit: float  # share of steps on which the drafter proposed something
    draft_ms: float
    predicted: dict[int, float]  # k -> predicted speedup
    best_k: int


def _calibrate(engine: Engine, prompts: list[str], spec: SpecConfig, tokens: int, chat: bool) -> Metrics:
    m = Metrics()
    for r in engine.generate(prompts, SamplingParams(max_tokens=tokens), spec, chat=chat):
        m.merge(r.metrics)
    return m


def _speedup(costs: CostModel, a: float, k: int, hit: float, draft_s: float) -> float:
    """Predicted speedup of one request over plain decoding: k drafts per step at acceptance ``a``,
    the drafter proposing on a share ``hit`` of steps (the others are plain steps)."""
    plain = costs.target_s(1)
    if k == 0:
        return 1.0
    tokens = hit * expected_tokens(a, k) + (1.0 - hit)
    return tokens * plain / (k * draft_s + hit * costs.target_s(k + 1) + (1.0 - hit) * plain)


def _measure(engine: Engine, prompts: list[str], spec: SpecConfig, tokens: int, chat: bool) -> float:
    return _calibrate(engine, prompts, spec, tokens, chat).tokens_per_s


def advise(engine: Engine, prompts: list[str] | None = None, k_max: int = 16, tokens: int = 64, chat: bool = True,
           out: str | None = None, measure_ks: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """Measure, predict and recommend; returns everything as a dict (and writes ``out``/advise.*)."""
    prompts = prompts or DEFAULT_PROMPTS
    bw = read_bandwidth()
    target_bytes = weight_bytes_per_token(engine.target)
    methods = (["draft"] if engine.draft is not None else []) + ["ngram"]
    costs = engine.profile(k_max)
    verify_s = [costs.target_s(m) for m in range(1, k_max + 2)]
    advice: list[MethodAdvice] = []
    for method in methods:
        draft_s = costs.draft_s(1) if method == "draft" else 0.0  # a lookup costs next to nothing
        cal = _calibrate(engine, prompts, SpecConfig(method=method, k=4, k_policy="fixed"), tokens, chat)
        a = cal.acceptance_rate
        proposing = cal.drafted_by_position[0] if cal.drafted_by_position else 0
        hit = proposing / cal.steps if cal.steps else 0.0
        predicted = {k: _speedup(costs, a, k, hit, draft_s) for k in range(0, k_max + 1)}
        best = max(predicted, key=lambda k: (predicted[k], -k))
        advice.append(MethodAdvice(method, a, hit, draft_s * 1e3, predicted, best))
    curve = [t / verify_s[0] for t in verify_s]
    top = max(advice, key=lambda ad: ad.predicted[ad.best_k])
    plain_tps = _measure(engine, prompts, PLAIN, tokens, chat)
    measured: dict[int, float] = {}
    for k in sorted({*measure_ks, top.best_k} - {0}):
        measured[k] = _measure(engine, prompts, SpecConfig(method=top.method, k=k, k_policy="fixed"), tokens,
                               chat) / plain_tps
    rec_pred = top.predicted[top.best_k]
    rec_meas = measured.get(top.best_k, 1.0)
    pays = top.best_k > 0 and rec_meas > 1.05
    verdict = (f"speculation pays here: {top.method} with k={top.best_k} measured {rec_meas:.2f}x "
               f"(predicted {rec_pred:.2f}x)" if pays else
               "speculation does not pay here: no setting beat plain decoding by more than 5% "
               f"(best predicted {rec_pred:.2f}x, measured {rec_meas:.2f}x); run plain decoding")
    why = (f"a target forward of 2 tokens costs {curve[1]:.2f}x one token and of {k_max + 1} tokens "
           f"{curve[-1]:.2f}x; a draft token costs {top.draft_ms:.1f} ms against {verify_s[0] * 1e3:.1f} ms "
           f"for a target token; acceptance {top.acceptance:.0%}")
    result = {
        "read_bandwidth_GBps": bw / 1e9, "target_weight_GB_per_token": target_bytes / 1e9,
        "roofline_tokens_per_s": bw / target_bytes, "plain_tokens_per_s": plain_tps,
        "verify_cost_curve": {m + 1: c for m, c in enumerate(curve)},
        "methods": [asdict(ad) for ad in advice], "measured_speedup": {top.method: measured},
        "recommended": {"method": top.method, "k": top.best_k, "predicted": rec_pred, "measured": rec_meas,
                        "prediction_error": abs(rec_pred - rec_meas) / rec_meas},
        "verdict": verdict, "why": why,
        "kernels": {k: engine.describe()[k] for k in ("kernels", "activations", "activations_reason")},
    }
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "advise.json").write_text(json.dumps(result, indent=2))
        _plot(advice, top.method, measured, str(Path(out, "advise.png")))
    return result


def _plot(advice: list[MethodAdvice], method: str, measured: dict[int, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for ad in advice:
        ks = sorted(ad.predicted)
        ax.plot(ks, [ad.predicted[k] for k in ks], marker=".", label=f"{ad.method}: predicted")
    ks = sorted(measured)
    ax.plot(ks, [measured[k] for k in ks], "o", markersize=8, label=f"{method}: measured")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_advice(r: dict) -> str:
    """The human-readable report printed by the CLI."""
    lines = [
        f"memory read bandwidth   {r['read_bandwidth_GBps']:.1f} GB/s",
        f"target weights / token  {r['target_weight_GB_per_token']:.2f} GB  -> roofline "
        f"{r['roofline_tokens_per_s']:.1f} tokens/s; measured plain {r['plain_tokens_per_s']:.1f} tokens/s",
        "verify cost t(k+1)/t(1): " + " ".join(f"{m}:{c:.2f}" for m, c in r["verify_cost_curve"].items()),
        "",
        "predicted speedup by k:",
    ]
    for ad in r["methods"]:
        row = " ".join(f"{k}:{s:.2f}" for k, s in ad["predicted"].items() if k in (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
        lines.append(f"  {ad['method']:6s} acceptance {ad['acceptance']:.0%} (proposes on {ad['hit']:.0%} of steps), "
                     f"draft {ad['draft_ms']:.1f} ms/token: {row}")
    rec = r["recommended"]
    lines += ["", f"recommended: --method {rec['method']} -k {rec['k']}  (predicted {rec['predicted']:.2f}x, "
              f"measured {rec['measured']:.2f}x, prediction error {rec['prediction_error']:.0%})",
              f"verdict: {r['verdict']}", f"why: {r['why']}"]
    kern = r.get("kernels")
    if kern and kern["activations"]["target"]:
        lines.append("kernels: " + "; ".join(f"{who} on {path} activations ({kern['activations_reason'][who]})"
                                            for who, path in kern["activations"].items() if path))
    return "\n".join(lines)
