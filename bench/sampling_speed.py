"""What sampling costs end to end: plain decoding greedy, at a temperature, and with top-p, and a sampled
speculative step's verification against its scoring, side by side in one run.

Every mode decodes the same prompts (the report split's Spec-Bench sample, seed 1, one per category,
and the first chat-formatted coding requests) on one engine; modes alternate prompt by prompt, their
order reversed every other repeat, so a drifting host is shared. Tokens/s are of the decode alone
(wall time outside the target's prompt prefill, which no sampler touches); "vs greedy" is the median
over repeats of the ratio to greedy plain decoding's repeat. For each mode the verification stage
(turning scores into distributions, the acceptance test, the draw) is given as a share of the
scoring stage (the target forward), from the engine's per-stage timers. Usage:

    python bench/sampling_speed.py [--weights int4 --draft-weights int4-all] [--max-tokens 128]
                                   [--temperature 0.8] [--top-p 0.9] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from verispec import Engine, SamplingParams, SpecConfig
from verispec.bench.datasets import load
from verispec.bench.hardware import machine
from verispec.config import DEFAULT_SPEC, dtype_name
from verispec.engine.metrics import Metrics


def modes(temperature: float, top_p: float, max_tokens: int) -> dict[str, tuple[SamplingParams, SpecConfig | None]]:
    """Mode name -> (sampling, speculation); the first is the baseline the others are divided by."""
    greedy = SamplingParams(max_tokens=max_tokens)
    warm = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    nucleus = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=0)
    return {
        "plain, greedy": (greedy, None),
        f"plain, temperature {temperature}": (warm, None),
        f"plain, temperature {temperature}, top-p {top_p}": (nucleus, None),
        "hybrid (defaults), greedy": (greedy, DEFAULT_SPEC),
        f"hybrid (defaults), temperature {temperature}, top-p {top_p}": (nucleus, DEFAULT_SPEC),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--draft-weights", default="int4-all")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048, help="context per request")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--chat-code", type=int, default=4, help="how many chat-formatted coding requests")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench_out/sampling"))
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)

    engine = Engine.from_pretrained(args.model, draft=args.draft, dtype=args.dtype, weights=args.weights,
                                    draft_weights=args.draft_weights, max_len=args.max_len, progress=False,
                                    prefix_reuse=False)
    items = load("spec_bench", per_category=1, seed=1) + load("chat_code", n=args.chat_code)
    # Tiny test models have no tokenizer: their prompts are characters as ids.
    prompts = [engine.encode(p.text, chat=p.chat) if engine.tokenizer is not None else
               [ord(ch) % engine.target.args.vocab_size for ch in p.text[: args.max_len // 4]] for p in items]
    table = modes(args.temperature, args.top_p, args.max_tokens)
    names = list(table)
    engine.generate(prompts[0], SamplingParams(max_tokens=8), DEFAULT_SPEC)  # loads kernels, profiles costs
    per_repeat: dict[str, list[Metrics]] = {n: [] for n in names}
    for rep in range(args.repeats):
        totals = {n: Metrics() for n in names}
        order = names if rep % 2 == 0 else names[::-1]
        for prompt in prompts:
            for name in order:
                totals[name].merge(engine.generate(prompt, *table[name])[0].metrics)
        for name in names:
            per_repeat[name].append(totals[name])
            m = totals[name]
            print(f"repeat {rep + 1}/{args.repeats} {name:50s} {m.decode_tokens_per_s:6.1f} tok/s  verify/score "
                  f"{m.stage_s['verify'] / m.stage_s['score']:.3f}", flush=True)

    base = [m.decode_tokens_per_s for m in per_repeat[names[0]]]
    rows: list[dict[str, Any]] = []
    for name in names:
        ms = per_repeat[name]
        tps = [m.decode_tokens_per_s for m in ms]
        ratios = [t / b for t, b in zip(tps, base, strict=True)]
        shares = [m.stage_s["verify"] / m.stage_s["score"] for m in ms]
        rows.append({"mode": name, "tokens_per_s": statistics.median(tps), "vs_greedy": statistics.median(ratios),
                     "vs_greedy_runs": ratios, "verify_over_score": statistics.median(shares),
                     "verify_over_score_runs": shares,
                     "verify_ms_per_step": statistics.median(1e3 * m.stage_s["verify"] / m.steps for m in ms),
                     "score_ms_per_step": statistics.median(1e3 * m.stage_s["score"] / m.steps for m in ms),
                     "mean_accepted_length": statistics.median(m.mean_accepted_length for m in ms)})

    info = machine()
    header = (f"{args.model} ({args.weights}) + {args.draft} ({args.draft_weights}), {args.dtype}, {info['cpu']}, "
              f"{info['threads']} threads, {info['date'][:10]}. Prompts: Spec-Bench seed 1, one per "
              f"category, and the first {args.chat_code} `chat_code` requests; {args.max_tokens} new tokens; "
              f"{args.repeats} repeats, modes alternating prompt by prompt. Decode tokens/s (outside the prefill); "
              "vs greedy: median of the per-repeat ratios to plain greedy decoding (range in brackets); verify / "
              "score: the verification stage's time over the scoring stage's (median over repeats).")
    lines = [header, "", "| mode | decode tokens/s | vs greedy plain | verify ms / step | score ms / step | "
             "verify / score | tokens / step |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['vs_greedy']:.2f}x "
                     f"({min(r['vs_greedy_runs']):.2f}-{max(r['vs_greedy_runs']):.2f}) | "
                     f"{r['verify_ms_per_step']:.2f} | {r['score_ms_per_step']:.1f} | "
                     f"{100 * r['verify_over_score']:.1f}% | {r['mean_accepted_length']:.2f} |")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampling_speed.md").write_text(md)
    (args.out / "sampling_speed.json").write_text(json.dumps(
        {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(md)


if __name__ == "__main__":
    main()
