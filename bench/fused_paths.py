"""What three choices of verispec's fused forward paths save, measured on real models in one process.

1. Prefill attention: ``Transformer._forward_prefill`` runs the fused ``kernels.attend`` where it
   applies, else the modules' SDPA path. Times a prefill of random prompts of several lengths
   from an empty cache, both ways.
2. Decode projections: the fused decode path calls each projection through
   ``linear.small_m_call`` (straight to the kernel) instead of ``nn.Module.__call__`` + ``forward``.
   Times a decode step (1 token at position 100) both ways.
3. Decode ops: a decode step through the fused small ops (``Transformer._forward_fused``: norms,
   attention, silu * up) against the modules' Python path (PyTorch's ops), the same projections in both.

4. The pieces alone: one layer's attention of a causal prefill (RoPE, K/V write and attention; the
   1.5B's 12 query / 2 KV heads of 128) through ``attend`` vs the Python path with SDPA, and one
   call of a small int4 projection (256 x 256, one row) through ``small_m_call`` vs the module.

Both ways alternate run by run; the median of ``--reps`` is reported, per model given as NAME:FORMAT.
Usage:

    python bench/fused_paths.py [--models qwen2.5-coder-1.5b-instruct:int4,...] [--lengths 128,400,800,1300]
                                [--reps 5] [--decode-steps 40] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import verispec.models.llama as llama
from verispec import Engine, kernels
from verispec.bench.hardware import machine
from verispec.models import linear


def prefill_s(model: llama.Transformer, length: int, fused: bool, seed: int) -> float:
    tokens = torch.randint(0, model.args.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = model.new_cache(1, length)
    if not fused:  # the instance attribute hides the method: SDPA for this call
        model._fused_attention = lambda x, c: False
    try:
        t0 = time.perf_counter()
        model(tokens, torch.arange(length)[None], cache, kv_len=length, last_only=True)
        return time.perf_counter() - t0
    finally:
        if not fused:
            del model._fused_attention


def decode_step_s(model: llama.Transformer, steps: int, lean: bool, fused_ops: bool = True) -> float:
    cache = model.new_cache(1, 100 + steps)
    token = torch.tensor([[100]])
    call = llama.small_m_call
    if not lean:
        llama.small_m_call = lambda layer, x: layer(x)
    model.fused_ops = fused_ops
    try:
        t0 = time.perf_counter()
        for i in range(steps):
            model(token, torch.tensor([[100 + i]]), cache, kv_len=101 + i)
        return (time.perf_counter() - t0) / steps
    finally:
        llama.small_m_call = call
        model.fused_ops = True


def attention_s(length: int, fused: bool, seed: int, dtype: torch.dtype, heads: int = 12, kv_heads: int = 2,
                d: int = 128) -> float:
    """One layer's prefill attention on random inputs of ``dtype``: ``kernels.attend`` or llama.Attention's
    Python path (RoPE, index_put, SDPA in its causal form), as the prefill runs each."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, length, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    cos, sin = llama.rope_tables(d, 1e6, length, dtype)
    pos = torch.arange(length)[None]
    k_cache = torch.zeros(1, kv_heads, length, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    t0 = time.perf_counter()
    if fused:
        kernels.attend(qkv, cos[pos], sin[pos], pos, k_cache, v_cache, length, heads, kv_heads)
    else:
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
        q = llama.apply_rope(q.view(1, length, heads, d).transpose(1, 2), c, s)
        k_cache[0, :, :length] = llama.apply_rope(k.view(1, length, kv_heads, d).transpose(1, 2), c, s)[0]
        v_cache[0, :, :length] = v.view(length, kv_heads, d).transpose(0, 1)
        F.scaled_dot_product_attention(q, k_cache, v_cache, is_causal=True, enable_gqa=True)
    return time.perf_counter() - t0


def call_s(layer: torch.nn.Module, x: torch.Tensor, lean: bool, calls: int = 2000) -> float:
    """Seconds per call of ``layer`` on ``x``: through ``small_m_call`` or the module."""
    t0 = time.perf_counter()
    if lean:
        for _ in range(calls):
            linear.small_m_call(layer, x)
    else:
        for _ in range(calls):
            layer(x)
    return (time.perf_counter() - t0) / calls


def alternate(reps: int, run: Callable[[bool, int], float]) -> tuple[float, float]:
    """Median seconds of ``run(True, rep)`` and ``run(False, rep)``, alternating, after one warm-up."""
    run(True, 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps):
        for way in (True, False):
            times[way].append(run(way, rep))
    return statistics.median(times[True]), statistics.median(times[False])


def measure(model: llama.Transformer, label: dict, lengths: list[int], reps: int,
            steps: int) -> tuple[list[dict], dict]:
    """One model's prefill rows (one per length) and its decode row."""
    prefill = []
    for n in lengths:
        attend, sdpa = alternate(reps, lambda fused, rep, n=n: prefill_s(model, n, fused, rep))
        prefill.append({**label, "tokens": n, "attend_s": attend, "sdpa_s": sdpa, "speedup": sdpa / attend})
    lean, module = alternate(reps, lambda lean, rep: decode_step_s(model, steps, lean))
    fused, python = alternate(reps, lambda fused, rep: decode_step_s(model, steps, True, fused))
    return prefill, {**label, "lean_s": lean, "module_s": module, "speedup": module / lean,
                     "fused_ops_s": fused, "python_ops_s": python}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b-instruct:int4,qwen2.5-coder-0.5b-instruct:int4-all")
    ap.add_argument("--lengths", default="128,400,800,1300")
    ap.add_argument("--dtype", default="auto", help="bf16 where the CPU computes it natively, else fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=40)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    prefill, decode = [], []
    with torch.inference_mode():
        for spec in args.models.split(","):
            name, fmt = spec.split(":")
            model = Engine.from_pretrained(name, dtype=args.dtype, weights=fmt, max_len=max(lengths),
                                           progress=False).target
            model_dtype = model.dtype  # "auto" resolved
            if not model.fused_ops or model_dtype not in kernels.small_ops_dtypes():
                raise SystemExit(f"{name}: verispec's fused ops do not run on this machine in {model_dtype}; "
                                 "nothing to compare")
            rows, row = measure(model, {"model": name, "weights": fmt}, lengths, args.reps, args.decode_steps)
            prefill += rows
            decode.append(row)
            del model
            gc.collect()
        pieces = []
        for n in lengths:
            attend, sdpa = alternate(args.reps, lambda fused, rep, n=n: attention_s(n, fused, rep, model_dtype))
            pieces.append({"what": f"prefill attention, one layer, {n} tokens", "fused_s": attend, "python_s": sdpa})
        small = linear.make_linear(torch.randn(256, 256), None, "int4", model_dtype)
        x = torch.randn(1, 256, dtype=model_dtype)
        lean, module = alternate(args.reps, lambda lean, rep: call_s(small, x, lean))
        pieces.append({"what": "int4 projection 256 x 256, one row, per call", "fused_s": lean, "python_s": module})
    info = machine()
    dtype = str(model_dtype).removeprefix("torch.")
    print(f"\nverispec's fused forward paths, {dtype}, median of {args.reps} alternating runs, "
          f"{info['cpu']}, {info['threads']} threads, {info['date']}\n")
    print("Prefill from an empty cache, attention: fused attend vs SDPA\n")
    print("| model | weights | prompt tokens | attend ms | SDPA ms | SDPA / attend |\n|---|---|---:|---:|---:|---:|")
    for r in prefill:
        print(f"| {r['model']} | {r['weights']} | {r['tokens']} | {r['attend_s'] * 1e3:.0f} | {r['sdpa_s'] * 1e3:.0f} "
              f"| {r['speedup']:.2f}x |")
    print(f"\nDecode step (1 token, {args.decode_steps} steps from position 100), projections: small_m_call vs "
          "module calls\n")
    print("| model | weights | small_m_call ms | module calls ms | module / small_m_call |\n|---|---|---:|---:|---:|")
    for r in decode:
        print(f"| {r['model']} | {r['weights']} | {r['lean_s'] * 1e3:.2f} | {r['module_s'] * 1e3:.2f} "
              f"| {r['speedup']:.3f}x |")
    print(f"\nDecode step ({args.decode_steps} steps from position 100): fused small ops vs the Python path\n")
    print("| model | weights | fused ops ms | Python path ms | Python / fused |\n|---|---|---:|---:|---:|")
    for r in decode:
        print(f"| {r['model']} | {r['weights']} | {r['fused_ops_s'] * 1e3:.2f} | {r['python_ops_s'] * 1e3:.2f} "
              f"| {r['python_ops_s'] / r['fused_ops_s']:.3f}x |")
    print("\nThe pieces alone (fused: attend / small_m_call; Python: SDPA path / module call)\n")
    print("| what | fused us | Python us | Python / fused |\n|---|---:|---:|---:|")
    for r in pieces:
        print(f"| {r['what']} | {r['fused_s'] * 1e6:.1f} | {r['python_s'] * 1e6:.1f} | "
              f"{r['python_s'] / r['fused_s']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "prefill": prefill, "decode": decode, "pieces": pieces}, f,
                      indent=2)


if __name__ == "__main__":
    main()
