"""Throughput and latency under concurrency: plain vs speculative (fixed k) vs the concurrency-aware policy.

A closed loop of C clients (C in --concurrency) each keeps one request in flight on one
Engine with slots: when a request finishes, the next Spec-Bench prompt takes its place. For every C and
mode it reports total throughput (generated tokens / wall time) and per-request latency (submit to
last token, p50/p95) and time to first token; the concurrency-aware mode also records the k it
chose. Writes concurrency.md, concurrency.json and concurrency.png into --out.

    python bench/concurrency.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --dtype bfloat16 --max-tokens 128 --out bench_out/concurrency

Any model the loader opens works (registry names, GGUF files, Hugging Face folders); --method ngram
benchmarks prompt lookup instead of the draft model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verispec import Engine, SamplingParams, SpecConfig, VerispecError
from verispec.bench.datasets import default_spec_bench, spec_bench
from verispec.bench.hardware import machine
from verispec.config import DEFAULT_SPEC, PLAIN, dtype_name, spec_defaults
from verispec.engine.engine import GenerationResult
from verispec.engine.metrics import Metrics
from verispec.engine.step import EngineStats

ALONE = "alone"  # Engine.generate with the cost policy, one request after another (concurrency 1 only)
MODES = ("plain", "fixed", "policy", ALONE)


class GcClock:
    """Seconds Python's garbage collector ran while in use: a process-wide cost that lands inside
    whatever stage was running (prefill included), so a mode that leaves more garbage could look
    slower at work that is the same in every mode."""

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


def rss_gib() -> float:
    """This process's resident memory now, GiB (0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    x = q * (len(s) - 1)
    lo = int(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def closed_loop(be: Engine, prompts: list[list[int]], clients: int, params: SamplingParams,
                spec: SpecConfig) -> dict[str, Any]:
    """Serve ``prompts`` keeping ``clients`` requests in flight; return throughput and latency figures."""
    be.stats = EngineStats()
    queue = list(prompts)
    inflight = []
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
    return figures([r for _, r in done], wall, latency, ttft) | {
        "batch_steps": be.stats.steps, "mean_rows": be.stats.summary()["mean_rows"],
        "catch_up_tokens": be.stats.catch_up_tokens, "catch_up_s": be.stats.catch_up_s,
        "decode_s": be.stats.step_s, "prefill_s": be.stats.prefill_s,
        "policy_k": dict(sorted(be.stats.policy_k.items())), "width": dict(sorted(be.stats.width_steps.items()))}


def figures(results: list[GenerationResult], wall: float, latency: list[float], ttft: list[float]) -> dict[str, Any]:
    """Throughput and latency figures of one run, however it was served."""
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.metrics.steps for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_p50_s": percentile(latency, 0.5), "latency_p95_s": percentile(latency, 0.95),
            "ttft_p50_s": percentile(ttft, 0.5), "accepted_per_step": tokens / steps if steps else 0.0}


def one_at_a_time(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                  spec: SpecConfig) -> dict[str, Any]:
    """Serve ``prompts`` one after another through ``Engine.generate``: the single-request speedup that
    the batching engine at one client should keep."""
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
    """Tokens per second of a run's wall time outside the target's prompt prefill.

    Prefill is the same work in every mode (the target reads each prompt; drafts read theirs later,
    in the decode steps), so this is the throughput the mode itself decides; on a host where prefill
    takes most of the wall time, its noise would otherwise hide the modes' differences.
    """
    rest = run["wall_s"] - run["prefill_s"]
    return run["tokens"] / rest if rest > 0 else float("nan")


def summarize(runs: dict[str, list[dict[str, Any]]], concurrency: int) -> list[dict[str, Any]]:
    """One row per mode: its run of median throughput, with every run's tokens/s and the ratios to
    plain decoding's run of the same repeat (paired, so a drift of the host cancels out; a mode run
    only once pairs with the first), of total throughput and of throughput beyond prefill."""
    plain = runs.get("plain")

    def paired(rs: list[dict[str, Any]], rate: Callable[[dict[str, Any]], float]) -> list[float]:
        return [rate(r) / rate(p) if rate(p) else float("nan") for r, p in zip(rs, plain, strict=False)] \
            if plain else []

    rows = []
    for mode, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        median_run = sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2]
        ratios = paired(rs, lambda r: r["tokens_per_s"])
        beyond = paired(rs, beyond_prefill_tokens_per_s)
        rows.append(median_run | {
            "concurrency": concurrency, "mode": mode, "runs_tokens_per_s": tps, "vs_plain_runs": ratios,
            "vs_plain": statistics.median(ratios) if ratios else float("nan"),
            "runs_beyond_prefill_tokens_per_s": [beyond_prefill_tokens_per_s(r) for r in rs],
            "beyond_prefill_vs_plain_runs": beyond,
            "beyond_prefill_vs_plain": statistics.median(beyond) if beyond else float("nan")})
    return rows


def ratio_cell(median: float, runs: list[float], ranged: bool) -> str:
    """A ratio to plain decoding, with its runs' range in brackets where ``ranged`` and there are several."""
    spread = f" ({min(runs):.2f}-{max(runs):.2f})" if ranged and len(runs) > 1 else ""
    return f"{median:.2f}x{spread}"


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    head = (f"{header}\n\n| concurrency | mode | requests | tokens/s | vs plain | p50 latency s | p95 latency s | "
            "p50 TTFT s | tokens/step | k chosen (k: steps) | draft catch-up s (tokens) | vs plain beyond prefill |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n")
    lines = []
    for r in rows:
        ks = ", ".join(f"{k}: {n}" for k, n in r["policy_k"].items()) if r["mode"] in ("policy", ALONE) else \
            ", ".join(f"{w - 1}: {n}" for w, n in r["width"].items())
        ratios = r.get("vs_plain_runs", [])
        catch_up = f"{r['catch_up_s']:.1f} ({r['catch_up_tokens']})" if "catch_up_s" in r else "-"
        ranged = r["mode"] != "plain"
        total = ratio_cell(r["vs_plain"], ratios, ranged)
        beyond = ratio_cell(r["beyond_prefill_vs_plain"], r.get("beyond_prefill_vs_plain_runs", []), ranged)
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{total} | {r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | "
                     f"{r['ttft_p50_s']:.3f} | {r['accepted_per_step']:.2f} | {ks} | {catch_up} | {beyond} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        xs = [r["concurrency"] for r in rs]
        ax1.plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=mode)
        line = ax2.plot(xs, [r["latency_p50_s"] for r in rs], marker="o", label=f"{mode} p50")[0]
        ax2.plot(xs, [r["latency_p95_s"] for r in rs], marker="x", linestyle="--", color=line.get_color(),
                 label=f"{mode} p95")
    levels = sorted({r["concurrency"] for r in rows})
    for ax, ylabel in ((ax1, "total throughput (tokens/s)"), (ax2, "request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--method", default=DEFAULT_SPEC.method, choices=("draft", "hybrid", "ngram"),
                    help="the drafter; every other speculation setting is verispec's default")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--weights", default="dense", help="the target's weight format")
    ap.add_argument("--draft-weights", default="dense", help="the draft's weight format (int4-all: cheapest drafts)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048, help="context per request slot")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("-k", type=int, default=5, help="fixed k, and the policy's largest k")
    ap.add_argument("--requests", type=int, default=32,
                    help="requests per run; at least twice the clients (C clients serve max(REQUESTS, 2C) prompts, "
                         "the first of one shuffled list)")
    ap.add_argument("--spec-bench", type=Path, default=None, help=f"question.jsonl (default {default_spec_bench()})")
    ap.add_argument("--seed", type=int, default=0, help="which Spec-Bench prompts (shuffled with this seed)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"any of {', '.join(MODES)} ({ALONE}: Engine.generate with the cost policy, one request "
                    "at a time; run at concurrency 1 only)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per concurrency and mode, modes alternating; medians are reported (a shared host "
                         "drifts by several percent between runs)")
    ap.add_argument("--once", default="", help="modes run only in the first repeat (e.g. fixed, far from plain)")
    ap.add_argument("--out", type=Path, default=Path("bench_out/concurrency"))
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype, args.device)

    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    once = {m for m in args.once.split(",") if m}
    if args.repeats < 1 or not set(modes) <= set(MODES) or not once <= set(modes) or "plain" in once:
        ap.error(f"--repeats >= 1; --modes from {', '.join(MODES)}; --once a subset of them, without plain")
    engine = Engine.from_pretrained(args.model, draft=args.draft if args.method != "ngram" else None,
                                    dtype=args.dtype, weights=args.weights, draft_weights=args.draft_weights,
                                    device=args.device, max_len=args.max_len, progress=True, prefix_reuse=False)
    # No prefix reuse (here or in ``engine``): every mode serves the same prompts, and reuse would spare the
    # later modes their prefill.
    be = engine.with_config(max_batch=max(levels), max_len=args.max_len)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=False)
    n = max(args.requests, 2 * max(levels))
    prompts = []
    for p in spec_bench(args.spec_bench, seed=args.seed):
        try:
            ids = engine.encode(p.text, chat=p.chat)
        except VerispecError:  # longer than the context, or no tokenizer (tiny test models: characters as ids)
            if engine.tokenizer is not None:
                continue
            ids = [ord(ch) % engine.target.args.vocab_size for ch in p.text[: be.max_len // 4]]
        if len(ids) + args.max_tokens <= be.max_len:  # a longer one could never be admitted
            prompts.append(ids)
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[:n]
    if not prompts:
        ap.error(f"no Spec-Bench prompt fits a context of {be.max_len} with {args.max_tokens} new tokens")
    # What a user gets by naming only the method (its k policy, draft head, window and confidence stop).
    specs = {"plain": PLAIN, "fixed": spec_defaults(method=args.method, k=args.k, k_policy="fixed"),
             "policy": spec_defaults(method=args.method, k=args.k, k_policy="cost")}
    specs[ALONE] = specs["policy"]
    costs = be.profile(k_max=args.k)
    for mode in modes:  # warm-up: kernels, allocator, drafters (each engine profiles its costs)
        if mode == ALONE:
            one_at_a_time(engine, prompts[:1], SamplingParams(max_tokens=8), specs[mode])
        else:
            closed_loop(be, prompts[: max(levels)], max(levels), SamplingParams(max_tokens=8), specs[mode])

    rows = []
    for c in levels:
        here = [m for m in modes if m != ALONE or c == 1]
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in here}
        served = prompts[: max(args.requests, 2 * c)]  # two waves at least: requests come and go
        for rep in range(args.repeats):
            # Alternating, so a slow spell of the host hits every mode alike; every other repeat in
            # reverse order, so a steady drift of the host does not always favour the mode run first.
            for mode in (here if rep % 2 == 0 else here[::-1]):
                if rep and mode in once:
                    continue
                with GcClock() as gc_clock:
                    r = one_at_a_time(engine, served, params, specs[mode]) if mode == ALONE else \
                        closed_loop(be, served, c, params, specs[mode])
                r |= {"gc_s": gc_clock.seconds, "gc_collections": gc_clock.collections, "rss_gib": rss_gib()}
                runs[mode].append(r)
                print(f"C={c:3d} {mode:7s} run {rep + 1}/{args.repeats} {r['tokens_per_s']:8.1f} tok/s  "
                      f"p50 {r['latency_p50_s']:.2f}s  p95 {r['latency_p95_s']:.2f}s  k {r['policy_k'] or r['width']}"
                      f"  decode {r.get('decode_s', 0.0):.1f}s  prefill {r.get('prefill_s', 0.0):.1f}s"
                      f"  catch-up {r.get('catch_up_s', 0.0):.1f}s  wall {r['wall_s']:.1f}s"
                      f"  gc {r['gc_s']:.2f}s ({r['gc_collections']})  rss {r['rss_gib']:.2f} GiB", flush=True)
        rows.extend(summarize(runs, c))

    info = machine()
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(args.device)
    where = info.get("gpu") or f"{info['cpu']}, {info['threads']} threads"
    weights = f"{args.dtype}, target {args.weights}"
    if args.method != "ngram":
        weights += f", draft {args.draft_weights}"
    title = f"{Path(args.model).name} + {args.method} ({weights}), {args.max_tokens} tokens, {where}"
    header = (f"# Concurrency sweep\n\n{title}, {info['date']}. Spec-Bench prompts per run: "
              f"max({args.requests}, 2 x clients), the first of one list shuffled with seed {args.seed}; "
              f"closed loop, greedy; fixed k = {args.k}; policy = verispec's defaults for {args.method} (cost "
              f"policy, k <= {args.k})"
              + (f"; {ALONE} = one slot with the cost policy, one request at a time." if ALONE in modes
                 else "."))
    if args.repeats > 1:
        header += (f" {args.repeats} runs per concurrency and mode, modes alternating (in reverse order every "
                   "other repeat): each row is the run of median throughput; vs plain is the median of the "
                   "per-repeat ratios (range in brackets).")
    header += (" Beyond prefill: tokens per second of the wall time outside the target's prompt prefill (the same "
               "work in every mode), against plain decoding's, paired by repeat as above.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.md").write_text(markdown(rows, header))
    (args.out / "concurrency.json").write_text(json.dumps(
        {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
         "profiled_target_s": {b: c.points for b, c in costs.target.curves.items()},
         "profiled_draft_s": costs.draft.points if costs.draft else None,
         "profiled_context": costs.per_position.context, "target_context_s": costs.per_position.target_s,
         "draft_context_s": costs.per_position.draft_s,
         "mean_tokens_per_s": {m: statistics.mean(r["tokens_per_s"] for r in rows if r["mode"] == m)
                               for m in modes if any(r["mode"] == m for r in rows)}}, indent=2))
    plot(rows, args.out / "concurrency.png", title)
    print(markdown(rows, header))
    print(f"wrote {args.out}/concurrency.md, concurrency.json and concurrency.png")


if __name__ == "__main__":
    main()
