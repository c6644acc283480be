"""Throughput and latency under concurrency: the ``--clients`` axis of ``verispec bench``.

At a level of C clients, each client keeps one request in flight on an engine with C slots: when a
request finishes, the next prompt takes its place (a closed loop). A level serves the run's prompts, at
least two per client (the list again from its start where it has fewer), so requests come and go.
The level ``alone`` serves the same prompts one after another through ``Engine.generate``: the
single-request path, whose speedup the batching engine at one client should keep.

Every level runs every method, repeat after repeat, the methods in reverse order every other repeat
(a drifting host favours none). Per level and method the run of median throughput is reported, with
every run's tokens/s and, paired by repeat with plain decoding's run, the throughput ratio and the
ratio beyond prefill (tokens over the wall time outside the target's prompt prefill, the same work in
every method). Each run also records latency (submit to last token, p50/p95), time to first token,
tokens per step, the k the cost policy chose, what the draft model read on its own (catch-up), and
the garbage collector's time and the resident memory, process-wide costs no stage timer shows.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verispec.bench.memory import rss_bytes
from verispec.engine.engine import Engine, GenerationResult
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

ALONE = 0
"""The level ``alone``: one request after another through ``Engine.generate``."""


def parse_clients(text: str | None) -> list[int]:
    """``"alone,1,2,4"`` -> ``[0, 1, 2, 4]`` (:data:`ALONE` is 0); empty or None -> ``[]``."""
    levels = []
    for piece in filter(None, (p.strip() for p in (text or "").split(","))):
        if piece == "alone":
            levels.append(ALONE)
        elif piece.isdigit() and int(piece) >= 1:
            levels.append(int(piece))
        else:
            raise VerispecError(f"--clients takes numbers of clients >= 1 and 'alone' (got '{piece}')")
    return list(dict.fromkeys(levels))


def level_name(clients: int) -> str:
    return "alone" if clients == ALONE else str(clients)


class GcClock:
    """Seconds Python's garbage collector ran while in use: a process-wide cost that lands inside
    whatever stage was running, so a method that leaves more garbage could look slower at work that
    is the same in every method."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._t0 = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    x = q * (len(s) - 1)
    lo = int(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def figures(results: list[GenerationResult], wall: float, latency: list[float], ttft: list[float]) -> dict[str, Any]:
    """Throughput and latency figures of one run, however it was served."""
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.metrics.steps for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_p50_s": percentile(latency, 0.5), "latency_p95_s": percentile(latency, 0.95),
            "ttft_p50_s": percentile(ttft, 0.5), "accepted_per_step": tokens / steps if steps else 0.0}


def closed_loop(be: Engine, prompts: list[list[int]], clients: int, params: SamplingParams,
                spec: Any) -> dict[str, Any]:
    """Serve ``prompts`` keeping ``clients`` requests in flight on ``be``; throughput and latency figures."""
    before = copy.deepcopy(be.stats.summary())  # its histograms are the live ones
    queue = list(prompts)
    inflight: list[Any] = []
    done: list[tuple[Any, GenerationResult]] = []
    t0 = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < clients:
            inflight.append(be.submit(queue.pop(0), params, spec))
        be.step()
        for h in [h for h in inflight if h.done]:
            inflight.remove(h)
            done.append((h, h.result()))
    wall = time.perf_counter() - t0
    latency = [h.finished_at - h.submitted_at for h, _ in done]
    ttft = [h.first_token_at - h.submitted_at for h, _ in done if h.first_token_at is not None]
    stats = _since(before, be.stats.summary())
    rows = stats["rows_steps"]
    return figures([r for _, r in done], wall, latency, ttft) | {
        "batch_steps": stats["steps"], "mean_rows": sum(b * n for b, n in rows.items()) / max(1, stats["steps"]),
        "catch_up_tokens": stats["catch_up_tokens"], "catch_up_s": stats["catch_up_s"], "decode_s": stats["step_s"],
        "prefill_s": stats["prefill_s"], "policy_k": stats["policy_k"], "width": stats["width_steps"]}


def _since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The engine's counters of one run: ``after`` less ``before`` (both ``EngineStats.summary()``), per key of
    its step histograms too."""
    out: dict[str, Any] = {}
    for key in ("steps", "step_s", "prefill_s", "catch_up_tokens", "catch_up_s"):
        out[key] = after[key] - before[key]
    for key in ("rows_steps", "width_steps", "policy_k"):
        counts = {k: n - before[key].get(k, 0) for k, n in after[key].items()}
        out[key] = dict(sorted((k, n) for k, n in counts.items() if n))
    return out


def one_at_a_time(engine: Engine, prompts: list[list[int]], params: SamplingParams, spec: Any) -> dict[str, Any]:
    """Serve ``prompts`` one after another through ``Engine.generate``."""
    results: list[GenerationResult] = []
    latency = []
    t0 = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        results.append(engine.generate(p, params, spec)[0])
        latency.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    total = Metrics()
    for r in results:
        total.merge(r.metrics)
    return figures(results, wall, latency, [r.metrics.ttft_s for r in results]) | {
        "prefill_s": total.stage_s["prefill"], "batch_steps": total.steps, "mean_rows": 1.0,
        "policy_k": dict(sorted(total.k_chosen.items())), "width": {}}


def beyond_prefill_tokens_per_s(run: dict[str, Any]) -> float:
    """Tokens per second of a run's wall time outside the target's prompt prefill (nan where none is left)."""
    rest = run["wall_s"] - run["prefill_s"]
    return run["tokens"] / rest if rest > 0 else float("nan")


def summarize(runs: dict[str, list[dict[str, Any]]], clients: int, baseline: str) -> list[dict[str, Any]]:
    """One row per method: its run of median throughput, with every run's tokens/s and the ratios to
    ``baseline``'s run of the same repeat, of total throughput and of throughput beyond prefill."""
    plain = runs.get(baseline)

    def paired(rs: list[dict[str, Any]], rate: Callable[[dict[str, Any]], float]) -> list[float]:
        return [rate(r) / rate(p) if rate(p) else float("nan") for r, p in zip(rs, plain, strict=False)] \
            if plain else []

    rows = []
    for method, rs in runs.items():
        median_run = sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2]
        ratios = paired(rs, lambda r: r["tokens_per_s"])
        beyond = paired(rs, beyond_prefill_tokens_per_s)
        rows.append(median_run | {
            "clients": level_name(clients), "method": method, "runs_tokens_per_s": [r["tokens_per_s"] for r in rs],
            "vs_plain_runs": ratios, "vs_plain": statistics.median(ratios) if ratios else float("nan"),
            "runs_beyond_prefill_tokens_per_s": [beyond_prefill_tokens_per_s(r) for r in rs],
            "beyond_prefill_vs_plain_runs": beyond,
            "beyond_prefill_vs_plain": statistics.median(beyond) if beyond else float("nan")})
    return rows


@dataclass(frozen=True)
class ClientMethod:
    """A method as the closed loop runs it: its engine (the one of its kernels), speculation and sampling."""

    engine: Engine
    spec: Any
    params: SamplingParams


def served(prompts: list[list[int]], clients: int) -> list[list[int]]:
    """The requests a level serves: the prompts, at least two per client (the list again from its start)."""
    n = max(len(prompts), 2 * clients)
    return [prompts[i % len(prompts)] for i in range(n)]


def run_levels(methods: dict[str, ClientMethod], prompts: list[list[int]], levels: list[int], repeats: int,
               baseline: str, progress: bool = True) -> list[dict[str, Any]]:
    """Every level of ``levels`` (:data:`ALONE` included) for every method, ``repeats`` times; the summary rows."""
    most = max(levels)
    batching: dict[int, Engine] = {}  # per loaded engine, one with a slot per client of the widest level
    for m in methods.values():
        if most and id(m.engine) not in batching:
            batching[id(m.engine)] = m.engine.with_config(max_batch=most)
    for be in batching.values():
        if any(m.spec.enabled and m.spec.k_policy == "cost" for m in methods.values()):
            be.profile()  # batch sizes up to the slots, before any timed request
    warm = SamplingParams(max_tokens=min(8, next(iter(methods.values())).params.max_tokens))
    for m in methods.values():  # kernels, allocator, drafters
        if ALONE in levels:
            one_at_a_time(m.engine, prompts[:1], warm, m.spec)
        if most:
            closed_loop(batching[id(m.engine)], served(prompts, most)[:most], most, warm, m.spec)

    rows = []
    for clients in levels:
        requests = served(prompts, max(clients, 1))
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in methods}
        for rep in range(repeats):
            order = list(methods) if rep % 2 == 0 else list(methods)[::-1]
            for label in order:
                m = methods[label]
                with GcClock() as clock:
                    r = one_at_a_time(m.engine, requests, m.params, m.spec) if clients == ALONE else \
                        closed_loop(batching[id(m.engine)], requests, clients, m.params, m.spec)
                r |= {"gc_s": clock.seconds, "gc_collections": clock.collections, "rss_bytes": rss_bytes()}
                runs[label].append(r)
                if progress:
                    print(f"clients {level_name(clients):>5} {label} run {rep + 1}/{repeats}: "
                          f"{r['tokens_per_s']:.1f} tok/s, p50 {r['latency_p50_s']:.2f} s, "
                          f"k {r['policy_k'] or r['width']}", flush=True)
        rows.extend(summarize(runs, clients, baseline))
    return rows


def _ratio(median: float, runs: list[float]) -> str:
    spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
    return f"{median:.2f}x{spread}"


def table(rows: list[dict[str, Any]], baseline: str) -> str:
    """The markdown table of the summary rows."""
    head = ("| clients | method | requests | tokens/s | vs plain | p50 latency s | p95 latency s | p50 TTFT s | "
            "tokens/step | k chosen (k: steps) | draft catch-up s (tokens) | vs plain beyond prefill |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n")
    lines = []
    for r in rows:
        ks = ", ".join(f"{k}: {n}" for k, n in r["policy_k"].items()) if r["policy_k"] else \
            ", ".join(f"{int(w) - 1}: {n}" for w, n in r["width"].items())
        catch_up = f"{r['catch_up_s']:.1f} ({r['catch_up_tokens']})" if "catch_up_s" in r else "-"
        own = r["method"] == baseline
        total = "1.00x" if own else _ratio(r["vs_plain"], r["vs_plain_runs"])
        beyond = "1.00x" if own else _ratio(r["beyond_prefill_vs_plain"], r["beyond_prefill_vs_plain_runs"])
        lines.append(f"| {r['clients']} | {r['method']} | {r['requests']} | {r['tokens_per_s']:.1f} | {total} | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['accepted_per_step']:.2f} | {ks} | {catch_up} | {beyond} |")
    return head + "\n".join(lines)
