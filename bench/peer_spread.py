"""Run-to-run spread of the ratios against llama.cpp and against own plain decoding, per category.

``verispec bench`` runs its peers after its own methods, so a host that drifts between the two
phases moves every ratio against the peer. Here llama.cpp plain decoding is one more method of the
same interleaved run: each prompt is decoded by every method, repeat after repeat
(:class:`~verispec.bench.harness.BenchRunner`), so a ratio of one repeat compares runs seconds
apart. Per category and repeat: tokens/s of every method (the prefill included) over llama.cpp
plain decoding's and over verispec's plain decoding's; the table gives the median over repeats and
the range. Usage:

    python bench/peer_spread.py [--kernels q8] [--datasets chat_code,spec_bench] [--categories translation]
                                [--repeats 3] [--max-tokens 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from verispec import Engine, SamplingParams
from verispec.bench.datasets import load
from verispec.bench.hardware import machine
from verispec.bench.harness import BenchRunner, Item, engine_generate
from verispec.bench.methods import parse_methods
from verispec.bench.peers import LLAMACPP_PLAIN, LlamaCppPeers, llamacpp_context
from verispec.config import dtype_name, spec_defaults

MODEL, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def ratios(items: list[Item], records: dict[str, list[Any]], repeats: int) -> dict[str, dict[str, list[list[float]]]]:
    """category -> method -> [per-repeat tokens/s over llama.cpp's, per-repeat tokens/s over own plain's]."""
    by_cat: dict[str, list[int]] = defaultdict(list)
    for item in items:
        by_cat[item.category].append(item.index)
        by_cat["overall"].append(item.index)
    out: dict[str, dict[str, list[list[float]]]] = {}
    for cat, idx in by_cat.items():
        rate = {label: [sum(len(recs[i].token_ids) for i in idx) / sum(recs[i].wall_s[r] for i in idx)
                        for r in range(repeats)] for label, recs in records.items()}
        out[cat] = {label: [[a / b for a, b in zip(rate[label], rate[LLAMACPP_PLAIN], strict=True)],
                            [a / b for a, b in zip(rate[label], rate["plain"], strict=True)]]
                    for label in records if label != LLAMACPP_PLAIN}
    return out


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--methods", default="none,hybrid,hybrid:lookup=suffix,k=16,global=0")
    ap.add_argument("--datasets", default="chat_code,spec_bench")
    ap.add_argument("--categories", default="translation,summarization")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    prompts = load(args.datasets, per_category=args.per_category, seed=args.seed,
                   categories=[c for c in args.categories.split(",") if c] or None)
    dtype = dtype_name("auto")  # bf16 where the CPU computes it natively, else fp32
    engine = Engine.from_pretrained(MODEL, draft=DRAFT, dtype=dtype, weights="int4", draft_weights="int4-all",
                                    kernels=args.kernels, prefix_reuse=False)
    engine.profile()
    methods = parse_methods(args.methods, spec_defaults())
    items = [Item(i, p.id, p.category, 1, p.text, p.chat) for i, p in enumerate(prompts)]
    n_ctx = llamacpp_context([len(engine.encode(i.payload, i.chat)) for i in items], args.max_tokens,
                             engine.max_len, 10)
    peers = LlamaCppPeers.load(engine, MODEL, 10, n_ctx)
    gens = {("plain" if m.is_baseline else m.label): engine_generate(engine, m.spec) for m in methods}
    gens[LLAMACPP_PLAIN] = peers.methods()[LLAMACPP_PLAIN]
    runner = BenchRunner(SamplingParams(max_tokens=args.max_tokens), args.repeats, progress=False)
    try:
        records = runner.run_items(gens, items)
    finally:
        peers.close()
    table = ratios(items, records, args.repeats)

    m = machine()
    lines = [f"{MODEL} (int4) + {DRAFT} (int4-all), {dtype}, kernels {args.kernels}, {m['cpu']}, {m['threads']} "
             f"threads, {m['date']}. Prompts: {args.datasets} (Spec-Bench seed {args.seed}, {args.per_category} per "
             f"category of {args.categories or 'all'}); {args.max_tokens} new tokens, greedy; {args.repeats} repeats, "
             "every method (llama.cpp plain decoding included, same GGUF, same prompt token ids) on each prompt in "
             "turn. Tokens/s include the prefill; each cell: the median over repeats of that repeat's ratio (range "
             "in brackets).", "",
             "| category | method | vs llama.cpp plain | vs own plain |", "|---|---|---:|---:|"]
    for cat, per_method in table.items():
        for label, (vs_peer, vs_plain) in per_method.items():
            lines.append(f"| {cat} | {label} | {_cell(vs_peer)} | {_cell(vs_plain)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "peer_spread.md").write_text(text + "\n", encoding="utf-8")
        (out / "peer_spread.json").write_text(json.dumps({"machine": m, "args": vars(args), "ratios": table},
                                                         indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
