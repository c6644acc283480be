"""Plain greedy decoding: verispec vs transformers' generate, same weights and prompt, one run.

Also prints the memory-bandwidth roofline: measured read bandwidth divided by the bytes of
weights one decode step reads. Usage:

    python bench/plain_decode.py [--model qwen2.5-coder-1.5b-instruct] [--dtype bfloat16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from verispec import Engine, SamplingParams, hub
from verispec.bench.hardware import read_bandwidth, weight_bytes_per_token
from verispec.bench.runner import machine

PROMPT = "Write a Python function that returns the n-th prime number, with a docstring and tests."


def hf_tokens_per_s(model_name: str, ids: list[int], new_tokens: int, dtype: torch.dtype, reps: int) -> float:
    from transformers import AutoModelForCausalLM

    path = hub.resolve(model_name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    x = torch.tensor([ids])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(x, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            out = model.generate(x, **kw)
            best = max(best, (out.shape[1] - x.shape[1]) / (time.perf_counter() - t0))
    del model
    gc.collect()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights="dense", max_len=1024)  # as transformers
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    ids = engine.encode(PROMPT, chat=True)
    engine.generate(ids, SamplingParams(max_tokens=4))  # warm-up
    ours = max(engine.generate(ids, params)[0].metrics.tokens_per_s for _ in range(args.reps))
    per_token = weight_bytes_per_token(engine.target)
    dtype = engine.target.dtype
    del engine
    gc.collect()
    bw = read_bandwidth()
    roofline = bw / per_token
    hf = hf_tokens_per_s(args.model, ids, args.tokens, dtype, args.reps)
    info = machine()
    rows = {"verispec tokens/s": ours, "transformers tokens/s": hf, "verispec / transformers": ours / hf,
            "read bandwidth GB/s": bw / 1e9, "weight bytes per token (GB)": per_token / 1e9,
            "roofline tokens/s": roofline, "verispec / roofline": ours / roofline}
    print(f"\nplain greedy decoding, {args.model} ({args.dtype}), {args.tokens} tokens, "
          f"{info['cpu']}, {info['threads']} threads, {info['date']}\n")
    print("| figure | value |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f}{'x' if ' / ' in k else ''} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), "figures": rows}, f, indent=2)


if __name__ == "__main__":
    main()
