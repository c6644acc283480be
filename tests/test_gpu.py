"""Correctness on a CUDA device, fp32, on tiny random models built in code (no weights needed).

CUDA logits equal CPU logits; greedy speculation (model draft, n-gram, cost policy, reduced draft head,
hybrid) gives plain decoding's tokens; the compiled step (CUDA graphs, and inductor plus graphs) gives
the eager step's tokens; int4 / int8 layers moved to CUDA match their dequantized weights; the batching
engine gives each request's tokens decoded alone. Marked ``gpu`` (``pytest -m gpu``) and skipped
without a CUDA device.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.models.args import ModelArgs
from verispec.models.linear import Int4Weight, Int8Weight, make_linear
from verispec.models.llama import Transformer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]

DEV = "cuda"
TINY = ModelArgs(arch="qwen2", vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256,
                 qkv_bias=True, max_position_embeddings=512)
EOS = 1


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """fp32 on the GPU as on the CPU: the parity check compares them at 1e-4."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def tensor_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen2 checkpoint with these args."""
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


def random_model(device: str, seed: int, a: ModelArgs = TINY) -> Transformer:
    """A decoder with random fp32 weights (norms near 1), generated on ``device``."""
    shapes = tensor_shapes(a)
    gen = torch.Generator(device=device).manual_seed(seed)

    def get(name: str) -> torch.Tensor | None:
        if name not in shapes:
            return None
        t = torch.randn(shapes[name], generator=gen, device=device, dtype=torch.float32)
        return 1.0 + 0.1 * t if "norm" in name else 0.1 * t

    return Transformer.from_state_dict(a, get, torch.float32).to(device).eval()


def engine_for(target: Transformer, draft: Transformer | None = None, max_len: int = 256,
               compile: bool = False) -> Engine:
    cfg = EngineConfig(model="random", device=str(target.device), dtype="float32", max_len=max_len, progress=False,
                       compile=compile, compile_k=3)
    return Engine(cfg, target, None, {EOS}, draft)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Token ids with repeats (so n-gram lookup finds matches), never EOS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(2, TINY.vocab_size, (length // 3,), generator=g).tolist()
        out.append((base * 3 + base[:length % 3 + 1])[:length])
    return out


def test_cuda_logits_match_the_cpu() -> None:
    cpu = random_model("cpu", seed=0)
    gpu = copy.deepcopy(cpu).to(DEV)
    ids = prompts(1, 40, seed=1)[0]
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
    assert worst <= 1e-4


@pytest.mark.parametrize("name", ["draft-twin k=4", "draft-other k=4", "ngram k=4", "draft-other cost",
                                  "draft-twin vocab=128", "hybrid-twin cost"])
def test_greedy_speculation_gives_plain_decodings_tokens(name: str) -> None:
    target = random_model(DEV, seed=0)
    draft = {"twin": copy.deepcopy(target), "other": random_model(DEV, seed=5)}.get(name.split()[0].split("-")[-1])
    spec = {"draft-twin k=4": SpecConfig("draft", k=4, k_policy="fixed"),
            "draft-other k=4": SpecConfig("draft", k=4, k_policy="fixed"),
            "ngram k=4": SpecConfig("ngram", k=4, k_policy="fixed"),
            "draft-other cost": SpecConfig("draft", k=6, k_policy="cost"),
            "draft-twin vocab=128": SpecConfig("draft", k=4, k_policy="fixed", draft_vocab=128),
            "hybrid-twin cost": SpecConfig("hybrid", k=4, k_policy="cost")}[name]
    ps, params = prompts(3, 40, seed=2), SamplingParams(max_tokens=40)
    plain = [r.token_ids for r in engine_for(target).generate(ps, params)]
    out = engine_for(target, draft).generate(ps, params, spec)
    assert [r.token_ids for r in out] == plain
    if name == "draft-twin k=4":  # a draft that always agrees
        assert sum(r.metrics.accepted for r in out) == sum(r.metrics.drafted for r in out) > 0


@pytest.mark.parametrize("inductor", [False, True], ids=["graphs", "inductor+graphs"])
def test_the_compiled_step_gives_the_eager_steps_tokens(inductor: bool) -> None:
    from verispec.engine.compiled import compile_model

    target, other = random_model(DEV, seed=0), random_model(DEV, seed=5)
    ps = prompts(3, 40, seed=3)
    params, spec = SamplingParams(max_tokens=32), SpecConfig("draft", k=3, k_policy="fixed")
    eager = engine_for(target, other)
    want_plain, want_spec = ([r.token_ids for r in eager.generate(ps, params, s)] for s in (None, spec))
    tc, dc = copy.deepcopy(target), copy.deepcopy(other)
    eng = engine_for(tc, dc, max_len=256 - 32, compile=inductor)
    if not inductor:  # graphs of the eager forward, one per m (no padding), no compilation
        for model in (tc, dc):
            compile_model(model, eng.cache.max_len, warmup=(1,), inductor=False, buckets=tuple(range(1, 33)))
    assert [r.token_ids for r in eng.generate(ps, params)] == want_plain
    assert [r.token_ids for r in eng.generate(ps, params, spec)] == want_spec
    assert not getattr(tc.forward, "failed", True) and len(getattr(tc.forward, "graphs", {})) > 0


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_layers_on_cuda_match_their_dequantized_weights(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g) * 0.05
    qw = Int4Weight.quantize(w) if fmt == "int4" else Int8Weight.quantize(w, torch.bfloat16)
    layer = make_linear(qw, None, fmt, torch.bfloat16, kernels="stock")
    ref_w = layer.dequantized().float()
    layer = layer.to(DEV)
    for m in range(1, 9):
        x = torch.randn(m, 1024, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            y = layer(x.to(DEV)).float().cpu()
        ref = x.float() @ ref_w.T
        assert (y - ref).norm().item() / ref.norm().item() < 1e-2, m


@pytest.mark.parametrize("spec", [None, SpecConfig("draft", k=3, k_policy="fixed"),
                                  SpecConfig("draft", k=4, k_policy="cost", draft_vocab=128)],
                         ids=["plain", "draft k=3", "draft cost vocab=128"])
def test_the_batching_engine_gives_each_requests_tokens_alone(spec: SpecConfig | None) -> None:
    target, other = random_model(DEV, seed=0), random_model(DEV, seed=5)
    ps = [p[: 20 + 7 * i] for i, p in enumerate(prompts(4, 60, seed=4))]
    params = [SamplingParams(max_tokens=20 + 5 * i) for i in range(4)]
    eng = engine_for(target, other)
    alone = [eng.generate(p, pa, spec)[0].token_ids for p, pa in zip(ps, params, strict=True)]
    batched = eng.with_config(max_batch=4).generate(ps, params, spec)
    assert [r.token_ids for r in batched] == alone
