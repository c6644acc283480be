"""How long loading takes from the converted cache: ``Engine.from_pretrained`` end to end, per weight format.

The first load of a format converts the GGUF and fills the cache (run once before measuring);
this times the loads after that, median of ``--reps``. Usage:

    python bench/load_time.py [--model qwen2.5-coder-1.5b-instruct] [--formats int4,dense] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from verispec import Engine
from verispec.bench.hardware import machine
from verispec.config import dtype_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--formats", default="int4,dense")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)
    info = machine()
    print(f"\nEngine.from_pretrained from the cache, {args.model} ({args.dtype}), {info['cpu']}, {info['date']}\n")
    print("| weights | median s | all runs s |\n|---|---:|---|")
    for fmt in args.formats.split(","):
        Engine.from_pretrained(args.model, dtype=args.dtype, weights=fmt, progress=False)  # fills the cache once
        gc.collect()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights=fmt, progress=False)
            times.append(time.perf_counter() - t0)
            del engine
            gc.collect()
        print(f"| {fmt} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
