"""``verispec advise``: measure on the user's prompts, predict every configuration, recommend the measured best.

Speculation trades extra arithmetic for fewer passes over the weights, so whether it pays, and at
which k, is decided by local facts: what a target forward of m tokens costs against one token (the
cost policy's profiled curves), what drafting costs and how far drafts are accepted on the user's
own prompts. The advisor works in two passes over the same prompts, one request at a time and every
configuration interleaved per prompt (as ``verispec bench`` runs), so host drift hits all alike:

1. **Calibrate.** Plain decoding and every drafter at a fixed :data:`K_CAL` (no confidence stop). Each
   run gives the share of steps its drafter proposed on, the share of those whose first i drafts were
   all accepted (for every i up to :data:`K_CAL`: acceptance by depth, which the constant per-token rate
   of the k policy's geometric model only approximates), its drafting seconds per step and the draft
   model's catch-up on the prompt.
2. **Predict** the speedup over plain decoding of each drafter at every k up to :data:`K_CAL` from those
   and the profiled target curve (scaled to the time a plain step's forward took on these prompts).
3. **Measure** plain decoding, the defaults and the best-predicted configurations, on the other
   activation path too where this CPU runs both, and recommend what the measurement puts first. The
   prediction error at the recommendation says how far the model can be trusted for other k.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from verispec.bench.datasets import BenchPrompt
from verispec.bench.hardware import machine, read_bandwidth, weight_bytes_per_token
from verispec.config import DEFAULT_SPEC, PLAIN, SpecConfig
from verispec.engine import kernel_choice
from verispec.engine.costs import CostModel
from verispec.engine.engine import Engine
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.models.linear import Int4Linear, Int8Linear
from verispec.sampling import SamplingParams

K_CAL = 5  # the calibration runs' fixed k: the largest k predicted (the defaults' own largest k)
MEASURE = 3  # best-predicted fixed configurations measured beside plain decoding and the defaults
PAYS = 1.05  # a speedup below this is reported as "does not pay" (inside a run's bookkeeping and noise)
DEFAULT_LABEL = "default"


@dataclass
class Calibration:
    """What one drafter's fixed-k run on the prompts showed (see the module docstring)."""

    method: str
    hit: float  # share of steps on which the drafter proposed at least one token
    reach: list[float]  # reach[i]: share of proposing steps whose first i + 1 drafts were all accepted
    propose_step_s: float  # drafting seconds per step at K_CAL, the draft model's catch-up left out
    catch_up_s: float  # the draft model's reading of the prompts (paid once per request, whatever k)
    other_step_s: float  # per step: verification and bookkeeping (all but drafting and the target forward)
    model: bool  # whether a draft model's forwards draft (drafting time grows with k) or only lookups


@dataclass
class Candidate:
    """One configuration: its method string (as ``verispec bench`` reads it), predicted and measured speedup."""

    label: str
    spec: SpecConfig = field(repr=False)
    predicted: float | None = None
    measured: float | None = None
    k: int | None = None  # a fixed k (None: plain decoding or the defaults)
    kernels: str = "auto"


def spec_of(method: str, k: int) -> SpecConfig:
    """The fixed-k configuration of ``method`` the advisor predicts and measures: the defaults' draft head and
    window, no confidence stop (the calibration's acceptance by depth assumes every step drafts k)."""
    return replace(DEFAULT_SPEC, method=method, k=k, k_policy="fixed", confidence=None)


def label_of(method: str, k: int) -> str:
    return f"{method}:policy=fixed,k={k},confidence=0"


def methods_for(engine: Engine) -> list[str]:
    """The drafters the advisor weighs: the draft model (alone and in the hybrid) where one is loaded, the
    target's own layers where none is, and the two lookups."""
    return (["hybrid", "draft"] if engine.draft is not None else ["layerskip"]) + ["suffix", "ngram"]


def predict(cal: Calibration, plain: Metrics, costs: CostModel, k: int) -> float:
    """Predicted speedup over plain decoding of ``cal``'s drafter at a fixed ``k`` (1..K_CAL) on the same prompts.

    Steps: the plain run's tokens over the expected tokens per step (accepted drafts by depth plus the
    target's one); each step's forward from the profiled curve, scaled by what a plain step's forward
    measured here over the curve's one-token point (the prompts' context against the profile's).
    """
    t1 = costs.target_s(1)
    scale = plain.stage_s["score"] / plain.steps / t1 if plain.steps and t1 > 0 else 1.0
    per_step = cal.hit * (1.0 + sum(cal.reach[:k])) + (1.0 - cal.hit)
    propose = cal.propose_step_s * (k / K_CAL if cal.model else 1.0)
    step_s = scale * (cal.hit * costs.target_s(k + 1) + (1.0 - cal.hit) * t1) + propose + cal.other_step_s
    total = plain.stage_s["prefill"] + cal.catch_up_s + plain.generated_tokens / per_step * step_s
    return plain.total_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class _Config:
    """One configuration to run: the engine (its cost curves), the speculation, the activation path (None: auto's)."""

    engine: Engine
    spec: SpecConfig
    path: str | None = None


class _Runs:
    """Every configuration's merged metrics over the prompts, one request at a time."""

    def __init__(self, engine: Engine, prompts: Sequence[BenchPrompt], tokens: int) -> None:
        self.engine, self.prompts, self.params = engine, prompts, SamplingParams(max_tokens=tokens)
        self.metrics: dict[str, Metrics] = {}
        self.catch_up_s: dict[str, float] = {}
        self.forwards: dict[str, int] = {}

    def run(self, configs: dict[str, _Config]) -> None:
        """Run every configuration on each prompt in turn (interleaved, so drift hits all alike)."""
        for p in self.prompts:
            for label, c in configs.items():
                runner = c.engine.draft_runner
                c0, f0 = (runner.catch_up_s, runner.forwards) if runner else (0.0, 0)
                with _Path(self.engine, c.path):
                    r = c.engine.generate(p.text, self.params, None if c.spec is PLAIN else c.spec, chat=p.chat)[0]
                self.metrics.setdefault(label, Metrics()).merge(r.metrics)
                if runner:
                    self.catch_up_s[label] = self.catch_up_s.get(label, 0.0) + runner.catch_up_s - c0
                    self.forwards[label] = self.forwards.get(label, 0) + runner.forwards - f0

    def calibration(self, label: str, method: str) -> Calibration:
        m = self.metrics[label]
        hits = m.drafted_by_position[0] if m.drafted_by_position else 0
        steps = max(m.steps, 1)
        reach = [(m.accepted_by_position[i] if i < len(m.accepted_by_position) else 0) / hits if hits else 0.0
                 for i in range(K_CAL)]
        catch = self.catch_up_s.get(label, 0.0)
        other = m.total_s - m.stage_s["prefill"] - m.stage_s["propose"] - m.stage_s["score"]
        return Calibration(method, hits / steps, reach, max(0.0, m.stage_s["propose"] - catch) / steps, catch,
                           max(0.0, other) / steps, self.forwards.get(label, 0) > 0)

    def speedup(self, label: str, base: str) -> float:
        return self.metrics[base].total_s / self.metrics[label].total_s


def _other_path(engine: Engine) -> str | None:
    """The activation path besides the one ``auto`` chose, where this CPU runs both and the target may run it."""
    chosen = kernel_choice.activations(engine.target)
    if not kernel_choice.both_paths() or chosen is None:
        return None
    other = "bf16" if chosen == "q8" else "q8"
    if other == "q8" and not kernel_choice.gate_passed(engine.config.model)[0]:
        return None
    return other


class _Path:
    """Switches both models' int4/int8 layers to ``path``'s activations for a ``with`` block, and back as they were."""

    def __init__(self, engine: Engine, path: str | None) -> None:
        self.engine, self.path = engine, path
        self.was: list[tuple[Int4Linear | Int8Linear, bool]] = []

    def __enter__(self) -> None:
        if self.path:
            models = [m for m in (self.engine.target, self.engine.draft) if m is not None]
            self.was = [(layer, layer.q8) for m in models for layer in kernel_choice.fast_layers(m)]
            for m in models:
                kernel_choice.set_q8(m, self.path == "q8")

    def __exit__(self, *exc: object) -> None:
        for layer, q8 in self.was:
            layer.q8 = q8


def _path_configs(engine: Engine, path: str | None) -> dict[str, _Config]:
    """Plain decoding and the defaults on the other activation path ``path`` (none where ``path`` is None)."""
    if path is None:
        return {}
    with _Path(engine, path):
        other = engine.with_config()
        other.profile(K_CAL)  # the policy prices the other path's steps by that path's curves
    return {f"plain [{path}]": _Config(other, PLAIN, path),
            f"{DEFAULT_LABEL} [{path}]": _Config(other, DEFAULT_SPEC, path)}


def advise(engine: Engine, prompts: Sequence[BenchPrompt], tokens: int = 128, measure: int = MEASURE,
           paths: bool = True, out: str | None = None) -> dict:
    """Calibrate, predict and measure on ``prompts`` (see the module); returns the report as a dict and writes
    ``out``/advise.json, advise.md and advise.png when ``out`` is given. ``paths`` False skips the other activation
    path. Runs on an engine over ``engine``'s models without prefix reuse (no configuration may reuse another's
    prefill of the same prompt)."""
    if not prompts:
        raise VerispecError("advise needs at least one prompt")
    if measure < 0 or tokens < 1:
        raise VerispecError(f"advise measures at least 0 configurations of at least 1 token (got --measure {measure}, "
                            f"--max-tokens {tokens})")
    if engine.config.prefix_reuse:  # every configuration must prefill each prompt itself, as plain decoding does
        engine = engine.with_config(prefix_reuse=False)
    costs = engine.profile(K_CAL)
    methods = methods_for(engine)
    runs = _Runs(engine, prompts, tokens)
    runs.run({"plain": _Config(engine, PLAIN)}
             | {label_of(m, K_CAL): _Config(engine, spec_of(m, K_CAL)) for m in methods})
    plain = runs.metrics["plain"]
    cals = {m: runs.calibration(label_of(m, K_CAL), m) for m in methods}
    predicted = {(m, k): predict(cals[m], plain, costs, k) for m in methods for k in range(1, K_CAL + 1)}
    # The defaults' policy aims at the hybrid's best k (where a draft model is loaded; else nothing predicts it).
    best_hybrid = max((v for (m, _), v in predicted.items() if m == "hybrid"), default=None)
    candidates = {"plain": Candidate("plain", PLAIN, 1.0),
                  DEFAULT_LABEL: Candidate(DEFAULT_LABEL, DEFAULT_SPEC, best_hybrid)}
    for m, k in sorted(predicted, key=lambda mk: -predicted[mk])[:measure]:
        candidates[label_of(m, k)] = Candidate(label_of(m, k), spec_of(m, k), predicted[m, k], k=k)

    path = _other_path(engine) if paths else None
    second = _Runs(engine, prompts, tokens)
    second.run({lab: _Config(engine, c.spec) for lab, c in candidates.items()} | _path_configs(engine, path))
    for lab, c in candidates.items():
        c.measured = second.speedup(lab, "plain")
    for what in ("plain", DEFAULT_LABEL) if path else ():  # against auto's plain decoding, as every other
        lab = f"{what} [{path}]"
        candidates[lab] = Candidate(lab, candidates[what].spec, measured=second.speedup(lab, "plain"), kernels=path)
    rec = max(candidates.values(), key=lambda c: (c.measured or 0.0, c.label == DEFAULT_LABEL))
    best_measured = rec.measured or 1.0
    pays = rec.spec is not PLAIN and best_measured >= PAYS
    plain_tps = second.metrics["plain"].tokens_per_s
    read_bandwidth_bps, weight_bytes = read_bandwidth(), weight_bytes_per_token(engine.target)
    verify = {m: costs.target_s(m) / costs.target_s(1) for m in range(1, K_CAL + 2)}
    error = abs(rec.predicted - best_measured) / best_measured if rec.predicted else None
    result = {
        "machine": machine(), "prompts": len(prompts), "max_tokens": tokens,
        "read_bandwidth_GBps": read_bandwidth_bps / 1e9,
        "target_weight_GB_per_token": weight_bytes / 1e9,
        "roofline_tokens_per_s": read_bandwidth_bps / weight_bytes,
        "target_forward_ms": costs.target_s(1) * 1e3,
        "plain_tokens_per_s": plain_tps, "verify_cost_curve": verify,
        "draft_forward_ms": costs.draft_s(1) * 1e3 if engine.draft is not None else None,
        "calibration": {m: asdict(c) | {"measured": runs.speedup(label_of(m, K_CAL), "plain")}
                        for m, c in cals.items()},
        "predicted": {m: {k: predicted[m, k] for k in range(1, K_CAL + 1)} for m in methods},
        "candidates": [{"label": c.label, "k": c.k, "kernels": c.kernels, "predicted": c.predicted,
                        "measured": c.measured} for c in candidates.values()],
        "recommended": {"label": rec.label, "kernels": rec.kernels, "command": _command(rec),
                        "predicted": rec.predicted, "measured": best_measured, "prediction_error": error},
        "verdict": (f"speculation pays here: {rec.label} measured {best_measured:.2f}x plain decoding"
                    if pays else "speculation does not pay here: nothing measured at least "
                    f"{PAYS:.2f}x plain decoding; run plain decoding"),
        "kernels": {k: engine.describe()[k] for k in ("kernels", "activations", "activations_reason")},
    }
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "advise.json").write_text(json.dumps(result, indent=2))
        Path(out, "advise.md").write_text(markdown(result))
        _plot(result, str(Path(out, "advise.png")))
    return result


def _command(c: Candidate) -> str:
    """The ``verispec generate`` options that run ``c``."""
    kern = "" if c.kernels == "auto" else f" --kernels {c.kernels}"
    if c.spec is PLAIN:
        return "--method none" + kern
    if c.label.startswith(DEFAULT_LABEL):
        return kern.strip()  # the defaults take no options
    s = c.spec
    return f"--method {s.method} -k {s.k} --k-policy fixed --confidence 0{kern}"


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ks = range(1, K_CAL + 1)
    for method in result["calibration"]:
        ax.plot(ks, [result["predicted"][method][k] for k in ks], marker=".", label=f"{method}: predicted")
    for c in result["candidates"]:
        if c["k"] is not None:
            ax.plot(c["k"], c["measured"], "o", markersize=8, color="black")
    ax.plot([], [], "o", color="black", label="measured")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("k (draft tokens per step, fixed)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(r: dict) -> str:
    """The report as markdown tables: calibration and predictions, then what the second pass measured."""
    ks = range(1, K_CAL + 1)
    lines = [f"{r['prompts']} prompts, {r['max_tokens']} new tokens, one request at a time; plain decoding "
             f"{r['plain_tokens_per_s']:.2f} tokens/s.", "",
             f"| drafter | proposes on | first 1/2/3/4/5 drafts accepted | measured at k={K_CAL} | "
             + " | ".join(f"predicted k={k}" for k in ks) + " |",
             "|---|---|---|---|" + "---|" * K_CAL]
    for method, c in r["calibration"].items():
        reach = "/".join(f"{100 * x:.0f}" for x in c["reach"])
        lines.append(f"| {method} | {c['hit']:.0%} | {reach} % | {c['measured']:.2f}x | "
                     + " | ".join(f"{v:.2f}x" for v in r["predicted"][method].values()) + " |")
    lines += ["", "| configuration | activations | predicted | measured |", "|---|---|---|---|"]
    for c in sorted(r["candidates"], key=lambda c: -(c["measured"] or 0)):
        pred = f"{c['predicted']:.2f}x" if c["predicted"] else "–"
        lines.append(f"| `{c['label']}` | {c['kernels']} | {pred} | {c['measured']:.2f}x |")
    rec = r["recommended"]
    err = f"; prediction error {rec['prediction_error']:.1%}" if rec["prediction_error"] is not None else ""
    run = f"`{rec['command']}`" if rec["command"] else "no options"
    lines += ["", f"Recommended: `{rec['label']}` ({run}), measured {rec['measured']:.2f}x{err}. "
              f"{r['verdict'][0].upper()}{r['verdict'][1:]}.", ""]
    return "\n".join(lines)


def format_advice(r: dict) -> str:
    """The human-readable report the CLI prints."""
    host = r["machine"]
    curve = " ".join(f"{m}:{c:.2f}" for m, c in r["verify_cost_curve"].items())
    lines = [
        f"host {host['cpu']}, {host['threads']} threads; {r['prompts']} prompts, {r['max_tokens']} new tokens each, "
        "one request at a time",
        f"memory read bandwidth {r['read_bandwidth_GBps']:.1f} GB/s; target weights "
        f"{r['target_weight_GB_per_token']:.2f} GB per token -> roofline {r['roofline_tokens_per_s']:.1f} tokens/s; "
        f"plain decoding measured {r['plain_tokens_per_s']:.1f} tokens/s",
        f"target forward {r['target_forward_ms']:.1f} ms"
        + (f", a draft forward {r['draft_forward_ms']:.1f} ms "
           f"(c = {r['draft_forward_ms'] / r['target_forward_ms']:.2f})" if r["draft_forward_ms"] else ""),
        f"target forward of m tokens over one token: {curve}",
        "",
        f"calibration (fixed k={K_CAL}, no confidence stop) and predicted speedup by k:",
    ]
    for method, c in r["calibration"].items():
        row = " ".join(f"{k}:{v:.2f}" for k, v in r["predicted"][method].items())
        lines.append(f"  {method:9s} proposes on {c['hit']:.0%} of steps, all of the first 1/2/3 drafts accepted "
                     f"{'/'.join(f'{x:.0%}' for x in c['reach'][:3])}; measured {c['measured']:.2f}x at k={K_CAL}; "
                     f"predicted {row}")
    lines += ["", "measured (a second pass, interleaved per prompt), speedup over plain decoding:"]
    for c in sorted(r["candidates"], key=lambda c: -(c["measured"] or 0)):
        pred = f"predicted {c['predicted']:.2f}x" if c["predicted"] else "no prediction"
        lines.append(f"  {c['label']:44s} {c['measured']:.2f}x  ({pred})")
    rec = r["recommended"]
    err = f", prediction error {rec['prediction_error']:.0%}" if rec["prediction_error"] is not None else ""
    lines += ["", f"recommended: {rec['label']}: {rec['command'] or 'no options'}  "
              f"(measured {rec['measured']:.2f}x{err})",
              f"verdict: {r['verdict']}"]
    kern = r.get("kernels")
    if kern and kern["activations"]["target"]:
        lines.append("kernels auto chose: " + "; ".join(f"{who} on {p} activations ({kern['activations_reason'][who]})"
                                                      for who, p in kern["activations"].items() if p))
    return "\n".join(lines)
