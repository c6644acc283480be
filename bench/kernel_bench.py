"""Weight-only int4/int8 and dense bf16 matmul t(M), stock PyTorch kernels vs verispec's (verispec/kernels).

Per projection shape of Qwen2.5-Coder-1.5B Q4_K_M (fused q/k/v, o and fused gate/up as int4;
down and the 151936-row lm_head as int8, as the Q6_K tensors load; down also as int4; pass
--int8-all to time the int4 shapes as int8 too), and the dense bf16 model's gate (or up) and
down projections (stock = ``F.linear``, i.e. oneDNN), t(M) for
M = 1..8 (``--m-max``) activation rows; int4 and int8 also on 8-bit activations (``fast q8``) where
the CPU has AVX-512 VNNI. Each timing cycles through enough distinct random weight copies
that together they exceed --stream-mb (default 160 MiB, five times a 32 MiB L3), so weights
come from DRAM as in a real forward; the median of --reps rounds is reported, with the
weight bytes read per second. Usage:

    python bench/kernel_bench.py [--threads 2] [--reps 7] [--m-max 8] [--shapes qkv,o,gate_up,down,lm_head]

``--large-m 32,64,128,256,900`` instead times prefill-sized M: verispec's kernel against the
large-M path of the layers (the weight expanded to bf16 by int4_dequant / int8_dequant /
bf16_unpack into a reused buffer, then ``F.linear``, i.e. oneDNN), in GFLOPS; that crossover
sets ``PREFILL_M`` in verispec/models/linear.py.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from verispec import kernels
from verispec.models.linear import Int4Weight, Int8Weight

SHAPES = {  # name: (N, K, format), as in the Q4_K_M file (Q6_K ffn_down and output become int8)
    "qkv": (2048, 1536, "int4"),
    "o": (1536, 1536, "int4"),
    "gate_up": (17920, 1536, "int4"),
    "down": (1536, 8960, "int8"),
    "down_int4": (1536, 8960, "int4"),
    "lm_head": (151936, 1536, "int8"),
    "up_bf16": (8960, 1536, "bf16"),
    "down_bf16": (1536, 8960, "bf16"),
}


def int4_copies(n: int, k: int, count: int) -> tuple[list, list]:
    """Random int4 weights: (stock packed, scales/zeros) and (fast packed, fast scales/zeros) per copy."""
    stock, fast = [], []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scale = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
        zero = torch.randn(n, k // 32, generator=g) * 0.01
        w = Int4Weight.from_codes(codes, scale, zero)
        stock.append((w.packed, w.scales_and_zeros))
        if kernels.layouts_available():
            v = w.to_layout("vs16")
            fast.append((v.packed, v.scales_and_zeros))
    return stock, fast


def int8_copies(n: int, k: int, count: int) -> tuple[list, list]:
    stock, fast = [], []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        w = Int8Weight(q, (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16))
        stock.append((w.qweight, w.scale))
        if kernels.layouts_available():
            fast.append((w.to_layout("vs16").qweight, w.scale))
    return stock, fast


def bf16_copies(n: int, k: int, count: int) -> tuple[list, list]:
    stock, fast = [], []
    for i in range(count):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        stock.append(w)
        if kernels.available():
            fast.append(kernels.bf16_pack(w))
    return stock, fast


def time_calls(fn, copies: list, x: torch.Tensor, reps: int) -> float:
    """Median over ``reps`` rounds of the mean time of one call, each round touching every copy once."""
    for c in copies:  # warm-up (and page in)
        fn(x, c)
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in copies:
            fn(x, c)
        rounds.append((time.perf_counter() - t0) / len(copies))
    return statistics.median(rounds)


def large_m_paths(fmt: str, n: int, k: int, buf: torch.Tensor) -> tuple[Callable, Callable]:
    """(verispec's kernel, the weight expanded to bf16 into ``buf``) for one weight copy of ``fmt``."""

    def kernel(x: torch.Tensor, c) -> torch.Tensor:  # noqa: ANN001 - a copy of int4_copies / int8_copies / bf16_copies
        if fmt == "int4":
            return kernels.int4_mm(x, c[0], c[1], n)
        if fmt == "int8":
            return kernels.int8_mm(x, c[0], c[1], n)
        return kernels.bf16_mm(x, c, n)

    def expand(c) -> torch.Tensor:  # noqa: ANN001
        if fmt == "int4":
            return kernels.int4_dequant(c[0], c[1], n, k, buf)
        if fmt == "int8":
            return kernels.int8_dequant(c[0], c[1], n, k, buf)
        return kernels.bf16_unpack(c, n, k, buf)

    return kernel, expand


def large_m(jobs: list, ms: list[int], reps: int, stream_mb: float) -> None:
    """GFLOPS of verispec's kernel vs dequantize + oneDNN (``F.linear``) for prefill-sized M."""
    cols = " | ".join(f"M={m}" for m in ms)
    print(f"| shape [N, K] | format | path | {cols} |")
    print("|---|---|---|" + "---:|" * len(ms))
    for name, n, k, fmt in jobs:
        per_weight = {"int4": 0.5 + 4 / 32, "int8": 1.0 + 2 / k, "bf16": 2.0}[fmt]
        count = max(2, math.ceil(stream_mb * 2**20 / (n * k * per_weight)))
        _, fast = {"int4": int4_copies, "int8": int8_copies, "bf16": bf16_copies}[fmt](n, k, count)
        kernel, expand = large_m_paths(fmt, n, k, torch.empty(n, k, dtype=torch.bfloat16))  # reused, as in the layers
        runs = {"kernel": kernel,
                "dequant+oneDNN": lambda x, c, expand=expand: torch.nn.functional.linear(x, expand(c))}
        for kind, fn in runs.items():
            cells = []
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                cells.append(f"{2 * m * n * k / time_calls(fn, fast, x, reps) / 1e9:.0f}")
            print(f"| {name} [{n}, {k}] | {fmt} | {kind} | {' | '.join(cells)} |", flush=True)
        t = time_calls(lambda x, c, expand=expand: expand(c), fast, None, reps)
        print(f"| {name} [{n}, {k}] | {fmt} | dequant alone: {t * 1e3:.2f} ms, {n * k * 2 / t / 1e9:.1f} GB/s written |"
              + " |" * len(ms), flush=True)
        del fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--m-max", type=int, default=8)
    ap.add_argument("--stream-mb", type=float, default=160.0, help="total weight bytes cycled through per round")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--int8-all", action="store_true", help="also time the int4 shapes as int8")
    ap.add_argument("--large-m", default="", help="comma-separated prefill M: kernel vs dequantize + oneDNN")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fast_ok = kernels.available()
    ms = range(1, args.m_max + 1)
    jobs = [(s, *SHAPES[s]) for s in args.shapes.split(",")]
    if args.int8_all:
        jobs += [(s, n, k, "int8") for s, (n, k, f) in SHAPES.items() if f == "int4" and s in args.shapes]
    if args.large_m:
        if not fast_ok:
            raise SystemExit(f"--large-m needs the fast kernels ({kernels.why_unavailable()})")
        print(f"threads {args.threads}, reps {args.reps}; GFLOPS (2 M N K / t)\n")
        large_m(jobs, [int(m) for m in args.large_m.split(",")], args.reps, args.stream_mb)
        return
    print(f"threads {args.threads}, reps {args.reps}, fast kernels: {fast_ok or kernels.why_unavailable()}\n")
    cols = " | ".join(f"M={m} µs" for m in ms)
    print(f"| shape [N, K] | format | kernel | {cols} | GB/s M=1 | GB/s M={ms[-1]} | t({ms[-1]})/t(1) |")
    print("|---|---|---|" + "---:|" * (len(ms) + 3))
    for name, n, k, fmt in jobs:
        per_weight = {"int4": 0.5 + 4 / 32, "int8": 1.0 + 2 / k, "bf16": 2.0}[fmt]  # + scales (and zeros)
        nbytes = n * k * per_weight
        count = max(2, math.ceil(args.stream_mb * 2**20 / nbytes))
        stock, fast = {"int4": int4_copies, "int8": int8_copies, "bf16": bf16_copies}[fmt](n, k, count)
        if fmt == "bf16":
            runs = {"stock": (lambda x, w: torch.nn.functional.linear(x, w), stock),
                    "fast": (lambda x, w, n=n: kernels.bf16_mm(x, w, n), fast)}
        elif fmt == "int4":
            runs = {"stock": (lambda x, c: torch._weight_int4pack_mm_for_cpu(x, c[0], 32, c[1]), stock),
                    "fast": (lambda x, c, n=n: kernels.int4_mm(x, c[0], c[1], n), fast)}
            if kernels.q8_available():
                runs["fast q8"] = (lambda x, c, n=n: kernels.int4_mm(x, c[0], c[1], n, q8=True), fast)
        else:
            runs = {"stock": (lambda x, c: torch._weight_int8pack_mm(x, c[0], c[1]), stock),
                    "fast": (lambda x, c, n=n: kernels.int8_mm(x, c[0], c[1], n), fast)}
            if kernels.q8_available() and k % 32 == 0:
                runs["fast q8"] = (lambda x, c, n=n: kernels.int8_mm(x, c[0], c[1], n, q8=True), fast)
        if not fast_ok:  # without AVX-512 BF16 only the 8-bit kernels run (AVX2), or none
            runs.pop("fast")
            if fmt == "bf16":
                continue
        for kind, (fn, copies) in runs.items():
            ts = []
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                ts.append(time_calls(fn, copies, x, args.reps))
            gbs = [nbytes / t / 1e9 for t in (ts[0], ts[-1])]
            cells = " | ".join(f"{t * 1e6:.0f}" for t in ts)
            print(f"| {name} [{n}, {k}] | {fmt} | {kind} | {cells} | {gbs[0]:.1f} | {gbs[1]:.1f} | "
                  f"{ts[-1] / ts[0]:.2f} |", flush=True)
        del stock, fast, runs


if __name__ == "__main__":
    main()
