"""The draft cost ratio c = (one draft token) / (one target step), per draft weight format, side by side.

One target is loaded and ``Engine.profile`` times its one-token forward; for each draft format the
draft model is loaded into a one-slot draft runner (the engine's), which drafts 4 tokens after the
same 64-token dummy context (per token, min of ``--reps``). ``--vocab`` also times reduced draft
heads (``draft:vocab=N``, see verispec/drafters/vocab.py; 0 is the full head); the dummy context has
no ids past N, so a reduced head scores the prefix plus the tokenizer's special tokens only. Usage:

    python bench/draft_cost.py [--weights dense] [--draft-formats dense,int8,int4] [--reps 7]
    python bench/draft_cost.py --draft-formats int4-all --vocab 0,16384,32768,49152
"""

from __future__ import annotations

import argparse
import gc
import time

from verispec import Engine, SamplingParams
from verispec.bench.hardware import machine
from verispec.config import dtype_name
from verispec.drafters.vocab import special_token_ids
from verispec.engine.draft_runner import DraftRow, DraftRunner
from verispec.models.loader import build_model, open_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--weights", default="dense", help="the target's weight format")
    ap.add_argument("--draft-formats", default="dense,int8,int4")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--vocab", default="0", help="draft head sizes to time, comma-separated; 0 = the full head")
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)
    sizes = [int(v) for v in args.vocab.split(",") if v.strip()]  # the runner checks each (multiple of 16)

    engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights=args.weights, max_len=512, progress=False)
    src = open_source(args.draft)
    info = machine()
    print(f"\ndraft cost ratio c, target {args.model} ({args.dtype}, {args.weights}), draft {args.draft}, "
          f"{info['cpu']}, {info['threads']} threads, {info['date']}\n")
    print("| draft weights | draft vocab | draft ms/token | target ms/step | c |\n|---|---:|---:|---:|---:|")
    specials = special_token_ids(engine.tokenizer, engine.eos_ids)
    target_s = engine.profile(k_max=1, reps=args.reps).target_s(1)
    vocab = engine.target.args.vocab_size
    context = [(7 * i + 3) % min(vocab, 16384) for i in range(64)]
    greedy = SamplingParams(max_tokens=8)
    for fmt in args.draft_formats.split(","):
        draft = build_model(src, engine.target.dtype, fmt, progress=False)
        for size in sizes:
            runner = DraftRunner(draft, 1, 512, vocab, specials)
            runner.begin(0, context, size or None)
            runner.propose([DraftRow(0, context, 1, greedy, None)])  # reads the context; warm-up
            per_token = []
            for _ in range(args.reps + 1):
                runner.commit(0, len(context) - 1)
                t0 = time.perf_counter()
                n = len(runner.propose([DraftRow(0, context, 4, greedy, None)])[0].tokens)
                per_token.append((time.perf_counter() - t0) / max(n, 1))
            draft_s = min(per_token[1:])
            head = runner._row_vocab.get(0)
            label = f"{size} + {int(head[1].numel())}" if head is not None else "full"
            print(f"| {fmt} | {label} | {draft_s * 1e3:.1f} | {target_s * 1e3:.1f} | {draft_s / target_s:.3f} |",
                  flush=True)
            del runner
        del draft
        gc.collect()


if __name__ == "__main__":
    main()
