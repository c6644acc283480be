"""Weight-only quantized linears (int8, int4) and the direct GGUF Q4_K -> int4 conversion.

Everything here is synthetic (random tensors, random Q4_K blocks, tiny models and a tiny GGUF
written on the fly), so the suite needs no real model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from drafters_common import chi_square_p, exact_first_two, sampled_first_two
from tiny import make_tiny

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.models.linear import (
    DenseLinear,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    QuantizedTensor,
    make_linear,
)
from verispec.models.loader import build_model, decode_q4_k, open_source

Q4_K = gguf.GGMLQuantizationType.Q4_K


def random_q4_k(rows: int, cols: int, seed: int = 0, d_scale: float = 0.002) -> np.ndarray:
    """Random Q4_K bytes [rows, cols / 256 * 144]: random codes and 6-bit scales/mins, small fp16 d/dmin."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    d = (np.abs(rng.standard_normal((n, 2))) * d_scale).astype(np.float16)
    blocks[:, :4] = d.view(np.uint8).reshape(n, 4)
    return blocks.reshape(rows, -1)


def bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What casting activations and outputs to bf16 may cost: ~2 ulps of bf16 of |x| @ |w|^T."""
    return 2.0 ** -7 * (x.abs() @ w.abs().t()) + 1e-6


# -- the Q4_K decoder -----------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols,seed", [(16, 256, 0), (48, 768, 1), (3, 512, 2)])
def test_q4_k_decoder_matches_gguf_bit_for_bit(rows, cols, seed):
    data = random_q4_k(rows, cols, seed, d_scale=0.05)
    ref = gguf.quants.dequantize(data, Q4_K).reshape(rows, cols)
    qt = decode_q4_k(data, (rows, cols))
    assert qt.codes.dtype == torch.uint8 and int(qt.codes.max()) <= 15
    assert qt.scales.shape == (rows, cols // 32) == qt.mins.shape
    assert np.array_equal(qt.dequantize().numpy(), ref)


def test_q4_k_to_int4_keeps_codes_and_rounds_scales_to_bf16():
    qt = decode_q4_k(random_q4_k(64, 512, 3), (64, 512))
    w = Int4Weight.from_quantized(qt)
    assert torch.equal(w.codes(), qt.codes)
    zero = 8 * qt.scales - qt.mins
    bound = ((8 * qt.scales.abs() + zero.abs()) / 256).repeat_interleave(32, dim=1)
    err = (w.dequantize() - qt.dequantize()).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # the bf16 rounding is real, and documented


# -- the layers against dequantize-then-matmul ----------------------------------------------


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_dequantized_matmul(m, dtype):
    torch.manual_seed(m)
    w, bias = torch.randn(96, 128), torch.randn(96)
    lin = make_linear(w, bias, "int4", dtype)
    assert isinstance(lin, Int4Linear)
    wd = lin.dequantized()
    # The quantization itself: at most half a step (plus bf16 slack on scale/zero) per weight.
    step = (w.view(96, 4, 32).amax(-1) - w.view(96, 4, 32).amin(-1)) / 15
    assert ((wd - w).abs().view(96, 4, 32) <= 0.51 * step[..., None] + 0.02).all()
    x = torch.randn(2, m, 128).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (2, m, 96)
    ref = x.float() @ wd.t() + bias.to(dtype).float()
    assert ((y.float() - ref).abs() <= bf16_bound(x.float(), wd) + 2.0 ** -7 * bias.abs()).all()
    assert torch.equal(lin.to("cpu")(x), y)  # Engine moves models to their device; on the CPU a no-op


@pytest.mark.parametrize("m", range(1, 9))
def test_int8_linear_matches_dequantized_matmul(m):
    torch.manual_seed(m)
    w = torch.randn(80, 96)
    lin = make_linear(w, None, "int8", torch.float32)
    assert isinstance(lin, Int8Linear)
    x = torch.randn(m, 96)
    ref = x @ lin.dequantized().t()
    if lin.q8:  # 8-bit activations (the default on AVX2 CPUs): their exact reference is in test_kernels
        assert 0 < (lin(x) - ref).norm() <= 0.02 * ref.norm()
    else:
        torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_int4_from_q4_k_matches_its_dequantized_matmul(m):
    qt = decode_q4_k(random_q4_k(64, 256, 5, d_scale=0.01), (64, 256))
    lin = make_linear(qt, None, "int4", torch.bfloat16)
    x = torch.randn(m, 256)
    wd = lin.dequantized()
    err = (lin(x).float() - x @ wd.t()).abs()
    assert (err <= bf16_bound(x, wd)).all()
    # The other formats dequantize a QuantizedTensor exactly.
    dense = make_linear(qt, None, "dense", torch.float32)
    assert isinstance(dense, DenseLinear) and torch.equal(dense.weight, qt.dequantize())


def test_int4_rows_concatenate_like_the_fused_projections():
    parts = [torch.randn(n, 64) for n in (64, 16, 48)]  # 16 and 48 straddle the kernel's row blocks
    fused = Int4Weight.cat([Int4Weight.quantize(p) for p in parts])
    alone = torch.cat([Int4Weight.quantize(p).dequantize() for p in parts])
    assert torch.equal(fused.dequantize(), alone)
    qts = [QuantizedTensor(torch.randint(0, 16, (n, 64), dtype=torch.uint8), torch.rand(n, 2), torch.rand(n, 2))
           for n in (32, 32)]
    assert torch.equal(QuantizedTensor.cat(qts).dequantize(), torch.cat([q.dequantize() for q in qts]))


def test_shapes_the_int4_kernel_cannot_take_stay_dense():
    assert isinstance(make_linear(torch.randn(12, 64), None, "int4", torch.float32), DenseLinear)  # 12 rows
    assert isinstance(make_linear(torch.randn(32, 48), None, "int4", torch.float32), DenseLinear)  # 48 columns


# -- engines on int4 targets ------------------------------------------------------------------


def int4_tiny(folder: Path, **kwargs):
    make_tiny(folder, **kwargs)
    return build_model(open_source(folder), torch.float32, "int4", progress=False)


def engine_for(target, draft=None, max_len: int = 128) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=max_len, progress=False)
    return Engine(cfg, target, None, {1}, draft=draft)


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    target = int4_tiny(root / "t", arch="qwen2", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=0)
    make_tiny(root / "d", arch="qwen2", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=0)
    draft = build_model(open_source(root / "d"), torch.float32, "int8", progress=False)
    return target, draft


def test_int4_model_is_built_from_int4_layers(int4_pair):
    target, _ = int4_pair
    kinds = {type(m) for m in target.modules() if "Linear" in type(m).__name__}
    assert kinds == {Int4Linear}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_with_an_int4_target_matches_plain(int4_pair, k):
    target, draft = int4_pair
    prompts = [[3, 5, 7, 9], [10, 20, 30, 40, 50, 60, 10, 20, 30], [2]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [r.token_ids for r in engine_for(target).generate(prompts, params)]
    assert len(set(map(tuple, plain))) > 1
    spec = engine_for(target, draft).generate(prompts, params, SpecConfig(k_policy="fixed", method="draft", k=k))
    assert [r.token_ids for r in spec] == plain
    assert sum(r.metrics.accepted for r in spec) > 0


def test_sampling_with_an_int4_target_is_exact(tmp_path):
    # 16 tokens, so the lm_head is int4 as well; the draft is the same weights kept dense,
    # which differs from the int4 target by the quantization noise (weights scaled up to matter).
    kwargs = dict(arch="qwen2", vocab=16, layers=1, dim=32, heads=2, kv_heads=1, seed=0, scale=4.0)
    target = int4_tiny(tmp_path / "t", **kwargs)
    draft = build_model(open_source(tmp_path / "t"), torch.float32, progress=False)
    params = SamplingParams(temperature=1.0)
    probs = exact_first_two(target, [3, 5, 7, 2], params)
    # The draft really differs (TV ~0.37 here, ~2/3 of drafts accepted): both branches of the rule run.
    assert 0.5 * abs(probs - exact_first_two(draft, [3, 5, 7, 2], params)).sum() > 0.1
    counts = sampled_first_two(engine_for(target, draft, 32), [3, 5, 7, 2], params, SpecConfig(k_policy="fixed",
                                                                                               method="draft", k=2),
                               1500)
    assert chi_square_p(counts, probs) > 1e-3


# -- GGUF: direct Q4_K conversion, int8 for the higher-precision tensors, and the cache ---------


def write_gguf(path: Path, dim: int = 256, ffn: int = 512, vocab: int = 64, heads: int = 4, kv_heads: int = 2,
               quantized: bool = True) -> None:
    """A one-layer qwen2 GGUF with Q4_K q/k/gate/up, a Q8_0 v_proj and down_proj, float norms and embeddings
    (``quantized=False``: every tensor F32)."""
    rng = np.random.default_rng(0)
    hd = dim // heads
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, val in [("embedding_length", dim), ("block_count", 1), ("feed_forward_length", ffn),
                     ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                     ("context_length", 256)]:
        w.add_uint32(f"qwen2.{key}", val)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen2.rope.freq_base", 10000.0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)

    def f32(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1 + (1.0 if "norm" in name else 0.0)).astype(np.float32))

    def q4k(name, rows, cols, seed):
        if not quantized:
            return f32(name, rows, cols)
        w.add_tensor(name, random_q4_k(rows, cols, seed), raw_dtype=Q4_K)

    def q8(name, rows, cols):
        if not quantized:
            return f32(name, rows, cols)
        data = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32),
                                    gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    f32("token_embd.weight", vocab, dim)
    f32("output.weight", vocab, dim)
    f32("output_norm.weight", dim)
    f32("blk.0.attn_norm.weight", dim)
    f32("blk.0.ffn_norm.weight", dim)
    q4k("blk.0.attn_q.weight", dim, dim, 1)
    q4k("blk.0.attn_k.weight", kv_heads * hd, dim, 2)
    q8("blk.0.attn_v.weight", kv_heads * hd, dim)
    for name in ("attn_q", "attn_k", "attn_v"):
        f32(f"blk.0.{name}.bias", dim if name == "attn_q" else kv_heads * hd)
    q4k("blk.0.attn_output.weight", dim, dim, 3)
    q4k("blk.0.ffn_gate.weight", ffn, dim, 4)
    q4k("blk.0.ffn_up.weight", ffn, dim, 5)
    q8("blk.0.ffn_down.weight", dim, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_int4_converts_q4_k_directly_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    dense = build_model(open_source(path), torch.float32, "dense", progress=False, cache=False)
    direct = build_model(open_source(path), torch.float32, "int4", progress=False, cache=False)
    first = build_model(open_source(path), torch.float32, "int4", progress=False)  # converts and caches
    cached = build_model(open_source(path), torch.float32, "int4", progress=False)  # reads the cache
    assert len(list((tmp_path / "home" / "converted").glob("tiny-*-int4-float32-*-v*/model.safetensors"))) == 1

    layer = direct.layers[0]
    assert isinstance(layer.mlp.w_gate_up, Int4Linear) and isinstance(layer.attn.wo, Int4Linear)
    # A Q8_0 part makes the fused q/k/v int8, and Q8_0 down_proj stays int8.
    assert isinstance(layer.attn.wqkv, Int8Linear) and isinstance(layer.mlp.w_down, Int8Linear)
    assert isinstance(direct.lm_head, Int4Linear)  # an F32 head is quantized like any float weight

    # Q4_K codes survive untouched: only the bf16 rounding of scale/zero separates int4 from gguf's floats.
    ref = dense.layers[0].mlp.w_gate_up.weight
    got = layer.mlp.w_gate_up.dequantized()
    assert (got - ref).abs().max() <= ref.abs().max() / 64

    sd_direct, sd_cached, sd_first = direct.state_dict(), cached.state_dict(), first.state_dict()
    assert sd_direct.keys() == sd_cached.keys()
    for k in sd_direct:
        assert torch.equal(sd_direct[k], sd_cached[k]) and torch.equal(sd_direct[k], sd_first[k]), k

    tokens = torch.tensor([[5, 9, 2, 33, 7]])
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        a = dense(tokens, pos, dense.new_cache(1, 8))
        b = cached(tokens, pos, cached.new_cache(1, 8))
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.25 * a.abs().max()


def test_gguf_int4_all_requantizes_the_precise_tensors_too(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    dense = build_model(open_source(path), torch.float32, "dense", progress=False, cache=False)
    every = build_model(open_source(path), torch.float32, "int4-all", progress=False)  # converts and caches
    cached = build_model(open_source(path), torch.float32, "int4-all", progress=False)
    build_model(open_source(path), torch.float32, "int4", progress=False)
    # int4 and int4-all keep separate caches.
    folders = sorted(p.parent.name for p in (tmp_path / "home" / "converted").glob("*/model.safetensors"))
    assert len(folders) == 2 and any("-int4all-" in f for f in folders)
    for model in (every, cached):
        layer = model.layers[0]
        # The Q8_0 v_proj and down_proj are int4 here, with the Q4_K parts they are fused with.
        assert all(isinstance(m, Int4Linear) for m in (layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up,
                                                       layer.mlp.w_down, model.lm_head))
    ref = dense.layers[0].mlp.w_down.weight
    got = every.layers[0].mlp.w_down.dequantized()
    # min/max 4-bit groups of 32: within half a step (range / 15 / 2) plus bf16 rounding of scale and zero.
    assert (got - ref).abs().max() <= (ref.max() - ref.min()) / 15
    tokens = torch.tensor([[5, 9, 2, 33, 7]])
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        a = dense(tokens, pos, dense.new_cache(1, 8))
        b = cached(tokens, pos, cached.new_cache(1, 8))
    assert (a - b).abs().max() < 0.25 * a.abs().max()
