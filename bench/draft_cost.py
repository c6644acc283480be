"""The draft cost ratio c = (one draft token) / (one target step), per draft weight format, side by side.

One target is loaded; for each draft format the draft model is loaded and ``Engine.profile``
times a one-token target forward and a draft token on the same dummy context (min of
``--reps``). ``--vocab`` also times reduced draft heads (``draft:vocab=N``, see
verispec/drafters/vocab.py; 0 is the full head); the dummy context has no ids past N, so a reduced
head scores the prefix plus the tokenizer's special tokens only. Usage:

    python bench/draft_cost.py [--weights dense] [--draft-formats dense,int8,int4] [--reps 7]
    python bench/draft_cost.py --draft-formats int4-all --vocab 0,16384,32768,49152
"""

from __future__ import annotations

import argparse
import gc

from verispec import Engine
from verispec.bench.hardware import machine
from verispec.drafters.model import ModelDrafter
from verispec.drafters.vocab import special_token_ids
from verispec.models.loader import build_model, open_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="dense", help="the target's weight format")
    ap.add_argument("--draft-formats", default="dense,int8,int4")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--vocab", default="0", help="draft head sizes to time, comma-separated; 0 = the full head")
    args = ap.parse_args()
    sizes = [int(v) for v in args.vocab.split(",") if v.strip()]  # ModelDrafter checks each (multiple of 16)

    engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights=args.weights, max_len=512, progress=False)
    src = open_source(args.draft)
    info = machine()
    print(f"\ndraft cost ratio c, target {args.model} ({args.dtype}, {args.weights}), draft {args.draft}, "
          f"{info['cpu']}, {info['threads']} threads, {info['date']}\n")
    print("| draft weights | draft vocab | draft ms/token | target ms/step | c |\n|---|---:|---:|---:|---:|")
    specials = special_token_ids(engine.tokenizer, engine.eos_ids)
    for fmt in args.draft_formats.split(","):
        draft = build_model(src, engine.target.dtype, fmt, progress=False)
        for size in sizes:
            drafter = ModelDrafter(draft, 512, engine.target.args.vocab_size, draft_vocab=size or None,
                                   special_ids=specials)
            engine.profile(drafter, 1, reps=2)  # warm-up
            costs = engine.profile(drafter, 1, reps=args.reps)
            label = f"{size} + {len(drafter.head.extra_ids)}" if drafter.head is not None else "full"
            print(f"| {fmt} | {label} | {costs.draft_s * 1e3:.1f} | {costs.verify_s[0] * 1e3:.1f} | "
                  f"{costs.draft_s / costs.verify_s[0]:.3f} |", flush=True)
            del drafter
        del draft
        gc.collect()


if __name__ == "__main__":
    main()
