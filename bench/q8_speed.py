"""int4 layers on 8-bit activations (``--kernels q8``) against verispec's bf16 kernels, end to end.

Two engines hold the same int4 pair, one per kernels choice. Each decodes the same prompts (the report
split: Spec-Bench seed 1, one per category, the first HumanEval problems from 100, chat-formatted coding
requests and code edits) plainly and with verispec's defaults; engines and methods alternate prompt by
prompt, their order reversed every other repeat, so a drifting host is shared. Reports tokens/s (whole
request, prefill included, and decode alone), q8's ratio to the bf16 kernels per method (median over
repeats, range in brackets), tokens per target forward, and how many plain outputs the two kernels
decode token for token alike (8-bit activations move the logits a little, so a near tie may flip).
Usage:

    python bench/q8_speed.py [--max-tokens 128] [--repeats 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from verispec import Engine, SamplingParams, SpecConfig, kernels
from verispec.bench.datasets import load
from verispec.bench.hardware import machine
from verispec.config import DEFAULT_SPEC, PLAIN, dtype_name
from verispec.engine.metrics import Metrics

KERNELS = ("auto", "q8")
METHODS: dict[str, SpecConfig] = {"plain": PLAIN, "hybrid (defaults)": DEFAULT_SPEC}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--draft-weights", default="int4-all")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048, help="context per request")
    ap.add_argument("--per-set", type=int, default=4, help="prompts from HumanEval, chat_code and code_edit each")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_out/q8"))
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)
    if not kernels.q8_available():  # a report that says so, so a run_all over every step goes on
        info = machine()
        md = (f"{info['cpu']}, {info['date'][:10]}: no q8 path on this host (it needs AVX-512 VNNI, or AVX2 "
              "without AVX-512 BF16).\n")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "q8_speed.md").write_text(md)
        (args.out / "q8_speed.json").write_text(json.dumps({"machine": info, "rows": []}, indent=2))
        print(md)
        return

    engines = {kern: Engine.from_pretrained(args.model, draft=args.draft, dtype=args.dtype, weights=args.weights,
                                            draft_weights=args.draft_weights, max_len=args.max_len, progress=False,
                                            prefix_reuse=False, kernels=kern) for kern in KERNELS}
    n = args.per_set
    items = (load("spec_bench", per_category=1, seed=1) + load(f"humaneval:100-{99 + n}")
             + load("chat_code", n=n) + load("code_edit", n=n))
    first = engines["auto"]
    # Tiny test models have no tokenizer: their prompts are characters as ids.
    prompts = [first.encode(p.text, chat=p.chat) if first.tokenizer is not None else
               [ord(ch) % first.target.args.vocab_size for ch in p.text[: args.max_len // 4]] for p in items]
    params = SamplingParams(max_tokens=args.max_tokens)
    runs = [(kern, name) for kern in KERNELS for name in METHODS]
    for engine in engines.values():  # kernels, allocator, drafters, the cost policy's profile
        engine.generate(prompts[0], SamplingParams(max_tokens=8), DEFAULT_SPEC)
    per_repeat: dict[tuple[str, str], list[Metrics]] = {r: [] for r in runs}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        totals = {r: Metrics() for r in runs}
        order = runs if rep % 2 == 0 else runs[::-1]
        for prompt in prompts:
            for kern, name in order:
                res = engines[kern].generate(prompt, params, METHODS[name])[0]
                totals[kern, name].merge(res.metrics)
                if rep == 0 and name == "plain":
                    outputs.setdefault(kern, []).append(res.token_ids)
        for r in runs:
            per_repeat[r].append(totals[r])
            print(f"repeat {rep + 1}/{args.repeats} {r[0]:4s} {r[1]:18s} {totals[r].tokens_per_s:6.1f} tok/s",
                  flush=True)

    rows: list[dict[str, Any]] = []
    for kern, name in runs:
        ms = per_repeat[kern, name]
        base = per_repeat["auto", name]
        ratios = [m.tokens_per_s / b.tokens_per_s for m, b in zip(ms, base, strict=True)]
        rows.append({"kernels": kern, "method": name,
                     "tokens_per_s": statistics.median(m.tokens_per_s for m in ms),
                     "decode_tokens_per_s": statistics.median(m.decode_tokens_per_s for m in ms),
                     "vs_auto": statistics.median(ratios), "vs_auto_runs": ratios,
                     "vs_plain_auto": statistics.median(m.tokens_per_s / b.tokens_per_s for m, b in
                                                        zip(ms, per_repeat["auto", "plain"], strict=True)),
                     "mean_accepted_length": statistics.median(m.mean_accepted_length for m in ms)})
    same = sum(a == b for a, b in zip(outputs["auto"], outputs["q8"], strict=True))

    info = machine()
    header = (f"{args.model} ({args.weights}) + {args.draft} ({args.draft_weights}), {args.dtype}, {info['cpu']}, "
              f"{info['threads']} threads, {info['date'][:10]}. Report split: Spec-Bench seed 1 (one per "
              f"category), HumanEval 100-{99 + n}, the first {n} `chat_code` and {n} `code_edit` requests "
              f"({len(prompts)} prompts); {args.max_tokens} new tokens, greedy; {args.repeats} repeats, kernels and "
              "methods alternating prompt by prompt. Tokens/s of whole requests (prefill included) and of the "
              "decode alone; vs bf16 kernels: median of the per-repeat ratios (range in brackets). Plain outputs "
              f"identical under both kernels: {same} of {len(prompts)}.")
    lines = [header, "", "| kernels | method | tokens/s | decode tokens/s | vs bf16 kernels | vs plain (bf16 kernels) "
             "| tokens / forward |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kernels']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['vs_auto']:.2f}x ({min(r['vs_auto_runs']):.2f}-{max(r['vs_auto_runs']):.2f}) | "
                     f"{r['vs_plain_auto']:.2f}x | {r['mean_accepted_length']:.2f} |")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "q8_speed.md").write_text(md)
    (args.out / "q8_speed.json").write_text(json.dumps(
        {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
         "plain_identical": same, "prompts": len(prompts)}, indent=2))
    print(md)


if __name__ == "__main__":
    main()
