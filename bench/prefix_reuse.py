"""Time to first token of a chat's follow-up turn with prefix reuse and without, side by side.

A ~1,000-token conversation (a code file and a question, and the model's answer), then a follow-up
turn. With reuse the follow-up lands in the slot the conversation left and prefills only the new
turn; without, it prefills the whole conversation again (and a draft model reads it again too).
One :class:`~verispec.engine.engine.Engine` per setting over the same loaded models, per spec
(plain decoding and the draft model with a fixed k, so the first step drafts). Greedy outputs of
the two settings are compared. On a 2-core AVX2 host with the int4 pair the run takes about 14
minutes, nearly all of it full prefills (the first turn and the follow-up without reuse, per spec).
Usage:

    python bench/prefix_reuse.py [--specs none,draft] [--code-lines 135] [--out prefix_reuse_out]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from verispec import Engine, SamplingParams, SpecConfig
from verispec.bench.hardware import machine

QUESTION = "Here is a module of our inventory service:\n\n```python\n{code}```\n\nWhat does it do? Be brief."
FOLLOW_UP = "Write a unit test for `restock` in the same style."


def code_file(lines: int) -> str:
    """A plausible Python module of about ``lines`` lines (deterministic)."""
    out = ["from dataclasses import dataclass, field\n\n"]
    i = 0
    while sum(s.count("\n") for s in out) < lines:
        out.append(f"@dataclass\nclass Item{i}:\n    name: str\n    count: int = 0\n    tags: list[str] = "
                   f"field(default_factory=list)\n\n    def restock(self, n: int) -> int:\n        if n < 0:\n"
                   f"            raise ValueError('negative restock for {i}')\n        self.count += n\n"
                   f"        return self.count\n\n    def label(self) -> str:\n        return f'{{self.name}}-{i}:'"
                   f" + ','.join(sorted(self.tags))\n\n\n")
        i += 1
    return "".join(out)


def ttft(be: Engine, ids: list[int], params: SamplingParams, spec: SpecConfig) -> dict[str, Any]:
    """Run one request to the end; its time to first token and what it reused."""
    prefilled, draft_reused = be.stats.prefill_tokens, be.stats.prefix_draft_reused_tokens
    result = be.generate([ids], params, spec)[0]
    return {"ttft_s": result.metrics.ttft_s, "prompt_tokens": len(ids), "reused": result.metrics.prefix_reused_tokens,
            "prefilled": be.stats.prefill_tokens - prefilled,
            "draft_reused": be.stats.prefix_draft_reused_tokens - draft_reused, "tokens": result.token_ids,
            "text": result.text, "finish_reason": result.finish_reason}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--draft-weights", default="int4-all")
    ap.add_argument("--specs", default="none,draft", help="methods to time: none (plain) and/or draft (fixed k=4)")
    ap.add_argument("--code-lines", type=int, default=135, help="size of the code file in the first turn")
    ap.add_argument("--answer-tokens", type=int, default=48, help="the first turn's answer (max_tokens)")
    ap.add_argument("--follow-up-tokens", type=int, default=8, help="tokens generated for the follow-up")
    ap.add_argument("--out", default="prefix_reuse_out")
    args = ap.parse_args()

    engine = Engine.from_pretrained(args.model, draft=args.draft, dtype=args.dtype, weights=args.weights,
                                    draft_weights=args.draft_weights, max_len=2048, progress=False)
    first = [{"role": "user", "content": QUESTION.format(code=code_file(args.code_lines))}]
    first_ids = engine.encode(first)
    info = {**machine(), "load_avg": os.getloadavg(), "model": args.model, "draft": args.draft,
            "weights": args.weights, "draft_weights": args.draft_weights, "dtype": str(engine.target.dtype)}
    runs: list[dict[str, Any]] = []
    for method in args.specs.split(","):
        spec = SpecConfig(method="none", k=0) if method == "none" else SpecConfig(method=method, k=4,
                                                                                   k_policy="fixed")
        on, off = (engine.with_config(max_batch=2, prefix_reuse=reuse) for reuse in (True, False))
        for be in (on, off):  # one-off costs of a process's first forwards, on a short prompt
            be.generate([engine.encode("Hi.", chat=True)], SamplingParams(max_tokens=4), spec)
        t0 = time.perf_counter()
        answer = on.generate([first_ids], SamplingParams(max_tokens=args.answer_tokens), spec)[0]
        turn_s = time.perf_counter() - t0
        follow = engine.encode(first + [{"role": "assistant", "content": answer.text},
                                        {"role": "user", "content": FOLLOW_UP}])
        params = SamplingParams(max_tokens=args.follow_up_tokens)
        without = ttft(off, follow, params, spec)  # a fresh slot: the whole conversation is prefilled
        with_reuse = ttft(on, follow, params, spec)
        run = {"method": method, "first_turn_tokens": len(first_ids), "answer_tokens": len(answer.token_ids),
               "first_turn_s": turn_s, "with_reuse": with_reuse, "without_reuse": without,
               "speedup": without["ttft_s"] / with_reuse["ttft_s"], "same_output": with_reuse["tokens"] ==
               without["tokens"]}
        runs.append(run)
        print(f"{method}: conversation of {len(first_ids)} + {len(answer.token_ids)} tokens (first turn "
              f"{turn_s:.1f} s), follow-up TTFT {without['ttft_s']:.2f} s without reuse, {with_reuse['ttft_s']:.2f} s "
              f"with: {run['speedup']:.1f}x, same output: {run['same_output']}", flush=True)

    lines = [f"Follow-up turn's time to first token, {args.model} ({args.weights}) + {args.draft} "
             f"({args.draft_weights}), {info['cpu']}, {info['threads']} threads, load average "
             f"{info['load_avg'][0]:.1f}, {info['date']}; greedy outputs with and without reuse "
             f"{'identical' if all(run['same_output'] for run in runs) else 'DIFFERENT'}.", "",
             "| spec | prefix reuse | prompt tokens | reused | prefilled | draft reused | TTFT s | speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for label, r in (("off", run["without_reuse"]), ("on", run["with_reuse"])):
            speedup = f"{run['speedup']:.1f}x" if label == "on" else ""
            lines.append(f"| {run['method']} | {label} | {r['prompt_tokens']} | {r['reused']} | {r['prefilled']} | "
                         f"{r['draft_reused']} | {r['ttft_s']:.2f} | {speedup} |")
    print("\n" + "\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_reuse.md").write_text("# Prefix reuse\n\n" + "\n".join(lines) + "\n")
    (out / "prefix_reuse.json").write_text(json.dumps({"machine": info, "runs": runs}, indent=2))
    print(f"\nwrote {out / 'prefix_reuse.json'}")


if __name__ == "__main__":
    main()
