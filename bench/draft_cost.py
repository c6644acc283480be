"""The draft cost ratio c = (one draft token) / (one target step), per draft weight format, side by side.

One target is loaded; for each draft format the draft model is loaded and ``Engine.profile``
times a one-token target forward and a draft token on the same dummy context (min of
``--reps``). Usage:

    python bench/draft_cost.py [--weights dense] [--draft-formats dense,int8,int4] [--reps 7]
"""

from __future__ import annotations

import argparse
import gc

from verispec import Engine
from verispec.bench.runner import machine
from verispec.drafters.model import ModelDrafter
from verispec.models.loader import build_model, open_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="dense", help="the target's weight format")
    ap.add_argument("--draft-formats", default="dense,int8,int4")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights=args.weights, max_len=512, progress=False)
    src = open_source(args.draft)
    info = machine()
    print(f"\ndraft cost ratio c, target {args.model} ({args.dtype}, {args.weights}), draft {args.draft}, "
          f"{info['cpu']}, {info['threads']} threads, {info['date']}\n")
    print("| draft weights | draft ms/token | target ms/step | c |\n|---|---:|---:|---:|")
    for fmt in args.draft_formats.split(","):
        draft = build_model(src, engine.target.dtype, fmt, progress=False)
        drafter = ModelDrafter(draft, 512, engine.target.args.vocab_size)
        engine.profile(drafter, 1, reps=2)  # warm-up
        costs = engine.profile(drafter, 1, reps=args.reps)
        print(f"| {fmt} | {costs.draft_s * 1e3:.1f} | {costs.verify_s[0] * 1e3:.1f} | "
              f"{costs.draft_s / costs.verify_s[0]:.3f} |", flush=True)
        del drafter, draft
        gc.collect()


if __name__ == "__main__":
    main()
