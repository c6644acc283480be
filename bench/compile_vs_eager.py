"""Eager vs ``--compile`` on the real pair, side by side in one run.

For each mode the engine is built (the compiled one warms up its m buckets first: that time is
reported separately), then plain decoding and fixed-k speculation run on the same prompts.
Figures per mode: plain ms per step (one target forward of 1 token), verification ms per step
(k + 1 tokens), draft ms per token, per-step overhead (time outside propose/score/verify per
step: the engine's Python glue), end-to-end tokens/s. Usage:

    python bench/compile_vs_eager.py [--model ...] [--draft ...] [--dtype bfloat16] [--weights dense]
        [--draft-weights int8] [-k 3] [--tokens 48] [--prompts 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

from verispec import Engine, SamplingParams, SpecConfig
from verispec.bench.datasets import humaneval
from verispec.bench.hardware import machine
from verispec.config import dtype_name
from verispec.engine.metrics import Metrics


def run_mode(args: argparse.Namespace, compiled: bool, prompts: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, draft=args.draft, dtype=args.dtype, weights=args.weights,
                                    draft_weights=args.draft_weights, max_len=args.max_len, compile=compiled,
                                    compile_k=args.k, progress=False)
    build_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    spec = SpecConfig(method="draft", k=args.k, k_policy="fixed")
    ids = [engine.encode(p) for p in prompts]
    engine.generate(ids[0], SamplingParams(max_tokens=4))  # warm-up, both paths
    engine.generate(ids[0], SamplingParams(max_tokens=4), spec)
    plain, speculative = Metrics(), Metrics()
    for x in ids:
        plain.merge(engine.generate(x, params)[0].metrics)
        speculative.merge(engine.generate(x, params, spec)[0].metrics)
    failed = any(getattr(m.forward, "failed", False) for m in (engine.target, engine.draft) if m is not None)
    del engine
    gc.collect()

    def per_step(m: Metrics, stage: str) -> float:
        return 1e3 * m.stage_s[stage] / max(m.steps, 1)

    return {"mode": "compiled" if compiled else "eager", "load_and_compile_s": build_s, "fell_back": failed,
            "plain_ms_per_step": per_step(plain, "score"), "plain_overhead_ms_per_step": 1e3 * plain.other_s /
            max(plain.steps, 1), "plain_tokens_per_s": plain.tokens_per_s,
            "verify_ms_per_step": per_step(speculative, "score"),
            "draft_ms_per_token": 1e3 * speculative.stage_s["propose"] / max(speculative.drafted, 1),
            "spec_overhead_ms_per_step": 1e3 * speculative.other_s / max(speculative.steps, 1),
            "spec_tokens_per_s": speculative.tokens_per_s, "mean_accepted_length": speculative.mean_accepted_length}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--weights", default="dense")
    ap.add_argument("--draft-weights", default="int8")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3, help="first N HumanEval prompts")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)

    prompts = [p.text for p in humaneval(args.prompts)]
    rows = [run_mode(args, False, prompts), run_mode(args, True, prompts)]
    info = machine()
    print(f"\neager vs --compile, {args.model} ({args.dtype}, {args.weights}) with draft {args.draft} "
          f"({args.draft_weights}), k={args.k}, {args.prompts} HumanEval prompts x {args.tokens} tokens, "
          f"{info['cpu']}, {info['threads']} threads, {info['date']}\n")
    keys = [k for k in rows[0] if k != "mode"]
    print("| figure | eager | compiled | compiled / eager |\n|---|---:|---:|---:|")
    for k in keys:
        e, c = rows[0][k], rows[1][k]
        if isinstance(e, bool):
            print(f"| {k} | {e} | {c} | |")
        else:
            print(f"| {k} | {e:.2f} | {c:.2f} | {c / e if e else float('nan'):.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
