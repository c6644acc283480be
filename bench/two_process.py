"""Draft and target in one process (2 threads) vs each in its own process (1 thread each), CPU.

Speculative greedy decoding with a draft model, tokens/s over a few prompts:

  (a) one process, ``torch.set_num_threads(2)``: both models share both cores, one after the other;
  (b) two processes, one thread each: the target (and verification) here, the draft model in a
      child process that answers propose requests over a pipe. Same algorithm, same outputs (the
      script checks they are token-identical); what changes is that each model owns a core and its
      caches, at the price of a pipe round trip per step.

On the real pair (takes minutes; not run by the tests):

    python bench/two_process.py --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --dtype bfloat16 --max-tokens 64 --prompts 2 --json two_process.json

Any Hugging Face folders work too (the tests' tiny models have no tokenizer: prompts become token ids).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import torch

from verispec import Engine, SamplingParams, SpecConfig
from verispec.drafters.base import Drafter, Proposal

PROMPTS = [
    "Write a Python function that returns the n-th prime number, with a docstring.",
    "Implement binary search over a sorted list in Python and explain its complexity in one sentence.",
    "Write a function that parses an ISO 8601 date string into a datetime without external libraries.",
    "Write a Python class for an LRU cache with get and put in O(1).",
]


def _draft_server(conn: Any, draft: str, dtype: str, max_len: int, vocab: int, threads: int) -> None:
    """The draft process: a one-slot draft runner (the engine's) behind a pipe. Messages: begin, propose
    (with a pending commit), stop."""
    torch.set_num_threads(threads)
    from verispec.config import resolve_dtype
    from verispec.engine.draft_runner import DraftRow, DraftRunner
    from verispec.models.loader import build_model, open_source

    model = build_model(open_source(draft), resolve_dtype(dtype), progress=False)
    runner = DraftRunner(model, 1, max_len + 80, vocab)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "begin":
            runner.begin(0, msg[1])
            conn.send(None)
        else:  # ("propose", n_valid or None, seq, k, params)
            _, n_valid, seq, k, params = msg
            if n_valid is not None:
                runner.commit(0, n_valid)
            t0 = time.perf_counter()
            tokens = runner.propose([DraftRow(0, seq, k, params, None)])[0].tokens
            conn.send((tokens, time.perf_counter() - t0))
    conn.close()


class RemoteDrafter(Drafter):
    """Forwards to :func:`_draft_server`; a step's commit rides along with the next propose (one round trip)."""

    name = "remote-draft"

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.pending: int | None = None
        self.draft_s = 0.0  # time the draft process spent drafting (the rest of "propose" is the pipe)

    def begin(self, prompt: list[int]) -> None:
        self.pending = None
        self.conn.send(("begin", prompt))
        self.conn.recv()

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        if not params.greedy:
            raise ValueError("this benchmark drafts greedily only")
        self.conn.send(("propose", self.pending, seq, k, params))
        self.pending = None
        tokens, draft_s = self.conn.recv()
        self.draft_s += draft_s
        return Proposal(tokens)

    def commit(self, n_valid: int) -> None:
        self.pending = n_valid if self.pending is None else min(self.pending, n_valid)


def _prompts(engine: Engine, n: int) -> list:
    if engine.tokenizer is None:  # tiny test models: token ids
        vocab = engine.target.args.vocab_size
        return [[(7 * i + 3 * j + 2) % vocab for j in range(12)] for i in range(n)]
    return [engine.encode(p, chat=True) for p in PROMPTS[:n]]


def _run(engine: Engine, prompts: list, params: SamplingParams, spec: SpecConfig, drafter: Drafter | None,
         reps: int) -> dict:
    engine.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True), spec, drafter=drafter)  # warm-up
    best: dict = {}
    for _ in range(reps):
        results = engine.generate(prompts, params, spec, drafter=drafter)
        tokens = sum(r.metrics.generated_tokens for r in results)
        seconds = sum(r.metrics.total_s for r in results)
        drafted = sum(r.metrics.drafted for r in results)
        accepted = sum(r.metrics.accepted for r in results)
        row = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
               "acceptance": accepted / max(drafted, 1),
               "propose_s": sum(r.metrics.stage_s["propose"] for r in results),
               "score_s": sum(r.metrics.stage_s["score"] for r in results),
               "token_ids": [r.token_ids for r in results]}
        if not best or row["tokens_per_s"] > best["tokens_per_s"]:
            best = row
    return best


def one_process(args: argparse.Namespace, params: SamplingParams, spec: SpecConfig) -> dict:
    torch.set_num_threads(args.threads)
    # Dense weights in both setups: the draft process below builds its model dense.
    engine = Engine.from_pretrained(args.model, args.draft, dtype=args.dtype, max_len=args.max_len, progress=False,
                                    weights="dense", draft_weights="dense")
    row = _run(engine, _prompts(engine, args.prompts), params, spec, None, args.reps)
    del engine
    gc.collect()
    return row


def two_processes(args: argparse.Namespace, params: SamplingParams, spec: SpecConfig) -> dict:
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, max_len=args.max_len, progress=False, weights="dense")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_draft_server, daemon=True,
                       args=(there, args.draft, args.dtype, args.max_len, engine.target.args.vocab_size, 1))
    proc.start()
    try:
        if not here.poll(args.timeout):
            raise TimeoutError(f"the draft process did not start within {args.timeout} s")
        here.recv()
        drafter = RemoteDrafter(here)
        row = _run(engine, _prompts(engine, args.prompts), params, spec, drafter, args.reps)
        row["draft_process_s"] = drafter.draft_s
        here.send(("stop",))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=2, help=f"how many built-in prompts (up to {len(PROMPTS)})")
    ap.add_argument("--reps", type=int, default=1, help="repetitions; the best is kept")
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process run (default 2)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the draft process to load")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    spec = SpecConfig(method="draft", k=args.k, k_policy="fixed")
    a = one_process(args, params, spec)
    b = two_processes(args, params, spec)
    identical = a["token_ids"] == b["token_ids"]
    print(f"\nspeculative greedy decoding, {args.model} + draft {args.draft} ({args.dtype}), k={args.k}, "
          f"{args.prompts} prompts x {args.max_tokens} tokens")
    for label, r in ((f"(a) one process, {args.threads} threads", a), ("(b) two processes, 1 thread each", b)):
        print(f"  {label:36s} {r['tokens_per_s']:8.2f} tokens/s  acceptance {r['acceptance']:.1%}  "
              f"propose {r['propose_s']:.2f} s  score {r['score_s']:.2f} s")
    print(f"  (b) / (a): {b['tokens_per_s'] / a['tokens_per_s']:.2f}x; outputs identical: {identical}")
    out = {"model": args.model, "draft": args.draft, "dtype": args.dtype, "k": args.k, "prompts": args.prompts,
           "max_tokens": args.max_tokens, "one_process": a, "two_processes": b, "identical": identical}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "one_process": {k: v for k, v in a.items() if k != "token_ids"},
                       "two_processes": {k: v for k, v in b.items() if k != "token_ids"}}, f, indent=2)
    if not identical:
        print("error: the two runs disagree (greedy speculative decoding must be deterministic)", file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["identical"] else 1)
