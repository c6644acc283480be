"""Verify-cost curve t(M)/t(1) of the whole target forward, per weight format and kernels.

For each format (and each of ``--kernels``) the target is loaded and :meth:`Engine.profile` times
forwards scoring M = 1..``--m-max`` tokens on a short context (the fastest of ``--reps``);
optionally plain greedy decoding speed too. Prints a table and writes ``verify_cost.json`` and
``verify_cost.png`` into ``--out``. Usage:

    python bench/verify_cost.py [--model qwen2.5-coder-1.5b-instruct] [--formats dense,int8,int4]
                                [--dtype bfloat16] [--m-max 8] [--reps 3] [--decode-tokens 0]
                                [--threads 0] [--kernels auto[,q8][,stock]] --out DIR

``--kernels auto,q8`` puts the int4 and int8 layers on 8-bit activations (``q8``) beside verispec's
bf16-activation kernels; q8 leaves dense layers alone, so it adds rows for the quantized formats. ``stock`` times
PyTorch's own int4/int8 kernels (see docs/quantization.md).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from verispec import Engine, SamplingParams
from verispec.bench.hardware import machine
from verispec.config import dtype_name
from verispec.kernels import KERNEL_CHOICES, available, q8_available, quantized_label
from verispec.models.linear import WEIGHT_FORMATS

PROMPT = "Write a Python function that returns the n-th prime number, with a docstring and tests."


def measure(model: str, fmt: str, kernels: str, dtype: str, m_max: int, reps: int, decode_tokens: int) -> dict:
    engine = Engine.from_pretrained(model, dtype=dtype, weights=fmt, max_len=512, progress=False, kernels=kernels)
    engine.profile(m_max - 1, reps=1)  # warm-up
    one_row = engine.profile(m_max - 1, reps=reps).target.curves[1].points  # scored tokens -> fastest seconds
    verify_s = [one_row[m] for m in range(1, m_max + 1)]
    row = {"format": fmt if kernels == "auto" else f"{fmt}, {kernels}", "kernels": kernels,
           "dtype": str(engine.target.dtype).removeprefix("torch."),
           "t_ms": [t * 1e3 for t in verify_s], "ratio": [t / verify_s[0] for t in verify_s]}
    if decode_tokens:
        ids = engine.encode(PROMPT, chat=engine.tokenizer is not None)
        engine.generate(ids, SamplingParams(max_tokens=4))
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        row["plain_tokens_per_s"] = max(engine.generate(ids, params)[0].metrics.tokens_per_s for _ in range(reps))
    del engine
    gc.collect()
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        ms = range(1, len(r["ratio"]) + 1)
        ax1.plot(ms, r["t_ms"], marker="o", label=r["format"])
        ax2.plot(ms, r["ratio"], marker="o", label=r["format"])
    ax1.set(xlabel="M (tokens scored)", ylabel="t(M) ms", title="target forward")
    ax2.set(xlabel="M (tokens scored)", ylabel="t(M) / t(1)", title="relative verify cost")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--formats", default=",".join(WEIGHT_FORMATS))
    ap.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--m-max", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=0, help="also time plain greedy decoding of this many tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--kernels", default="auto", help="comma-separated int4/int8 matmul kernels: auto, q8, stock")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.dtype = dtype_name(args.dtype)
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - set(KERNEL_CHOICES):
        ap.error(f"unknown kernels {', '.join(sorted(unknown))} (choose from {', '.join(KERNEL_CHOICES)})")
    if "q8" in kernels and not q8_available():
        print("no q8 rows: 8-bit activations need verispec's kernels and AVX-512 VNNI or AVX2")
        kernels.remove("q8")
    if args.threads:
        torch.set_num_threads(args.threads)  # on a shared CPU, fewer threads than cores time far steadier

    # One row per format and the matmuls it actually runs here: dense layers ignore q8, and where the
    # CPU lacks AVX-512 BF16 auto is PyTorch's F.linear for dense and q8 for int4/int8 (AVX2).
    runs: dict[tuple[str, str], str] = {}
    for f in args.formats.split(","):
        for kern in kernels:
            path = ("verispec" if kern != "stock" and available() else "stock") if f == "dense" else \
                quantized_label(kern)
            runs.setdefault((f, path), kern)
    rows = [measure(args.model, f, kern, args.dtype, args.m_max, args.reps, args.decode_tokens)
            for (f, _), kern in runs.items()]
    info = machine()
    title = (f"{args.model} ({args.dtype}, {args.kernels} kernels) · {info['cpu']}, {info['threads']} threads"
             f" · {info['date']}")
    print(f"\nverify cost t(M)/t(1), {title}\n")
    ms = range(1, args.m_max + 1)
    extra = "plain tok/s" if args.decode_tokens else None
    print("| weights | t(1) ms | " + " | ".join(f"M={m}" for m in ms) + (f" | {extra} |" if extra else " |"))
    print("|---|---:|" + "---:|" * len(ms) + ("---:|" if extra else ""))
    for r in rows:
        cells = " | ".join(f"{x:.2f}" for x in r["ratio"])
        tail = f" | {r['plain_tokens_per_s']:.2f} |" if extra else " |"
        print(f"| {r['format']} | {r['t_ms'][0]:.1f} | {cells}{tail}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=2))
    plot(rows, out / "verify_cost.png", title)
    print(f"\nwrote {out / 'verify_cost.json'} and {out / 'verify_cost.png'}")


if __name__ == "__main__":
    main()
