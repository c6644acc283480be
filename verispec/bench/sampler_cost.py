"""What the sampler costs per call: :func:`verispec.sampling.probs_from_logits` against the full-sort top-p rule.

The full-sort rule sorts every row's whole vocabulary to find its nucleus; ``probs_from_logits``
finds the same nucleus from a few candidates (see its docstring). Both run on synthetic logits
of three shapes, each row's logits ``-s * ln(rank)`` over a random permutation of the vocabulary
plus a little noise: ``peaked`` (s = 1.6: a handful of tokens hold the nucleus), ``medium``
(s = 1.2: hundreds) and ``flat`` (s = 0.9: thousands, past the first candidates). The two
alternate call by call; the median of ``--reps`` is reported in ms per call, with the mean
nucleus size. A second table times one draw from such a distribution: ``torch.multinomial`` (one
exponential per token) against :func:`verispec.sampling.sample`. Usage:

    python -m verispec.bench.sampler_cost [--vocab 151936] [--rows 1,6] [--temperature 0.8]
                                          [--top-p 1.0,0.9,0.95] [--shapes peaked,medium,flat] [--reps 21] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from verispec.bench.hardware import machine
from verispec.sampling import SamplingParams, probs_from_logits, sample

SLOPES = {"peaked": 1.6, "medium": 1.2, "flat": 0.9}


def full_sort_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``probs_from_logits`` with the nucleus found by sorting the whole row (temperature and top-k its own)."""
    probs = probs_from_logits(logits, replace(params, top_p=1.0))
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def synthetic_logits(rows: int, vocab: int, slope: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranked = -slope * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32)) + 0.1 * torch.randn(vocab, generator=g)
    return torch.stack([ranked[torch.randperm(vocab, generator=g)] for _ in range(rows)])


def median_ms(fns: list[Callable[[], torch.Tensor]], reps: int) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) * 1e3 for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,6")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", default="1.0,0.9,0.95")
    ap.add_argument("--shapes", default=",".join(SLOPES))
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{machine()['cpu']}, {torch.get_num_threads()} thread(s), V = {args.vocab}, "
          f"temperature {args.temperature}, median of {args.reps}")
    print(f"{'shape':>7} {'rows':>4} {'top_p':>5} {'nucleus':>8} {'full sort ms':>12} {'verispec ms':>11} {'ratio':>6}")
    for shape in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            logits = synthetic_logits(rows, args.vocab, SLOPES[shape], args.seed)
            for top_p in (float(p) for p in args.top_p.split(",")):
                params = SamplingParams(temperature=args.temperature, top_p=top_p)
                new = probs_from_logits(logits, params)
                assert torch.equal(new, full_sort_probs(logits, params)), "the two rules disagree"
                nucleus = float((new > 0).sum(-1).float().mean())
                old_ms, new_ms = median_ms([partial(full_sort_probs, logits, params),
                                            partial(probs_from_logits, logits, params)], args.reps)
                print(f"{shape:>7} {rows:>4} {top_p:>5} {nucleus:>8.0f} {old_ms:>12.2f} {new_ms:>11.2f} "
                      f"{old_ms / new_ms:>5.1f}x")
    print(f"\none draw from a row\n{'shape':>7} {'top_p':>5} {'multinomial ms':>14} {'sample ms':>9} {'ratio':>6}")
    g = torch.Generator().manual_seed(args.seed)
    for shape in args.shapes.split(","):
        logits = synthetic_logits(1, args.vocab, SLOPES[shape], args.seed)[0]
        for top_p in (float(p) for p in args.top_p.split(",")):
            probs = probs_from_logits(logits, SamplingParams(temperature=args.temperature, top_p=top_p))
            old_ms, new_ms = median_ms([partial(torch.multinomial, probs, 1, generator=g),
                                        partial(sample, probs, g)], args.reps)
            print(f"{shape:>7} {top_p:>5} {old_ms:>14.2f} {new_ms:>9.2f} {old_ms / new_ms:>5.1f}x")


if __name__ == "__main__":
    main()
