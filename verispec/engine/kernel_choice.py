"""``--kernels auto``: the activation path each model's int4/int8 layers run on this host, chosen on evidence.

verispec's int4/int8 layers multiply activations in bf16 (AVX-512 BF16) or quantized to 8 bits per group of
32 (VNNI; llama.cpp does the same in its Q4_K dot products). Both read the same packed weights, so a loaded
model switches between them without reloading. Where the CPU runs both, ``auto``:

- drafts on whichever path is faster for the draft model: a draft's numbers never change the output (it is
  verified), only how often its tokens are accepted;
- runs the target on 8-bit activations only where the quality gate (``verispec bench --quality``) measured the
  model's perplexity within :data:`GATE_PPL` of bf16 activations' (recorded per
  registry model, ``ModelEntry.q8_perplexity_change``), and only where 8-bit activations are faster here.

"Faster" is timed at load: a decode step and a verification step (1 and 8 tokens) of each model on each path,
the median of a few runs, and 8-bit activations must win by :data:`MARGIN`. The outcome is kept per CPU, thread
count, model and weight format under ``$VERISPEC_HOME/kernels/activations.json`` and read by later loads, so a
model's numbers on a host do not change from one process to the next with how busy the machine was when it
loaded. Where the CPU runs one path only (AVX2 without AVX-512 BF16: 8-bit activations; AVX-512 BF16 without
VNNI: bf16) the models were built on it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec import hub
from verispec import kernels as fast_kernels
from verispec.models.linear import Int4Linear, Int8Linear
from verispec.models.llama import Transformer

MARGIN = 0.03  # 8-bit activations must be this much faster (a share of the bf16 path's time) to be chosen
# The quality gate: a target runs 8-bit activations only if they raise its perplexity by at most this share
# (verispec.bench.quality measures it).
GATE_PPL = 0.005
WIDTHS = (1, 8)  # a decode step and a verification step
CONTEXT = 256  # tokens the timed steps attend to
REPEATS = 5


@dataclass(frozen=True)
class KernelChoice:
    """What one model's int4/int8 layers run and why: ``activations`` "bf16", "q8" or None (no fast layers)."""

    activations: str | None
    reason: str


def activations(model: Transformer | None) -> str | None:
    """"q8" or "bf16" when every fast int4/int8 layer of ``model`` runs that path, "mixed", or None without any."""
    paths = {"q8" if m.q8 else "bf16" for m in fast_layers(model)}
    return None if not paths else paths.pop() if len(paths) == 1 else "mixed"


def set_q8(model: Transformer, q8: bool) -> None:
    """Switch every fast int4/int8 layer of ``model`` to 8-bit (``q8``) or bf16 activations (int8 layers whose
    input width is not whole groups of 32 keep bf16)."""
    for m in fast_layers(model):
        m.q8 = q8 and (not isinstance(m, Int8Linear) or m.in_features % 32 == 0)


def fast_layers(model: Transformer | None) -> list[Int4Linear | Int8Linear]:
    """``model``'s int4/int8 layers that run verispec's kernels (each has its own ``q8`` switch)."""
    if model is None:
        return []
    return [m for m in model.modules() if isinstance(m, Int4Linear | Int8Linear) and m.fast]


def both_paths() -> bool:
    """Whether this CPU runs int4/int8 layers on bf16 and on 8-bit activations."""
    return fast_kernels.available() and fast_kernels.q8_available()


def gate_passed(model: str) -> tuple[bool, str]:
    """Whether the quality gate holds for ``model`` (a registry name or a model file), and what it measured."""
    entry = hub.REGISTRY.get(str(model)) or next((e for e in hub.REGISTRY.values()
                                                   if str(model).endswith(e.filename)), None)
    if entry is None or entry.q8_perplexity_change is None:
        return False, "no quality-gate measurement for this model"
    change = entry.q8_perplexity_change
    return passes_gate(change), f"perplexity {100 * change:+.2f}% under 8-bit activations"


def passes_gate(change: float) -> bool:
    """Whether a perplexity change (8-bit over bf16 activations, minus 1) is within the quality gate."""
    return change <= GATE_PPL


@torch.inference_mode()
def step_seconds(model: Transformer) -> float:
    """The summed median seconds of one step per width in :data:`WIDTHS`, after :data:`CONTEXT` cached tokens (fewer
    where the model has fewer positions)."""
    context = max(0, min(CONTEXT, model.rope_cos.shape[0] - max(WIDTHS)))  # within the model's positions
    cache = model.new_cache(1, context + max(WIDTHS))
    dev = model.device
    if context:
        model(torch.zeros(1, context, dtype=torch.long, device=dev), torch.arange(context, device=dev)[None], cache,
              last_only=True)
    total = 0.0
    for w in WIDTHS:
        tokens = torch.zeros(1, w, dtype=torch.long, device=dev)
        pos = torch.arange(context, context + w, device=dev)[None]
        times = []
        for _ in range(REPEATS + 1):  # the first warms up
            t0 = time.perf_counter()
            model(tokens, pos, cache)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times[1:])
    return total


def choose(model: Transformer, name: str, kernels: str, target: bool) -> KernelChoice:
    """Set ``model``'s activation path for ``kernels`` and say which it runs and why; ``name`` is the model as
    the user named it, ``target`` False for a draft model (no quality gate: it cannot change the output)."""
    built = activations(model)
    if built is None:
        return KernelChoice(None, "no int4/int8 layer runs verispec's kernels")
    if kernels != "auto":
        return KernelChoice(built, f"--kernels {kernels}")
    if not both_paths() or model.device.type != "cpu":
        return KernelChoice(built, "the only activation path this CPU runs")
    if target:
        ok, measured = gate_passed(name)
        if not ok:
            set_q8(model, False)
            return KernelChoice("bf16", f"bf16 activations: {measured} (gate: within {100 * GATE_PPL:.1f}%)")
    gated = f"{measured}, " if target else ""
    layers = Counter(type(m).__name__ for m in fast_layers(model))  # the weight formats it was loaded in
    key = f"{_cpu()}|{torch.get_num_threads()} threads|{name}|{model.dtype}|{sorted(layers.items())}"
    known = _timings().get(key)
    if known is None:
        set_q8(model, False)
        bf16 = step_seconds(model)
        set_q8(model, True)
        known = {"q8_s": step_seconds(model), "bf16_s": bf16}
        _remember(key, known)
    q8 = known["q8_s"] < known["bf16_s"] * (1 - MARGIN)
    set_q8(model, q8)
    timed = f"a step took {1e3 * known['q8_s']:.1f} ms on 8-bit activations, {1e3 * known['bf16_s']:.1f} ms on bf16"
    return KernelChoice("q8" if q8 else "bf16", f"{'8-bit' if q8 else 'bf16'} activations: {gated}{timed}")


def _store() -> Path:
    return hub.home() / "kernels" / "activations.json"


def _timings() -> dict[str, dict[str, float]]:
    try:
        return json.loads(_store().read_text())
    except (OSError, ValueError):
        return {}


def _remember(key: str, timing: dict[str, float]) -> None:
    path = _store()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.time_ns()}.tmp")
        tmp.write_text(json.dumps({**_timings(), key: timing}, indent=1))
        tmp.replace(path)
    except OSError:  # a read-only home: time again next load
        pass


def _cpu() -> str:
    """The CPU's model name, family and model (what its kernels' speed depends on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines[:30] if ":" in line)}
    return " ".join(fields.get(k, "") for k in ("model name", "cpu family", "model"))
