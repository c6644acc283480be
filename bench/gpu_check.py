"""Checks and figures for a CUDA machine, in one run (the lent GPU is scarce: one prepared script).

Correctness, fp32, tiny random models built in code:
  * CUDA logits equal CPU logits (prefill, decode steps, a verify block) within 1e-4;
  * greedy speculation (model draft, n-gram, cost policy) gives plain decoding's tokens on CUDA;
  * the compiled step (torch.compile + CUDA graphs) gives the eager step's tokens;
  * int4 / int8 layers moved to CUDA match their dequantized weights, M = 1..8;
  * the batching engine on CUDA gives each request's tokens decoded alone.
Figures, bf16, random weights of real shapes (Qwen2.5-7B target, Qwen2.5-0.5B draft):
  * memory bandwidth (device-to-device copy) and the roofline of one decode step;
  * verify-cost curve t(M)/t(1), M = 1..16, eager vs CUDA graphs (and inductor + graphs at a few M);
  * draft step time and cost ratio c, eager vs graphs, and the speedup they predict for a given
    acceptance rate (Leviathan et al.'s expected accepted length);
  * plain greedy decoding tokens/s through the Engine, eager vs graphs;
  * one int4 / int8 projection vs bf16 on CUDA, M = 1..8.

Each part records its error and the run goes on. Writes gpu_check.json and gpu_check.md into --out.
``--small`` shrinks the timing models so the script can be tried on a CPU (CUDA-only parts skip).

    python bench/gpu_check.py --out DIR [--small] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("VERISPEC_KERNELS", "stock")  # the CPU kernels are not what this run is about

import torch  # noqa: E402

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from verispec.engine.compiled import CompiledForward, compile_model  # noqa: E402
from verispec.engine.policy import expected_tokens  # noqa: E402
from verispec.models.args import ModelArgs  # noqa: E402
from verispec.models.linear import Int4Weight, Int8Weight, make_linear  # noqa: E402
from verispec.models.llama import Transformer  # noqa: E402

QWEN_7B = ModelArgs(arch="qwen2", vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                    intermediate_size=18944, qkv_bias=True, rope_theta=1e6, max_position_embeddings=4096)
QWEN_05B = ModelArgs(arch="qwen2", vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                     intermediate_size=4864, qkv_bias=True, rope_theta=1e6, max_position_embeddings=4096,
                     tie_word_embeddings=True)
TINY = ModelArgs(arch="qwen2", vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256,
                 qkv_bias=True, max_position_embeddings=512)
SMALL_T = ModelArgs(arch="qwen2", vocab_size=1024, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                    intermediate_size=512, qkv_bias=True, max_position_embeddings=2048)
SMALL_D = ModelArgs(arch="qwen2", vocab_size=1024, dim=128, n_layers=2, n_heads=2, n_kv_heads=1,
                    intermediate_size=256, qkv_bias=True, max_position_embeddings=2048, tie_word_embeddings=True)
EOS = 1


# -- models -------------------------------------------------------------------------------

def tensor_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Llama/Qwen2 checkpoint with these args."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, a.dim),
                                          "model.norm.weight": (a.dim,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, a.dim)
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (a.dim,), p + "post_attention_layernorm.weight": (a.dim,),
                   p + "self_attn.q_proj.weight": (q, a.dim), p + "self_attn.k_proj.weight": (kv, a.dim),
                   p + "self_attn.v_proj.weight": (kv, a.dim), p + "self_attn.o_proj.weight": (a.dim, q),
                   p + "mlp.gate_proj.weight": (a.intermediate_size, a.dim),
                   p + "mlp.up_proj.weight": (a.intermediate_size, a.dim),
                   p + "mlp.down_proj.weight": (a.dim, a.intermediate_size)}
        if a.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def random_model(a: ModelArgs, dtype: torch.dtype, device: str, seed: int, std: float = 0.02) -> Transformer:
    """A decoder with random weights (norms near 1), generated on ``device``."""
    shapes = tensor_shapes(a)
    gen = torch.Generator(device=device).manual_seed(seed)

    def get(name: str) -> torch.Tensor | None:
        if name not in shapes:
            return None
        t = torch.randn(shapes[name], generator=gen, device=device, dtype=torch.float32)
        return (1.0 + 0.1 * t if "norm" in name else std * t).to(dtype)

    return Transformer.from_state_dict(a, get, dtype).to(device).eval()


def engine_for(target: Transformer, draft: Transformer | None = None, max_len: int = 256,
               compile: bool = False, compile_k: int = 3) -> Engine:
    dev = str(target.device)
    dtype = "float32" if target.dtype == torch.float32 else "bfloat16"
    cfg = EngineConfig(model="random", device=dev, dtype=dtype, max_len=max_len, progress=False,
                       compile=compile, compile_k=compile_k)
    return Engine(cfg, target, None, {EOS}, draft)


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """Token ids with repeats (so n-gram lookup finds matches), never EOS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(2, vocab, (length // 3,), generator=g).tolist()
        out.append((base * 3 + base[:length % 3 + 1])[:length])
    return out


# -- timing -------------------------------------------------------------------------------

def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, else a host clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bandwidth_gbs(device: torch.device, gib: float) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    ms = time_ms(lambda: dst.copy_(src), device, reps=10)
    return 2 * n * 4 / (ms / 1e3) / 1e9


def weight_bytes(model: Transformer) -> int:
    """Bytes a decode step reads: every projection and the lm_head (the embedding is one row)."""
    embed = model.embed.weight
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers())
               if t is not embed and t is not model.rope_cos and t is not model.rope_sin)


def forward_curve(model: Transformer, fwd: Callable, context: int, ms: list[int], reps: int) -> dict[int, float]:
    """t(M) in ms for M new tokens after a ``context``-token prefix, through ``fwd``."""
    dev = model.device
    cache = model.new_cache(1, context + max(ms) + 32)
    prefix = torch.randint(2, model.args.vocab_size, (1, context), device=dev)
    with torch.inference_mode():
        model.forward(prefix, torch.arange(context, device=dev)[None], cache, last_only=True)
        out = {}
        for m in ms:
            toks = prefix[:, :m].clone()
            pos = torch.arange(context, context + m, device=dev)[None]
            out[m] = time_ms(lambda toks=toks, pos=pos, kv=context + m: fwd(toks, pos, cache, kv), dev, reps=reps)
    return out


# -- checks -------------------------------------------------------------------------------

def check_parity(dev: str) -> dict:
    cpu = random_model(TINY, torch.float32, "cpu", seed=0, std=0.1)
    gpu = copy.deepcopy(cpu).to(dev)
    ids = prompts(TINY.vocab_size, 1, 40, seed=1)[0]
    worst = 0.0
    with torch.inference_mode():
        caches = [cpu.new_cache(1, 128), gpu.new_cache(1, 128)]
        for start, m in ((0, 30), (30, 1), (31, 1), (32, 5), (33, 7)):  # prefill, decodes, two verify blocks
            toks, pos = torch.tensor([ids[start:start + m]]), torch.arange(start, start + m)[None]
            outs = [model(toks.to(model.device), pos.to(model.device), c)
                    for model, c in zip((cpu, gpu), caches, strict=True)]
            worst = max(worst, (outs[0] - outs[1].cpu()).abs().max().item())
            for c in caches:
                c.lengths[0] = start + m
    return {"max_abs_diff": worst, "ok": worst <= 1e-4}


def check_identity(dev: str) -> dict:
    target = random_model(TINY, torch.float32, dev, seed=0, std=0.1)
    twin = copy.deepcopy(target)  # a draft that always agrees
    other = random_model(TINY, torch.float32, dev, seed=5, std=0.1)
    ps = prompts(TINY.vocab_size, 3, 40, seed=2)
    params = SamplingParams(max_tokens=40)
    res: dict = {}
    plain = [r.token_ids for r in engine_for(target).generate(ps, params)]
    for name, draft, spec in (("draft-twin k=4", twin, SpecConfig("draft", k=4, k_policy="fixed")),
                              ("draft-other k=4", other, SpecConfig("draft", k=4, k_policy="fixed")),
                              ("ngram k=4", None, SpecConfig("ngram", k=4, k_policy="fixed")),
                              ("draft-other cost", other, SpecConfig("draft", k=6, k_policy="cost")),
                              ("draft-twin vocab=128", twin,
                               SpecConfig("draft", k=4, k_policy="fixed", draft_vocab=128)),
                              ("hybrid-twin cost", twin, SpecConfig("hybrid", k=4, k_policy="cost"))):
        out = engine_for(target, draft).generate(ps, params, spec)
        res[name] = {"same_tokens": [r.token_ids for r in out] == plain,
                     "acceptance": round(sum(r.metrics.accepted for r in out) /
                                         max(1, sum(r.metrics.drafted for r in out)), 3)}
    res["ok"] = all(v["same_tokens"] for v in res.values())
    return res


def check_compiled(dev: str) -> dict:
    target = random_model(TINY, torch.float32, dev, seed=0, std=0.1)
    other = random_model(TINY, torch.float32, dev, seed=5, std=0.1)
    ps = prompts(TINY.vocab_size, 3, 40, seed=3)
    params, spec = SamplingParams(max_tokens=32), SpecConfig("draft", k=3, k_policy="fixed")
    eager = engine_for(target, other)
    want_plain, want_spec = ([r.token_ids for r in eager.generate(ps, params, s)] for s in (None, spec))
    res = {}
    for name, inductor in (("graphs", False), ("inductor+graphs", True)):
        t0 = time.perf_counter()
        tc, dc = copy.deepcopy(target), copy.deepcopy(other)
        eng = engine_for(tc, dc, max_len=256 - 32, compile=inductor)
        if not inductor:  # graphs of the eager forward, one per m (no padding), no compilation
            for model in (tc, dc):
                compile_model(model, eng.cache.max_len, warmup=(1,), inductor=False, buckets=tuple(range(1, 33)))
        got_plain = [r.token_ids for r in eng.generate(ps, params)]
        got_spec = [r.token_ids for r in eng.generate(ps, params, spec)]
        wrapper = tc.forward
        res[name] = {"plain_same": got_plain == want_plain, "spec_same": got_spec == want_spec,
                     "graphs_captured": len(getattr(wrapper, "graphs", {})),
                     "fell_back": bool(getattr(wrapper, "failed", True)), "seconds": round(time.perf_counter() - t0, 1)}
    res["ok"] = all(v["plain_same"] and v["spec_same"] and not v["fell_back"] for v in res.values())
    return res


def check_quantized(dev: str) -> dict:
    res = {}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g) * 0.05
    for fmt, qw in (("int4", Int4Weight.quantize(w)), ("int8", Int8Weight.quantize(w, torch.bfloat16))):
        layer = make_linear(qw, None, fmt, torch.bfloat16, kernels="stock")
        ref_w = layer.dequantized().float()
        try:
            layer = layer.to(dev)
            errs = []
            for m in range(1, 9):
                x = torch.randn(m, 1024, generator=g).to(torch.bfloat16)
                with torch.inference_mode():
                    y = layer(x.to(dev)).float().cpu()
                ref = x.float() @ ref_w.T
                errs.append((y - ref).norm().item() / ref.norm().item())
            res[fmt] = {"max_rel_err": max(errs), "ok": max(errs) < 1e-2}
        except Exception as e:
            res[fmt] = {"error": f"{type(e).__name__}: {e}"[:300], "ok": False}
    res["ok"] = all(v["ok"] for v in res.values())
    return res


def check_batch(dev: str) -> dict:
    target = random_model(TINY, torch.float32, dev, seed=0, std=0.1)
    other = random_model(TINY, torch.float32, dev, seed=5, std=0.1)
    ps = [p[: 20 + 7 * i] for i, p in enumerate(prompts(TINY.vocab_size, 4, 60, seed=4))]
    params = [SamplingParams(max_tokens=20 + 5 * i) for i in range(4)]
    res = {}
    for name, spec in (("plain", None), ("draft k=3", SpecConfig("draft", k=3, k_policy="fixed")),
                       ("draft cost vocab=128", SpecConfig("draft", k=4, k_policy="cost", draft_vocab=128))):
        eng = engine_for(target, other)
        alone = [eng.generate(p, pa, spec)[0].token_ids for p, pa in zip(ps, params, strict=True)]
        batched = eng.with_config(max_batch=4).generate(ps, params, spec)
        res[name] = [r.token_ids for r in batched] == alone
    res["ok"] = all(res.values())
    return res


# -- figures ------------------------------------------------------------------------------

def figures(dev: str, small: bool, deadline: float) -> dict:
    device = torch.device(dev)
    cuda = device.type == "cuda"
    t_args, d_args = (SMALL_T, SMALL_D) if small else (QWEN_7B, QWEN_05B)
    context, reps = (256, 5) if small else (512, 20)
    out: dict = {"target": "Qwen2.5-7B shape" if not small else "small", "context": context}
    if cuda:
        out["bandwidth_GBs"] = round(bandwidth_gbs(device, 4), 1)
    target = random_model(t_args, torch.bfloat16, dev, seed=0)
    draft = random_model(d_args, torch.bfloat16, dev, seed=1)
    out["target_weight_GB"] = round(weight_bytes(target) / 1e9, 2)
    ms = list(range(1, 17))

    def eager(model: Transformer) -> Callable:
        return lambda t, p, c, kv: model.forward(t, p, c, kv_len=kv)

    curves = {"eager": forward_curve(target, eager(target), context, ms, reps)}
    drafts = {"eager": forward_curve(draft, eager(draft), context, [1], reps)[1]}
    if cuda:
        graphs = CompiledForward(target, inductor=False, buckets=tuple(ms))
        curves["graphs"] = forward_curve(target, lambda t, p, c, kv: graphs(t, p, c), context, ms, reps)
        dgraphs = CompiledForward(draft, inductor=False, buckets=(1,))
        drafts["graphs"] = forward_curve(draft, lambda t, p, c, kv: dgraphs(t, p, c), context, [1], reps)[1]
        del graphs, dgraphs
    out["t_ms"] = {k: {m: round(v, 3) for m, v in c.items()} for k, c in curves.items()}
    out["ratio"] = {k: {m: round(v / c[1], 3) for m, v in c.items()} for k, c in curves.items()}
    out["draft_ms"] = {k: round(v, 3) for k, v in drafts.items()}
    out["c"] = {k: round(drafts[k] / curves[k][1], 3) for k in curves}
    if cuda:
        floor_ms = weight_bytes(target) / (out["bandwidth_GBs"] * 1e9) * 1e3
        out["roofline_fraction"] = {k: round(floor_ms / c[1], 3) for k, c in curves.items()}
    # What this curve and draft cost predict for a given acceptance rate (Leviathan et al.).
    out["predicted_speedup"] = {}
    for mode, c in curves.items():
        row = {}
        for a in (0.6, 0.7, 0.8, 0.9):
            best = max((expected_tokens(a, k) * c[1] / (k * drafts[mode] + c[k + 1]), k) for k in range(1, 16))
            row[str(a)] = {"speedup": round(best[0], 2), "k": best[1]}
        out["predicted_speedup"][mode] = row
    # Plain greedy decoding through the Engine, eager vs graphs.
    ids = prompts(t_args.vocab_size, 1, context, seed=6)[0]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    tps = {}
    for mode in (("eager", "graphs") if cuda else ("eager",)):
        model = copy.copy(target)  # a shallow copy shares weights; only its forward differs
        if mode == "graphs":
            model.forward = CompiledForward(target, inductor=False, buckets=(1,))
        eng = engine_for(model, max_len=context + 128)
        eng.generate(ids, SamplingParams(max_tokens=4))
        tps[mode] = round(max(eng.generate(ids, params)[0].metrics.tokens_per_s for _ in range(2)), 1)
        del eng, model
    out["plain_tokens_per_s"] = tps
    # Inductor on top of graphs, a few M, while time is left (each shape compiles for tens of seconds).
    if cuda and time.monotonic() < deadline - 240:
        try:
            comp = CompiledForward(target, inductor=True, buckets=(1, 4, 8))
            t0 = time.perf_counter()
            c = forward_curve(target, lambda t, p, c, kv: comp(t, p, c), context, [1, 4, 8], reps)
            out["inductor+graphs"] = {"t_ms": {m: round(v, 3) for m, v in c.items()},
                                      "ratio": {m: round(v / c[1], 3) for m, v in c.items()},
                                      "compile_and_time_s": round(time.perf_counter() - t0, 1)}
        except Exception as e:
            out["inductor+graphs"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    del target, draft
    # One MLP projection of the target shape in each format.
    n, k = (t_args.intermediate_size, t_args.dim)
    w = torch.randn(n, k) * 0.02
    proj = {}
    for fmt, qw in (("bf16", w.to(torch.bfloat16)), ("int8", Int8Weight.quantize(w, torch.bfloat16)),
                    ("int4", Int4Weight.quantize(w))):
        try:
            layer = make_linear(qw, None, "dense" if fmt == "bf16" else fmt, torch.bfloat16, kernels="stock").to(dev)
            xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in (1, 2, 4, 8)}
            proj[fmt] = {m: round(time_ms(lambda x=x, layer=layer: layer(x), device, reps=reps), 4)
                         for m, x in xs.items()}
        except Exception as e:
            proj[fmt] = {"error": f"{type(e).__name__}: {e}"[:300]}
    out["projection_ms"] = {"shape": [n, k], **proj}
    return out


def engine_compile(dev: str, small: bool) -> dict:
    """Plain greedy decoding through ``Engine(compile=True)``: inductor plus CUDA graphs, m = 1 only."""
    t_args = SMALL_T if small else QWEN_7B
    context = 256 if small else 512
    ids = prompts(t_args.vocab_size, 1, context, seed=6)[0]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    out = {}
    for compile in (False, True):
        model = random_model(t_args, torch.bfloat16, dev, seed=0)
        t0 = time.perf_counter()
        eng = engine_for(model, max_len=context + 128, compile=compile, compile_k=0)
        eng.generate(ids, SamplingParams(max_tokens=4))
        setup = time.perf_counter() - t0
        tps = max(eng.generate(ids, params)[0].metrics.tokens_per_s for _ in range(2))
        out["compiled" if compile else "eager"] = {"tokens_per_s": round(tps, 1), "setup_s": round(setup, 1)}
        del eng, model
    return out


# -- report -------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    lines = [f"# GPU check, {r['date']}", "", f"Device: {r['device']}; torch {r['torch']}.", ""]
    lines += ["## Correctness (fp32, tiny random models)", "", "| check | result |", "|---|---|"]
    for name in ("parity", "identity", "compiled", "quantized", "batch"):
        v = r.get(name, {})
        lines.append(f"| {name} | {'pass' if v.get('ok') else 'FAIL'}: {json.dumps(v)[:300]} |")
    f = r.get("figures", {})
    if "t_ms" in f:
        lines += ["", f"## Verify cost, {f['target']} target, bf16, context {f['context']}", "",
                  "| M | " + " | ".join(f"{k} t(M) ms | {k} t(M)/t(1)" for k in f["t_ms"]) + " |",
                  "|---|" + "---|---|" * len(f["t_ms"])]
        for m in f["t_ms"]["eager"]:
            lines.append(f"| {m} | " + " | ".join(f"{f['t_ms'][k][m]:.2f} | {f['ratio'][k][m]:.2f}"
                                                  for k in f["t_ms"]) + " |")
        lines += ["", "| | " + " | ".join(f["t_ms"]) + " |", "|---|" + "---|" * len(f["t_ms"])]
        lines.append("| draft step ms | " + " | ".join(str(f["draft_ms"][k]) for k in f["t_ms"]) + " |")
        lines.append("| draft cost c | " + " | ".join(str(f["c"][k]) for k in f["t_ms"]) + " |")
        if "roofline_fraction" in f:
            lines.append("| t(1) vs bandwidth floor | " + " | ".join(str(f["roofline_fraction"][k])
                                                                     for k in f["t_ms"]) + " |")
        lines.append("| plain tokens/s (Engine) | " + " | ".join(str(f["plain_tokens_per_s"].get(k, "-"))
                                                                 for k in f["t_ms"]) + " |")
        for a in ("0.6", "0.7", "0.8", "0.9"):
            lines.append(f"| predicted speedup at a={a} (k) | " + " | ".join(
                f"{f['predicted_speedup'][k][a]['speedup']} ({f['predicted_speedup'][k][a]['k']})"
                for k in f["t_ms"]) + " |")
    for key in ("bandwidth_GBs", "target_weight_GB", "inductor+graphs", "projection_ms", "error"):
        if key in f:
            lines.append(f"\n{key}: {json.dumps(f[key])}")
    if "engine_compile" in r:
        lines.append(f"\nengine_compile (plain greedy, Engine): {json.dumps(r['engine_compile'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small timing models (a trial run on a CPU)")
    ap.add_argument("--parts", default="checks,figures", help="any of checks, figures, engine_compile")
    ap.add_argument("--budget-s", type=float, default=420, help="skip optional parts past this many seconds")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks compare with the CPU at 1e-4
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    cuda = dev.startswith("cuda")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    checks = {"parity": check_parity, "identity": check_identity, "quantized": check_quantized,
              "batch": check_batch, "compiled": check_compiled}
    parts = set(args.parts.split(","))
    for name, fn in checks.items():
        if "checks" not in parts:
            break
        if not cuda and name in ("parity", "quantized"):
            continue  # CPU vs CPU would prove nothing
        t0 = time.perf_counter()
        try:
            report[name] = fn(dev)
        except Exception as e:
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500],
                            "trace": traceback.format_exc()[-1500:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(report[name])[:400], flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for name, fn in (("figures", lambda: figures(dev, args.small, deadline)),
                     ("engine_compile", lambda: engine_compile(dev, args.small))):
        if name not in parts:
            continue
        try:
            with torch.inference_mode():
                report[name] = fn()
        except Exception as e:
            report[name] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
        print(name, json.dumps(report[name])[:600], flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (out / "gpu_check.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
