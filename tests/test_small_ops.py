"""verispec's fused small ops (verispec/kernels/small_ops.cpp) against the Python reference in llama.py.

Tolerances:

- fp32: the fused ops do the reference's arithmetic up to the order of fp32 sums (the sum of
  squares of RMSNorm, attention's dot products and softmax sums), so ``1e-5`` (relative, plus
  ``1e-5`` absolute for attention, whose outputs are O(1)); RoPE and the K/V written into the
  cache round exactly as the reference does and must be equal;
- bf16: RMSNorm, silu * up and RoPE keep the reference's roundings to bf16 between ops, so they
  may differ from it by a rounding flip of an intermediate: at most 2 bf16 ulps (``2^-6``
  relative). Attention keeps its scores in fp32 (the reference rounds its bmm scores to bf16,
  which alone moves outputs by percents) and, as the reference does, rounds the probabilities to
  bf16 for P @ V; so the bf16 output is checked against the same math all in fp32 on the same bf16
  q/k/v: one rounding of the output (``2^-7`` of it, both sides rounded) plus the probabilities'
  rounding, at most ``2^-9`` of ``P @ |V|`` (bounded by ``2^-8`` of it), plus ``1e-5``. The K/V
  written into the cache still equal the reference's bit for bit.

A row's (a query's) output must not depend on the other rows or queries in the call: that is
checked bit for bit, as speculative verification needs it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import make_tiny

from verispec import kernels
from verispec.models.llama import SMALL_M, RMSNorm, Transformer, apply_rope, rope_tables, small_m_attention
from verispec.models.loader import build_model, open_source

pytestmark = pytest.mark.skipif(not kernels.small_ops_dtypes(),
                                reason=f"verispec kernels unavailable: {kernels.why_unavailable()}")

# fp32 and bf16 on AVX-512 BF16 CPUs, fp32 on AVX2 ones (their AVX2 implementation).
DTYPES = list(kernels.small_ops_dtypes())
BF16_2ULP = 2.0 ** -6
BF16_ULP = 2.0 ** -7


def close(y: torch.Tensor, ref: torch.Tensor, rel: float, abs_: float = 0.0) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype, (y.shape, ref.shape, y.dtype, ref.dtype)
    err = (y.float() - ref.float()).abs()
    bound = rel * ref.float().abs() + abs_ + 1e-30
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g} (max err {err.max().item():.3g})"


def rel_tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else BF16_2ULP


# -- rms_norm, add_rms_norm, silu_mul ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 200, 896])
def test_rms_norm_matches_the_module(dtype, d):
    g = torch.Generator().manual_seed(d)
    for rows in (1, 3, 17):
        x = (3 * torch.randn(rows, d, generator=g)).to(dtype)
        w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
        close(kernels.rms_norm(x, w, 1e-6), RMSNorm(w, 1e-6)(x), rel_tol(dtype), 1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 200])
def test_add_rms_norm_adds_in_place_then_normalises(dtype, d):
    g = torch.Generator().manual_seed(d)
    for rows in (1, 4):
        x = torch.randn(rows, d, generator=g).to(dtype)
        delta = torch.randn(rows, d, generator=g).to(dtype)
        w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
        summed = x + delta
        y = kernels.add_rms_norm(x, delta, w, 1e-5)
        assert torch.equal(x, summed)  # the residual stream, rounded as torch's add rounds it
        close(y, RMSNorm(w, 1e-5)(summed), rel_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_independent(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 896, generator=g).to(dtype)
    w = torch.randn(896, generator=g).to(dtype)
    whole = kernels.rms_norm(x, w, 1e-6)
    assert torch.equal(torch.cat([kernels.rms_norm(x[i:i + 1], w, 1e-6) for i in range(40)]), whole)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [16, 100, 4864])
def test_silu_mul_matches_the_reference(dtype, f):
    g = torch.Generator().manual_seed(f)
    for rows in (1, 5):
        gate_up = (4 * torch.randn(rows, 2 * f, generator=g)).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        close(kernels.silu_mul(gate_up), F.silu(gate) * up, rel_tol(dtype), 1e-6)
    extreme = torch.tensor([[-200.0, -88.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1.0] * 2]).to(dtype)
    gate, up = extreme.chunk(2, dim=-1)
    close(kernels.silu_mul(extreme), F.silu(gate) * up, rel_tol(dtype), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_on_prefill_sized_inputs(dtype, threads):
    # A 900+-token prefill runs them on R = rows x tokens rows at once, split over threads: every row
    # still as the Python reference does it, and as it comes out alone.
    g = torch.Generator().manual_seed(9)
    rows, d, f = 1001, 1536, 2240
    x = (3 * torch.randn(rows, d, generator=g)).to(dtype)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype)
    y = kernels.rms_norm(x, w, 1e-6)
    close(y, RMSNorm(w, 1e-6)(x), rel_tol(dtype), 1e-30)
    assert torch.equal(y[517:518], kernels.rms_norm(x[517:518], w, 1e-6))
    delta = torch.randn(rows, d, generator=g).to(dtype)
    summed, res = x + delta, x.clone()
    y = kernels.add_rms_norm(res, delta, w, 1e-6)
    assert torch.equal(res, summed)
    close(y, RMSNorm(w, 1e-6)(summed), rel_tol(dtype), 1e-30)
    gate_up = (4 * torch.randn(rows, 2 * f, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    y = kernels.silu_mul(gate_up)
    close(y, F.silu(gate) * up, rel_tol(dtype), 1e-6)
    assert torch.equal(y[1000:], kernels.silu_mul(gate_up[1000:]))


# -- attend -------------------------------------------------------------------------------------


def reference_attend(qkv, cos, sin, positions, k_cache, v_cache, kv_len, n_heads, n_kv_heads, fp32_math=False):
    """The Python path of llama.Attention (RoPE, index_put into the cache, small_m_attention), writing
    into the given caches. ``fp32_math``: attention in fp32 on the (bf16) q/k/v, rounded once at the end."""
    b, m, _ = qkv.shape
    d = k_cache.shape[-1]
    q, k, v = qkv.split([n_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q = apply_rope(q.reshape(b, m, n_heads, d).transpose(1, 2), c, s)
    k = apply_rope(k.reshape(b, m, n_kv_heads, d).transpose(1, 2), c, s)
    rows = torch.arange(b)[:, None].expand(b, m)
    k_cache[rows, :, positions] = k.transpose(1, 2)
    v_cache[rows, :, positions] = v.reshape(b, m, n_kv_heads, d)
    keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    if fp32_math:
        q, keys, values = q.float(), keys.float(), values.float()
    mask = Transformer._mask(positions, kv_len)

    def heads_last(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(b, m, n_heads * d)

    out = heads_last(small_m_attention(q, keys, values, mask)).to(qkv.dtype)
    if not fp32_math:
        return out
    return out, heads_last(small_m_attention(q, keys, values.abs(), mask))  # P @ |V|: the probabilities' weight


def attend_inputs(b, m, n_heads, n_kv_heads, d, cache_len, dtype, seed, starts=None):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, m, (n_heads + 2 * n_kv_heads) * d, generator=g).to(dtype)
    if starts is None:
        starts = torch.randint(1, cache_len - m + 1, (b,), generator=g).tolist()
    positions = torch.stack([torch.arange(s, s + m) for s in starts])
    cos_t, sin_t = rope_tables(d, 10000.0, cache_len, dtype)
    # A bigger cache whose rows 1..b are the ones attended: a view, as cache.k[i][rows] is.
    big_k = torch.randn(b + 2, n_kv_heads, cache_len, d, generator=g).to(dtype)
    big_v = torch.randn(b + 2, n_kv_heads, cache_len, d, generator=g).to(dtype)
    return qkv, cos_t[positions], sin_t[positions], positions, big_k, big_v


def check_attend(b, m, n_heads, n_kv_heads, d, dtype, seed, kv_extra=0, cache_len=48):
    qkv, cos, sin, pos, big_k, big_v = attend_inputs(b, m, n_heads, n_kv_heads, d, cache_len, dtype, seed)
    kv_len = min(cache_len, int(pos.max()) + 1 + kv_extra)
    ref_k, ref_v = big_k.clone(), big_v.clone()
    out = kernels.attend(qkv, cos, sin, pos, big_k[1:b + 1], big_v[1:b + 1], kv_len, n_heads, n_kv_heads)
    ref = reference_attend(qkv, cos, sin, pos, ref_k[1:b + 1], ref_v[1:b + 1], kv_len, n_heads, n_kv_heads,
                           dtype == torch.bfloat16)
    assert torch.equal(big_k, ref_k) and torch.equal(big_v, ref_v)  # the rows around the view untouched too
    check_attend_output(out, ref)


def check_attend_output(out: torch.Tensor, ref) -> None:
    if out.dtype == torch.float32:
        close(out, ref, 1e-5, 1e-5)
    else:
        ref, weight = ref
        close(out, ref, BF16_ULP, 2.0 ** -8 * weight + 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("ratio", [1, 2, 7])
def test_attend_matches_the_python_path(dtype, d, ratio):
    n_kv = 2 if ratio < 7 else 1
    for b in (1, 2, 3):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 17):
            for kv_extra in (0, 5):  # kv_len = the last position + 1, or past it (stale keys hidden by position)
                check_attend(b, m, n_kv * ratio, n_kv, d, dtype, seed=100 * b + m, kv_extra=kv_extra)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_long_context_and_odd_head_sizes(dtype):
    check_attend(2, 5, 12, 2, 128, dtype, seed=1, cache_len=1500)  # past one key tile, threaded
    check_attend(1, SMALL_M, 14, 2, 64, dtype, seed=2, cache_len=300)
    for d in (48, 80, 256):  # chunks of 32 bf16 with a half chunk left, and the largest head
        check_attend(2, 3, 4, 2, d, dtype, seed=d, cache_len=70)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_respects_cache_strides(dtype):
    # A cache stored [B, L, KV, D] and viewed as [B, KV, L, D]: only the last dim is contiguous.
    b, m, h, kv, d, length = 2, 3, 4, 2, 32, 40
    qkv, cos, sin, pos, _, _ = attend_inputs(b, m, h, kv, d, length, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    store_k = torch.randn(b, length, kv, d, generator=g).to(dtype)
    store_v = torch.randn(b, length, kv, d, generator=g).to(dtype)
    ref_k, ref_v = store_k.clone(), store_v.clone()
    kv_len = int(pos.max()) + 1
    out = kernels.attend(qkv, cos, sin, pos, store_k.transpose(1, 2), store_v.transpose(1, 2), kv_len, h, kv)
    ref = reference_attend(qkv, cos, sin, pos, ref_k.transpose(1, 2), ref_v.transpose(1, 2), kv_len, h, kv,
                           dtype == torch.bfloat16)
    assert torch.equal(store_k, ref_k) and torch.equal(store_v, ref_v)
    check_attend_output(out, ref)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    """Long calls split their (row, KV head) tasks over threads: results must not change with that."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 1, 64), (6, 2, 128), (2, 2, 16)])
def test_attend_rows_and_queries_are_independent(dtype, shape, threads):
    h, kv, d = shape
    length, m = 1200, 9
    qkv, cos, sin, pos, big_k, big_v = attend_inputs(3, m, h, kv, d, length, dtype, seed=5, starts=[40, 1000, 7])
    k_all, v_all = big_k[1:4].clone(), big_v[1:4].clone()
    together = kernels.attend(qkv, cos, sin, pos, k_all, v_all, length, h, kv)  # kv_len past every row
    for row in range(3):
        # The row alone, with its own kv_len, in a fresh copy of its cache.
        k1, v1 = big_k[row + 1:row + 2].clone(), big_v[row + 1:row + 2].clone()
        sl = slice(row, row + 1)
        alone = kernels.attend(qkv[sl], cos[sl], sin[sl], pos[sl], k1, v1, int(pos[row].max()) + 1, h, kv)
        assert torch.equal(alone[0], together[row]), row
        assert torch.equal(k1[0], k_all[row]) and torch.equal(v1[0], v_all[row])
        # Its first queries alone (decode = verification): query i only sees keys written up to it.
        for mq in (1, 4):
            k2, v2 = big_k[row + 1:row + 2].clone(), big_v[row + 1:row + 2].clone()
            q = slice(0, mq)
            fewer = kernels.attend(qkv[sl, q], cos[sl, q], sin[sl, q], pos[sl, q], k2, v2, int(pos[row, mq - 1]) + 1,
                                   h, kv)
            assert torch.equal(fewer[0], together[row, :mq]), (row, mq)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_prefill_matches_and_splits_without_changing_bits(dtype):
    # A causal prefill (hundreds of queries from position 0, as the prefill path runs it) matches the
    # reference; with more threads than (row, KV head) pairs the query blocks are dealt out over more
    # tasks (4 and 8 threads here), bit for bit the same output and cache.
    b, m, h, kv, d = 1, 150, 6, 2, 64
    qkv, cos, sin, pos, big_k, big_v = attend_inputs(b, m, h, kv, d, 160, dtype, seed=6, starts=[0])
    ref_k, ref_v = big_k.clone(), big_v.clone()
    # The reference in chunks of SMALL_M queries (its additive mask is for a few queries): causal, so
    # every key a query sees is written by its own or an earlier chunk.
    parts = [reference_attend(qkv[:, c:c + SMALL_M], cos[:, c:c + SMALL_M], sin[:, c:c + SMALL_M],
                              pos[:, c:c + SMALL_M], ref_k[1:2], ref_v[1:2], min(m, c + SMALL_M), h, kv,
                              dtype == torch.bfloat16) for c in range(0, m, SMALL_M)]
    ref = torch.cat(parts, 1) if dtype == torch.float32 else tuple(torch.cat(t, 1) for t in zip(*parts, strict=True))
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 4, 8):
            torch.set_num_threads(n)
            k1, v1 = big_k[1:2].clone(), big_v[1:2].clone()
            outs.append(kernels.attend(qkv, cos, sin, pos, k1, v1, m, h, kv))
            assert torch.equal(k1, ref_k[1:2]) and torch.equal(v1, ref_v[1:2])
    finally:
        torch.set_num_threads(before)
    check_attend_output(outs[0], ref)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_attend_applies_to_multiples_of_16_only():
    assert kernels.attend_applies(64, DTYPES[-1]) and kernels.attend_applies(256, torch.float32)
    assert kernels.attend_applies(64, torch.bfloat16) == kernels.available()  # bf16: AVX-512 BF16 only
    assert not kernels.attend_applies(24, torch.float32)
    assert not kernels.attend_applies(272, torch.float32)
    assert not kernels.attend_applies(64, torch.float16)
    qkv, cos, sin, pos, big_k, big_v = attend_inputs(1, 1, 2, 1, 24, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="does not apply"):
        kernels.attend(qkv, cos, sin, pos, big_k[:1], big_v[:1], 8, 2, 1)


# -- the whole model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory):
    """head_dim 16 (qwen2: q/k/v biases), 64 with 7 query heads per KV head (llama), 24 (no fused attention)."""
    specs = {"qwen2_hd16": dict(arch="qwen2", dim=64, heads=4, kv_heads=2),
             "llama_hd64_gqa7": dict(arch="llama", dim=448, heads=7, kv_heads=1, tie=True),
             "qwen2_hd24": dict(arch="qwen2", dim=96, heads=4, kv_heads=2)}
    folders = {}
    for name, kw in specs.items():
        folder = tmp_path_factory.mktemp(name)
        make_tiny(folder, layers=3, scale=2.0, seed=7, **kw)
        folders[name] = folder
    return folders


def run(model, cache, tokens, positions, fused, **kw):
    model.fused_ops = fused
    try:
        with torch.inference_mode():
            return model(tokens, positions, cache, **kw)
    finally:
        model.fused_ops = True


def steps(model, fused, seed=0, **kw):
    """A prefill (2 rows, Python path), then decode and verification forwards; all logits."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.args.vocab_size
    cache = model.new_cache(2, 96)
    outs = [run(model, cache, torch.randint(0, vocab, (2, 40), generator=g), torch.arange(40).expand(2, 40),
                fused, last_only=True, **kw)]
    start = 40
    for m in (1, 4, 1, 8):
        tokens = torch.randint(0, vocab, (2, m), generator=g)
        pos = torch.stack([torch.arange(start, start + m), torch.arange(start - 3, start - 3 + m)])
        outs.append(run(model, cache, tokens, pos, fused, **kw))
        # One row alone through a view of the cache (rows=), as batched steps do.
        outs.append(run(model, cache, tokens[1:], pos[1:], fused, rows=slice(1, 2), **kw))
        start += m
    return outs


@pytest.mark.parametrize("name", ["qwen2_hd16", "llama_hd64_gqa7"])
def test_fused_model_matches_the_python_path_fp32(tiny_folders, name):
    model = build_model(open_source(tiny_folders[name]), torch.float32, progress=False)
    assert model.fused_ops
    x = model.embed(torch.zeros(1, 1, dtype=torch.long))
    assert model._use_fused(x, model.new_cache(1, 4))
    for kw in ({}, {"n_layers": 1}):
        fused, python = steps(model, True, **kw), steps(model, False, **kw)
        for a, b in zip(fused, python, strict=True):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), kw


def test_kernels_stock_keeps_the_python_path(tiny_folders):
    stock = build_model(open_source(tiny_folders["qwen2_hd16"]), torch.float32, progress=False, kernels="stock")
    auto = build_model(open_source(tiny_folders["qwen2_hd16"]), torch.float32, progress=False)
    assert not stock.fused_ops and auto.fused_ops
    for a, b in zip(steps(auto, True), steps(stock, False), strict=True):  # fp32 dense: the same matmuls
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    odd = build_model(open_source(tiny_folders["qwen2_hd24"]), torch.float32, progress=False)
    x = odd.embed(torch.zeros(1, 1, dtype=torch.long))
    assert odd.fused_ops and not odd._use_fused(x, odd.new_cache(1, 4))  # head_dim 24: the Python path
    assert all(torch.isfinite(o).all() for o in steps(odd, True))


def count_fused_ops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the fused ops (rms_norm, add_rms_norm, silu_mul, attend) called from now on."""
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm", "silu_mul", "attend"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name):  # noqa: ANN002, ANN202 - passes everything on
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(kernels, name, spy)
    return calls


@pytest.mark.parametrize("name", ["qwen2_hd16", "qwen2_hd24"])
def test_prefill_runs_the_fused_ops_and_matches_the_python_path(tiny_folders, name, monkeypatch):
    # Past SMALL_M tokens (a prefill) the norms, residual adds and silu * up are the fused row ops,
    # head size 24 included; attention is the fused attend where it applies (head size 16), SDPA
    # otherwise. fp32 within the sum-order tolerance, for a fresh prefill and for a chunk that
    # continues one (the second half of the prompt at positions past the first).
    model = build_model(open_source(tiny_folders[name]), torch.float32, progress=False)
    calls = count_fused_ops(monkeypatch)
    attend = ["attend"] if name == "qwen2_hd16" else []
    g = torch.Generator().manual_seed(3)
    n_tok = 2 * SMALL_M + 18
    tokens = torch.randint(0, model.args.vocab_size, (2, n_tok), generator=g)
    pos = torch.arange(n_tok).expand(2, -1)
    half = n_tok // 2
    for kw in ({}, {"n_layers": 2}, {"last_only": True}):
        fused = run(model, model.new_cache(2, 128), tokens, pos, True, **kw)
        n = kw.get("n_layers", 3)
        assert calls == ["rms_norm"] + (attend + ["add_rms_norm", "silu_mul", "add_rms_norm"]) * n, kw
        calls.clear()
        python = run(model, model.new_cache(2, 128), tokens, pos, False, **kw)
        assert not calls
        assert (fused - python).abs().max() <= 1e-4 * python.abs().max(), kw
        chunks = {}
        for ops in (True, False):
            cache = model.new_cache(2, 128)
            run(model, cache, tokens[:, :half], pos[:, :half], ops)
            chunks[ops] = run(model, cache, tokens[:, half:], pos[:, half:], ops, **kw)
        calls.clear()
        assert (chunks[True] - chunks[False]).abs().max() <= 1e-4 * chunks[False].abs().max(), kw
        assert (chunks[True][:, -1] - python[:, -1]).abs().max() <= 1e-4 * python.abs().max(), kw


def test_python_path_decode_keeps_its_ops(tiny_folders):
    # A decode / verification step that takes the Python path (head size 24: no fused attention) runs
    # exactly the ops it always has, fused_ops or not: bit for bit, in bf16.
    model = build_model(open_source(tiny_folders["qwen2_hd24"]), torch.bfloat16, progress=False)
    g = torch.Generator().manual_seed(4)
    vocab = model.args.vocab_size
    prompt = torch.randint(0, vocab, (1, 40), generator=g)
    caches = {fused: model.new_cache(1, 96) for fused in (True, False)}
    for cache in caches.values():
        run(model, cache, prompt, torch.arange(40)[None], False)  # the same prefill in both
    start = 40
    for m in (1, 5, SMALL_M):
        tokens = torch.randint(0, vocab, (1, m), generator=g)
        pos = torch.arange(start, start + m)[None]
        a, b = (run(model, caches[fused], tokens, pos, fused) for fused in (True, False))
        assert torch.equal(a, b), m
        start += m


def greedy(model, fused, prompt, n):
    cache = model.new_cache(1, 96)
    tokens = torch.tensor([prompt])
    logits = run(model, cache, tokens, torch.arange(len(prompt))[None], fused, last_only=True)
    out = []
    for i in range(n):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        pos = len(prompt) + i
        logits = run(model, cache, torch.tensor([[nxt]]), torch.tensor([[pos]]), fused)
    return out


@pytest.mark.parametrize("name", ["qwen2_hd16", "llama_hd64_gqa7"])
def test_fused_greedy_tokens_match_the_python_path(tiny_folders, name):
    model = build_model(open_source(tiny_folders[name]), torch.float32, progress=False)
    for seed in range(3):
        prompt = torch.randint(0, model.args.vocab_size, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        tokens = greedy(model, True, prompt, 24)
        assert len(set(tokens)) > 1
        assert tokens == greedy(model, False, prompt, 24)


# bf16 with the fast dense kernels (AVX-512 BF16), and fp32 with int4 weights (every CPU with the kernels).
VERIFY_CASES = [(torch.float32, "int4")] + ([(torch.bfloat16, "dense")] if torch.bfloat16 in DTYPES else [])


@pytest.mark.parametrize("dtype,weights", VERIFY_CASES, ids=[f"{str(d)[6:]}-{w}" for d, w in VERIFY_CASES])
@pytest.mark.parametrize("name", ["qwen2_hd16", "llama_hd64_gqa7"])
def test_verification_equals_decoding_bit_for_bit(tiny_folders, name, dtype, weights):
    # Every op of the step is row- and M-independent, so logits of a token verified with others equal
    # those of decoding it alone, in a batch or not.
    model = build_model(open_source(tiny_folders[name]), dtype, weights, progress=False)
    assert model.fused_ops
    g = torch.Generator().manual_seed(1)
    vocab = model.args.vocab_size
    prompt = torch.randint(0, vocab, (2, 30), generator=g)
    block = torch.randint(0, vocab, (2, 6), generator=g)
    pos = torch.stack([torch.arange(30, 36), torch.arange(27, 33)])
    batched_cache = model.new_cache(2, 64)
    run(model, batched_cache, prompt, torch.arange(30).expand(2, 30), True)
    verified = run(model, batched_cache, block, pos, True)
    for row in range(2):
        cache = model.new_cache(1, 64)
        n = int(pos[row, 0])
        run(model, cache, prompt[row:row + 1, :n], torch.arange(n)[None], True)
        for i in range(6):
            alone = run(model, cache, block[row:row + 1, i:i + 1], pos[row:row + 1, i:i + 1], True)
            assert torch.equal(alone[0, 0], verified[row, i]), (row, i)
