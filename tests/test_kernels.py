"""verispec's weight-only int4/int8 and dense bf16 CPU kernels (verispec/kernels) against plain references.

The reference for every product is dequantize-then-matmul in fp32 with the activations the
kernel sees (bf16-rounded x; fp32 x for the int8 fp32 path; the bf16 weight itself for bf16).
Tolerances, with
``S = |x| @ |w|^T`` (the scale of the accumulated terms):

- fp32 output: ``|y - ref| <= 1e-5 * S`` -- fp32 accumulation only (products of bf16 x and
  exact bf16 weights are exact in fp32); PyTorch's stock kernels, which round their output to
  bf16, are ~2^-9 of |y| off, so this is far tighter than what they achieve;
- bf16 output: ``|y - ref| <= 2^-8 * |ref| + 1e-5 * S`` -- one rounding to bf16 (half an ulp
  is at most 2^-8 of the value) on top of the same accumulation error.

When the CPU has AVX-512 BF16 the fast path must be available here (detected, not assumed);
elsewhere those tests are skipped and only the stock fallback is checked.

The large-M (prefill) path expands the weight to bf16 (``int4_dequant`` / ``int8_dequant`` /
``bf16_unpack``) and calls ``F.linear`` (oneDNN). The expansions must equal the Python reference
dequantization rounded to bf16 exactly: the fp32 value is the reference's own ((q - 8) * scale and
q * scale are exact in fp32 for bf16 scales, so the kernel's FMA rounds once where the reference's
add does; an fp32 int8 scale is one fp32 product on both sides) and both round it to bf16 the same
way (nearest even, denormals kept). The layers' outputs are then checked against the fp32 product
with that bf16 weight within the bf16-output tolerance above, widened to ``2^-8 * (|ref| + |bias|)``
with a bias (oneDNN may round the product before adding the bias), and against the exact fp32
weight within a further ``2^-9 * S`` (each weight rounded to bf16 moves by at most 2^-9 of itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quant import write_gguf
from tiny import make_tiny

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig, kernels
from verispec.config import K_MAX
from verispec.errors import VerispecError
from verispec.models import linear
from verispec.models.linear import (
    DenseLinear,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    _cpu_block_layout,
    _cpu_block_n,
    _vs16_pack_reference,
    _vs16_unpack_reference,
    make_linear,
)
from verispec.models.loader import build_model, open_source


def cpu_flags() -> set[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(flags.split(":", 1)[1].split())


def cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= cpu_flags()


FAST = kernels.available()
fast_only = pytest.mark.skipif(not FAST, reason=f"fast kernels unavailable: {kernels.why_unavailable()}")
Q8 = kernels.q8_available()
q8_only = pytest.mark.skipif(not Q8, reason="8-bit activations need verispec's kernels and AVX-512 VNNI or AVX2")
# Where the CPU has AVX2 but not AVX-512 BF16, int4/int8 layers run the 8-bit kernels under "auto" too.
AUTO_Q8 = Q8 and not FAST
layouts_only = pytest.mark.skipif(not kernels.layouts_available(), reason="verispec's kernels did not build here")


def test_fast_kernels_run_where_the_cpu_has_them():
    if cpu_has_avx512_bf16():
        assert FAST, kernels.why_unavailable()
    else:
        assert not FAST
    if {"avx2", "fma"} <= cpu_flags():  # every x86-64 CPU with AVX2 runs the 8-bit int4/int8 kernels
        assert kernels.layouts_available() and (Q8 or (FAST and "avx512_vnni" not in cpu_flags()))
    else:
        assert not Q8


def random_int4(n: int, k: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    return Int4Weight.quantize(torch.randn(n, k, generator=g))


def random_int8(n: int, k: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    return Int8Weight.quantize(torch.randn(n, k, generator=g), dtype)


def check(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, wd: torch.Tensor) -> None:
    s = x.float().abs() @ wd.abs().t()
    err = (y.float() - ref).abs()
    bound = 1e-5 * s + (2.0 ** -8 * ref.abs() if y.dtype == torch.bfloat16 else 0)
    assert (err <= bound + 1e-30).all(), f"max excess {(err - bound).max().item()}"


# -- layouts ----------------------------------------------------------------------------------


@layouts_only
@pytest.mark.parametrize("n,k", [(16, 32), (64, 256), (48, 96), (2048, 1536), (80, 8960)])
def test_int4_packers_agree(n, k):
    w = random_int4(n, k, n + k)
    codes = w.codes()
    packed = kernels.int4_pack(codes)
    assert torch.equal(packed, _vs16_pack_reference(codes))
    assert torch.equal(kernels.int4_unpack(packed, n, k), codes)
    assert torch.equal(_vs16_unpack_reference(packed, n, k), codes)
    v = w.to_layout("vs16")  # from PyTorch's packed blocks directly when they are whole
    assert torch.equal(v.packed, packed) and v.shape == (n, k)
    assert torch.equal(v.codes(), codes) and torch.equal(v.dequantize(), w.dequantize())
    back = v.to_layout("cpu")
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scales_and_zeros, w.scales_and_zeros)
    if n % _cpu_block_n() == 0:
        assert torch.equal(kernels.int4_from_stock(w.packed, n, k, _cpu_block_layout(_cpu_block_n())), packed)


@layouts_only
@pytest.mark.parametrize("n,k", [(16, 32), (40, 6), (33, 98), (1000, 1536)])
def test_int8_packers_agree(n, k):
    w = random_int8(n, k)
    v = w.to_layout("vs16")
    assert v.qweight.shape == ((n + 15) // 16, k // 2, 16, 2) and v.shape == (n, k)
    padded = torch.zeros((n + 15) // 16 * 16, k, dtype=torch.int8)
    padded[:n] = w.qweight
    assert torch.equal(v.qweight, padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3))
    assert torch.equal(v.rows(), w.qweight) and torch.equal(kernels.int8_unpack(v.qweight, n, k), w.qweight)
    assert torch.equal(v.to_layout("rows").qweight, w.qweight)


@fast_only
@pytest.mark.parametrize("n,k", [(16, 32), (40, 6), (33, 98), (1000, 1536)])
def test_bf16_packers_agree(n, k):
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = kernels.bf16_pack(w)
    padded = torch.zeros((n + 15) // 16 * 16, k, dtype=torch.bfloat16)
    padded[:n] = w
    assert packed.shape == ((n + 15) // 16, k // 2, 16, 2)
    assert torch.equal(packed, padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3))
    assert torch.equal(kernels.bf16_unpack(packed, n, k), w)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    assert kernels.bf16_unpack(packed, n, k, out).data_ptr() == out.data_ptr() and torch.equal(out, w)


def test_weights_concatenate_in_either_layout():
    parts4 = [random_int4(n, 64, n) for n in (64, 16, 48)]
    ref4 = torch.cat([p.dequantize() for p in parts4])
    assert torch.equal(Int4Weight.cat(parts4).dequantize(), ref4)
    parts8 = [random_int8(n, 64, n) for n in (32, 20, 16)]  # 20: a part that is not whole blocks
    ref8 = torch.cat([p.dequantize() for p in parts8])
    assert torch.equal(Int8Weight.cat(parts8).dequantize(), ref8)
    if kernels.layouts_available():
        fused4 = Int4Weight.cat([p.to_layout("vs16") for p in parts4])
        assert fused4.layout == "vs16" and torch.equal(fused4.dequantize(), ref4)
        fused8 = Int8Weight.cat([p.to_layout("vs16") for p in parts8])
        assert fused8.layout == "vs16" and torch.equal(fused8.dequantize(), ref8)


# -- the kernels against dequantize-then-matmul -------------------------------------------------


@fast_only
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (64, 256), (1024, 1536), (96, 8960)])
@pytest.mark.parametrize("m", [*range(1, 9), 11, 17])
def test_int4_kernel_matches_reference(n, k, m):
    w = random_int4(n, k, m)
    v = w.to_layout("vs16")
    wd = w.dequantize()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref = x.float() @ wd.t()
    y32 = kernels.int4_mm(x, v.packed, v.scales_and_zeros, n, out_dtype=torch.float32)
    y16 = kernels.int4_mm(x, v.packed, v.scales_and_zeros, n)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16 and y16.shape == (m, n)
    check(y32, ref, x, wd)
    check(y16, ref, x, wd)
    stock = torch._weight_int4pack_mm_for_cpu(x, w.packed, 32, w.scales_and_zeros).float()
    assert (y32 - ref).abs().max() * 10 <= (stock - ref).abs().max()  # the stock kernel rounds to bf16
    bias = torch.randn(n).to(torch.bfloat16)
    yb = kernels.int4_mm(x, v.packed, v.scales_and_zeros, n, bias, torch.float32)
    torch.testing.assert_close(yb, y32 + bias.float(), rtol=0, atol=1e-4 * float(ref.abs().max()))


def quantized_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group of 32: codes round(x * 127 / max|x|) (fp32, nearest even, as the kernel; fp64
    [M, K/32, 32]) and the scale max|x| / 127 (fp64 [M, K/32])."""
    m, k = x.shape
    xf = x.float().view(m, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv).double(), (amax.double() / 127.0).squeeze(-1)


def q8_reference(x: torch.Tensor, w: Int4Weight | Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, S) in fp64 for 8-bit activations: the codes of :func:`quantized_groups` times the weight's
    (q - 8) * scale plus zero * sum(x) per group (int4), or times q, with the row scale last (int8);
    S is the sum of the terms' magnitudes."""
    m, k = x.shape
    xq, step_x = quantized_groups(x)
    if isinstance(w, Int8Weight):
        q = w.rows().double().view(-1, k // 32, 32)  # [N, K/32, 32]
        step = step_x[:, None, :] * w.scale.double()[None, :, None]
        mag = torch.einsum("mgk,ngk->mng", xq.abs(), q.abs()) * step.abs()
        return (torch.einsum("mgk,ngk->mng", xq, q) * step).sum(-1), mag.sum(-1)
    xf = x.float().view(m, k // 32, 32)
    sz = w.stock_scales_and_zeros().double()  # [K/32, N, 2]
    q = w.codes().double().view(-1, k // 32, 32) - 8  # [N, K/32, 32]
    dot = torch.einsum("mgk,ngk->mng", xq, q)
    step = step_x[:, None, :] * sz[..., 0].t()[None]  # [M, N, K/32]
    zero = sz[..., 1].t()[None] * xf.double().sum(-1)[:, None, :]
    mag = torch.einsum("mgk,ngk->mng", xq.abs(), q.abs()) * step.abs() + zero.abs()
    return (dot * step + zero).sum(-1), mag.sum(-1)


@q8_only
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (64, 256), (1024, 1536), (96, 8960)])
@pytest.mark.parametrize("m", [*range(1, 9), 11, 17])
def test_int4_kernel_with_8_bit_activations(n, k, m):
    w = random_int4(n, k, m)
    v = w.to_layout("vs16")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    x[0, :32] = 0  # an all-zero group: scale 0, codes 0
    ref, mag = q8_reference(x, w)
    y32 = kernels.int4_mm(x, v.packed, v.scales_and_zeros, n, out_dtype=torch.float32, q8=True)
    assert ((y32.double() - ref).abs() <= 1e-5 * mag + 1e-30).all()  # fp32 accumulation only
    y16 = kernels.int4_mm(x, v.packed, v.scales_and_zeros, n, q8=True)
    assert y16.dtype == torch.bfloat16 and ((y16.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * mag).all()
    # Against the bf16 activations: the quantization's error, about half a step of 1/127 per group.
    exact = x.float() @ w.dequantize().t()
    assert (y32 - exact).norm() <= 0.02 * exact.norm()


@q8_only
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (33, 96), (1000, 1536), (64, 8960)])
@pytest.mark.parametrize("m", [*range(1, 9), 11, 17])
def test_int8_kernel_with_8_bit_activations(n, k, m):
    w = random_int8(n, k, m)
    v = w.to_layout("vs16")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    x[0, :32] = 0
    ref, mag = q8_reference(x, w)
    y32 = kernels.int8_mm(x, v.qweight, w.scale, n, out_dtype=torch.float32, q8=True)
    assert ((y32.double() - ref).abs() <= 1e-5 * mag + 1e-30).all()
    y16 = kernels.int8_mm(x, v.qweight, w.scale, n, q8=True)
    assert y16.dtype == torch.bfloat16 and ((y16.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * mag).all()
    exact = x.float() @ w.dequantize().t()
    assert (y32 - exact).norm() <= 0.02 * exact.norm()
    # fp32 activations are cast to bf16 first, then quantized alike.
    assert torch.equal(kernels.int8_mm(x.float(), v.qweight, w.scale, n, out_dtype=torch.float32, q8=True), y32)


@fast_only
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (33, 98), (1000, 1536), (64, 8960)])
@pytest.mark.parametrize("m", [*range(1, 9), 11, 17])
def test_int8_kernel_matches_reference(n, k, m):
    w = random_int8(n, k, m)
    v = w.to_layout("vs16")
    wd = w.dequantize()
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    ref = x.float() @ wd.t()
    check(kernels.int8_mm(x, v.qweight, w.scale, n, out_dtype=torch.float32), ref, x, wd)
    check(kernels.int8_mm(x, v.qweight, w.scale, n), ref, x, wd)
    # fp32 activations: three bf16 parts, so every product is the exact fp32 one.
    w32 = random_int8(n, k, m, torch.float32)
    x32 = torch.randn(m, k, generator=gen)
    y = kernels.int8_mm(x32, w32.to_layout("vs16").qweight, w32.scale, n)
    assert y.dtype == torch.float32
    check(y, x32 @ w32.dequantize().t(), x32, w32.dequantize())


@fast_only
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (33, 98), (1000, 1536), (64, 8960)])
@pytest.mark.parametrize("m", [*range(1, 9), 11, 17])
def test_bf16_kernel_matches_reference(n, k, m):
    # The weight is bf16 already, so the reference is simply the fp32 product of the same values.
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    packed = kernels.bf16_pack(w)
    wd = w.float()
    ref = x.float() @ wd.t()
    y32 = kernels.bf16_mm(x, packed, n, out_dtype=torch.float32)
    y16 = kernels.bf16_mm(x, packed, n)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16 and y16.shape == (m, n)
    check(y32, ref, x, wd)
    check(y16, ref, x, wd)
    stock = torch.nn.functional.linear(x, w).float()  # oneDNN rounds its output to bf16
    assert (y32 - ref).abs().max() * 10 <= (stock - ref).abs().max()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    yb = kernels.bf16_mm(x, packed, n, bias, torch.float32)
    torch.testing.assert_close(yb, y32 + bias.float(), rtol=0, atol=1e-4 * float(ref.abs().max()))
    check(kernels.bf16_mm(x, packed, n, bias), ref + bias.float(), x, wd)  # bias added before the one rounding


@fast_only
@pytest.mark.parametrize("fmt", ["int4", "int4-q8", "int8", "int8-q8", "bf16"])
def test_a_row_gives_the_same_bits_alone_or_with_others(fmt):
    # Verifying k+1 tokens at once must score each exactly as decoding it alone would.
    n, k = 256, 512
    x = torch.randn(13, k).to(torch.bfloat16)
    if fmt.endswith("-q8") and not Q8:
        pytest.skip("8-bit activations need AVX-512 VNNI")
    if fmt.startswith("int4"):
        v = random_int4(n, k).to_layout("vs16")

        def run(rows):
            return kernels.int4_mm(rows, v.packed, v.scales_and_zeros, n, q8=fmt == "int4-q8")
    elif fmt.startswith("int8"):
        v = random_int8(n, k).to_layout("vs16")

        def run(rows):
            return kernels.int8_mm(rows, v.qweight, v.scale, n, q8=fmt == "int8-q8")
    else:
        lin = make_linear(torch.randn(n, k), torch.randn(n), "dense", torch.bfloat16)
        assert isinstance(lin, DenseLinear) and lin.fast

        def run(rows):
            return lin(rows)
    together = run(x)
    for m in range(13):
        assert torch.equal(run(x[m:m + 1])[0], together[m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(run(x), together)
    finally:
        torch.set_num_threads(threads)


# -- dequantization for the large-M path ------------------------------------------------------------


@fast_only
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (2048, 1536), (80, 8960)])
def test_int4_dequant_equals_the_reference(n, k):
    w = random_int4(n, k, n + k).to_layout("vs16")
    ref = w.dequantize().to(torch.bfloat16)
    assert torch.equal(kernels.int4_dequant(w.packed, w.scales_and_zeros, n, k), ref)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
    assert kernels.int4_dequant(w.packed, w.scales_and_zeros, n, k, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.int4_dequant(w.packed, w.scales_and_zeros, n, k, out.float())


@fast_only
def test_int4_dequant_is_exact_over_a_wide_range_of_scales():
    # Scales and zeros from 2^-40 to 2^40 (either sign), so the fp32 sum (q - 8) * scale + zero rounds
    # often and bf16 ties and tiny values come up: still the reference's bits.
    g = torch.Generator().manual_seed(7)
    n, k = 64, 512
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)

    def spread(shape: tuple[int, int]) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 2.0 ** torch.randint(-40, 41, shape, generator=g).float()

    scale, zero = spread((n, k // 32)), spread((n, k // 32))
    scale[0, :4] = 0.0
    w = Int4Weight.from_codes(codes, scale, zero).to_layout("vs16")
    assert torch.equal(kernels.int4_dequant(w.packed, w.scales_and_zeros, n, k), w.dequantize().to(torch.bfloat16))


@fast_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 6), (33, 98), (1000, 1536), (17, 8960)])
def test_int8_dequant_equals_the_reference(n, k, dtype):
    # Rows past a multiple of 16 (a partial last block) and K past a multiple of 32 (the scalar tail).
    w = random_int8(n, k, n + k, dtype).to_layout("vs16")
    ref = w.dequantize().to(torch.bfloat16)
    assert torch.equal(kernels.int8_dequant(w.qweight, w.scale, n, k), ref)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    assert kernels.int8_dequant(w.qweight, w.scale, n, k, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, ref)


def large_m_layer(fmt: str, n: int, k: int, bias: bool, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g) if bias else None
    lin = make_linear(torch.randn(n, k, generator=g), b, fmt, torch.bfloat16)
    assert lin.fast
    return lin


def count_expansions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every weight expansion (the large-M path) the layers make from now on."""
    calls: list[str] = []
    for name in ("int4_dequant", "int8_dequant", "bf16_unpack"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name, **kw):  # noqa: ANN002, ANN003, ANN202 - passes everything on
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(kernels, name, spy)
    return calls


@fast_only
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fmt", ["int4", "int8", "dense"])
def test_large_m_layers_match_the_dequantized_matmul(fmt, bias, monkeypatch):
    n, k = (272, 320) if fmt == "int4" else (270, 322)  # int8/bf16: a partial block of rows, K % 32 != 0
    lin = large_m_layer(fmt, n, k, bias)
    calls = count_expansions(monkeypatch)
    wd = lin.dequantized()  # the exact (fp32) weight
    wb = wd.to(torch.bfloat16).float()  # what oneDNN multiplies
    bias_f = lin.bias.float() if bias else torch.zeros(n)
    x = torch.randn(2, linear.PREFILL_M, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = x.float() @ wb.t() + bias_f
    s = x.float().abs() @ wb.abs().t()
    y = lin(x)
    assert calls and y.dtype == torch.bfloat16 and y.shape == (2, linear.PREFILL_M, n)
    err = (y.float() - ref).abs()
    assert (err <= 2.0 ** -8 * (ref.abs() + bias_f.abs()) + 1e-5 * s + 1e-30).all()
    exact = x.float() @ wd.t() + bias_f
    assert ((y.float() - exact).abs() <= 2.0 ** -8 * (exact.abs() + bias_f.abs()) + (2.0 ** -9 + 1e-5) * s).all()
    # A weight past LARGE_M_CHUNK elements goes in chunks of rows (a big lm_head): the same products.
    monkeypatch.setattr(linear, "LARGE_M_CHUNK", 64 * k)
    calls.clear()
    chunked = lin(x)
    assert len(calls) == 5  # 64 + 64 + 64 + 64 + the rest
    assert ((chunked.float() - ref).abs() <= 2.0 ** -8 * (ref.abs() + bias_f.abs()) + 1e-5 * s + 1e-30).all()


@fast_only
@pytest.mark.parametrize("fmt", ["int4", "int8", "dense"])
def test_large_m_path_is_chosen_by_tokens_per_row(fmt, monkeypatch):
    n, k = 64, 96
    lin = large_m_layer(fmt, n, k, bias=True)
    calls = count_expansions(monkeypatch)
    m = linear.PREFILL_M
    g = torch.Generator().manual_seed(2)
    # Many rows of few tokens each (decode / verification of a big batch): the kernel, whose rows are
    # independent of each other, bit for bit; so is a 2-D input of any size (the fused decode path).
    few = torch.randn(m + 1, 3, k, generator=g).to(torch.bfloat16)
    flat = few.reshape(-1, k)
    y = lin(few)
    assert not calls
    assert torch.equal(y.reshape(-1, n), lin(flat)) and torch.equal(lin(flat[5:6])[0], y.reshape(-1, n)[5])
    assert not calls
    if fmt != "dense":  # (a bf16 dense layer takes bf16 activations only)
        # fp32 activations keep the kernel (exactness tests run in fp32), however many tokens.
        lin(torch.randn(1, m, k, generator=g))
        assert not calls
    # PREFILL_M tokens in a row: the large-M path.
    lin(torch.randn(1, m, k, generator=g).to(torch.bfloat16))
    assert len(calls) == 1


@fast_only
@q8_only
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("amx", [False, True])
def test_layers_on_8bit_activations_keep_their_kernels_on_a_prefill_without_amx(fmt, amx, monkeypatch):
    # Without AMX the VNNI products beat dequantize + bf16 GEMM at any prompt length; with it oneDNN wins.
    monkeypatch.setattr(linear, "AMX", amx)
    n, k = 64, 96
    lin = large_m_layer(fmt, n, k, bias=False)
    from verispec.engine.kernel_choice import set_q8

    set_q8(lin, True)
    calls = count_expansions(monkeypatch)
    x = torch.randn(1, 2 * linear.PREFILL_M, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = lin(x)
    assert len(calls) == int(amx)
    if not amx:  # the kernels' rows do not depend on each other: each row as the decode step computes it
        assert torch.equal(y[0, 7], lin(x[0, 7:8].contiguous())[0])
    set_q8(lin, False)
    lin(x)
    assert len(calls) == int(amx) + 1  # bf16 activations take the large-M path


# -- the layers, fast and stock -------------------------------------------------------------------


def test_stock_choice_gives_the_stock_result():
    torch.manual_seed(0)
    w, x = torch.randn(96, 128), torch.randn(3, 128).to(torch.bfloat16)
    lin4 = make_linear(w, None, "int4", torch.bfloat16, kernels="stock")
    assert isinstance(lin4, Int4Linear) and not lin4.fast
    q = Int4Weight.quantize(w.to(torch.bfloat16))
    assert torch.equal(lin4(x), torch._weight_int4pack_mm_for_cpu(x, q.packed, 32, q.scales_and_zeros))
    lin8 = make_linear(w, None, "int8", torch.bfloat16, kernels="stock")
    assert isinstance(lin8, Int8Linear) and not lin8.fast
    q8 = Int8Weight.quantize(w, torch.bfloat16)
    assert torch.equal(lin8(x), torch._weight_int8pack_mm(x, q8.qweight, q8.scale))
    with pytest.raises(VerispecError, match="unknown kernels"):
        make_linear(w, None, "int4", torch.bfloat16, kernels="fastest")


def test_dense_layer_uses_the_bf16_kernel_only_where_it_should():
    torch.manual_seed(3)
    w, bias = torch.randn(96, 128), torch.randn(96)
    x = torch.randn(2, 7, 128)
    # fp32 models are untouched: a parameter and F.linear, bit for bit.
    f32 = make_linear(w, bias, "dense", torch.float32)
    assert isinstance(f32, DenseLinear) and not f32.fast and isinstance(f32.weight, torch.nn.Parameter)
    assert torch.equal(f32(x), torch.nn.functional.linear(x, w, bias))
    wb, bb, xb = w.to(torch.bfloat16), bias.to(torch.bfloat16), x.to(torch.bfloat16)
    stock = make_linear(w, bias, "dense", torch.bfloat16, kernels="stock")
    assert not stock.fast and torch.equal(stock(xb), torch.nn.functional.linear(xb, wb, bb))
    fast = make_linear(w, bias, "dense", torch.bfloat16)
    assert fast.fast == FAST
    assert torch.equal(fast.weight, wb) and torch.equal(fast.dequantized(), wb.float())
    if not FAST:
        return
    assert [n for n, _ in fast.named_parameters()] == ["bias"] and fast.packed.dtype == torch.bfloat16
    assert "weight" not in fast._parameters  # one copy of the weight, the packed one
    ref = xb.float() @ wb.float().t() + bb.float()
    for rows in (1, 5, 8, 13):  # every M goes through the kernel (as int4/int8 do), shapes kept
        xs = xb.reshape(-1, 128)[:rows]
        y = fast(xs)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
        check(y, ref.reshape(-1, 96)[:rows], xs, wb.float())
    assert fast(xb).shape == (2, 7, 96)
    # Tensor-parallel sharding slices .weight and builds new layers from the slices.
    half = DenseLinear(fast.weight.data.chunk(2, dim=1)[1].clone(), None)
    assert half.fast and torch.equal(half.weight, wb[:, 64:])
    # Off the packed layout's home (another dtype or device), the plain weight comes back.
    fast.to(torch.float32)
    assert not fast.fast and "packed" not in dict(fast.named_buffers())
    assert torch.equal(fast.weight, wb.float()) and fast(x).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fast_and_stock_layers_agree(fmt, dtype):
    torch.manual_seed(1)
    w, bias = torch.randn(96, 128), torch.randn(96)
    fast = make_linear(w, bias, fmt, dtype, kernels="auto")
    stock = make_linear(w, bias, fmt, dtype, kernels="stock")
    assert fast.fast == (FAST or Q8) and fast.q8 == AUTO_Q8 and not stock.fast
    wd = stock.dequantized()
    assert torch.equal(fast.dequantized(), wd)  # the same weights, whatever the layout
    x = torch.randn(2, 5, 128).to(dtype)
    yf, ys = fast(x), stock(x)
    assert yf.dtype == ys.dtype == dtype and yf.shape == ys.shape == (2, 5, 96)
    xr = x.to(torch.bfloat16).float() if fmt == "int4" or dtype == torch.bfloat16 else x.float()
    ref = xr @ wd.t() + bias.to(dtype).float()
    s = xr.abs() @ wd.abs().t() + bias.abs()
    # Both within bf16 rounding of the reference (stock rounds twice with a bias); 8-bit activations
    # within that of their own reference.
    assert ((ys.float() - ref).abs() <= 2.0 ** -7 * s + 1e-5).all()
    if fast.q8:
        ref, mag = q8_reference(x.reshape(-1, 128).to(torch.bfloat16), fast.int4_weight() if fmt == "int4"
                                else fast.int8_weight())
        ref, s = (ref + bias.to(dtype).double()).view(2, 5, 96), mag.view(2, 5, 96) + bias.abs()
    assert ((yf.double() - ref).abs() <= 2.0 ** -7 * s + 1e-5).all()
    if fast.fast and dtype == torch.float32:
        assert ((yf.double() - ref).abs() <= 1e-5 * s).all()  # fp32 models keep an fp32 output


@pytest.mark.parametrize("kern", ["auto", "stock"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["dense", "int4", "int8"])
def test_small_m_call_equals_the_layer(fmt, dtype, kern):
    # The fused decode path's lean call returns what the module does, bit for bit, with and without a
    # bias, for the rows of a decode / verification step; a layer without small_m is simply called.
    torch.manual_seed(2)
    w = torch.randn(96, 128)
    for bias in (None, torch.randn(96)):
        layer = make_linear(w, bias, fmt, dtype, kernels=kern)
        for m in (1, 3, 8):
            x = torch.randn(m, 128).to(dtype)
            y = linear.small_m_call(layer, x)
            assert y.dtype == dtype and torch.equal(y, layer(x)), (bias is None, m)
    plain = torch.nn.Linear(128, 96).to(dtype)
    x = torch.randn(2, 128).to(dtype)
    assert torch.equal(linear.small_m_call(plain, x), plain(x))


@fast_only
def test_int4_layer_moves_between_layouts():
    lin = make_linear(torch.randn(64, 64), None, "int4", torch.bfloat16)
    w = lin.int4_weight()
    assert w.layout == "vs16" and lin.qweight.shape == (4, 64 * 8)
    assert lin.to("cpu") is lin and lin.fast  # Engine moves models to their device; on the CPU a no-op
    stock = Int4Linear(w, None, torch.bfloat16, kernels="stock")
    assert torch.equal(stock.int4_weight().codes(), w.codes())


# -- whole models ------------------------------------------------------------------------------------


def engine_for(model) -> Engine:
    return Engine(EngineConfig(model="tiny", dtype="float32", max_len=96, progress=False), model, None, {1})


@pytest.fixture(scope="module")
def int4_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels") / "m"
    make_tiny(folder, arch="qwen2", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=3, scale=3.0)
    return {(dtype, kern): build_model(open_source(folder), dtype, "int4", progress=False, kernels=kern)
            for dtype in (torch.float32, torch.bfloat16) for kern in ("auto", "stock")}


PROMPTS = [[3, 5, 7, 9], [10, 20, 30, 40, 50, 60], [2]]


def test_int4_model_greedy_tokens_match_stock(int4_models):
    # fp32 model: the fast kernels keep fp32 outputs, the stock ones round to bf16; same tokens.
    models = {kern: int4_models[(torch.float32, kern)] for kern in ("auto", "stock")}
    kinds = {(type(m).__name__, m.fast, m.q8) for m in models["auto"].modules() if hasattr(m, "fast")}
    assert kinds == {("Int4Linear", FAST or Q8, AUTO_Q8)}
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    out = {kern: [r.token_ids for r in engine_for(m).generate(PROMPTS, params)] for kern, m in models.items()}
    assert len({tuple(t) for t in out["stock"]}) > 1
    if not AUTO_Q8:
        assert out["auto"] == out["stock"]
        return
    # 8-bit activations move the logits (more than bf16 rounding does; this tiny model's large random
    # weights amplify it): teacher-forced on stock's text, close, and the same argmax where it is clear.
    for prompt, tokens in zip(PROMPTS, out["stock"], strict=True):
        seq = torch.tensor([prompt + tokens])
        pos = torch.arange(seq.shape[1])[None]
        with torch.inference_mode():
            a, b = (m(seq, pos, m.new_cache(1, 64))[0] for m in (models["stock"], models["auto"]))
        assert 0 < (a - b).norm() <= 0.2 * a.norm()
        top = a.topk(2, -1).values
        clear = (top[:, 0] - top[:, 1]) > 0.1 * a.abs().max()
        assert clear.sum() >= 5 and torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


@fast_only
def test_bf16_int4_model_agrees_with_stock_wherever_bf16_can_tell(int4_models):
    # In bf16 the two differ by rounding (the fast kernels round once, bias included), so a
    # near-tie may flip: teacher-force stock's greedy text through both and compare the argmax
    # wherever stock's top-two margin is more than a few bf16 ulps of the logits.
    stock, fast = int4_models[(torch.bfloat16, "stock")], int4_models[(torch.bfloat16, "auto")]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    decided = 0
    for prompt, res in zip(PROMPTS, engine_for(stock).generate(PROMPTS, params), strict=True):
        seq = torch.tensor([prompt + res.token_ids])
        pos = torch.arange(seq.shape[1])[None]
        with torch.inference_mode():
            a, b = (m(seq, pos, m.new_cache(1, 64))[0] for m in (stock, fast))
        top = a.topk(2, -1).values
        clear = (top[:, 0] - top[:, 1]) > 2.0 ** -6 * a.abs().max()
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
        decided += int(clear.sum())
    assert decided >= 40  # of 3 x ~25 positions


@pytest.fixture(scope="module")
def bf16_dense_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels") / "dense"
    make_tiny(folder, arch="qwen2", vocab=96, layers=4, dim=64, heads=4, kv_heads=2, seed=5, scale=3.0)
    return build_model(open_source(folder), torch.bfloat16, "dense", progress=False)


@fast_only
def test_bf16_speculative_decoding_matches_plain_decoding(bf16_dense_model):
    # The point of one kernel for every M: verifying k + 1 tokens scores each exactly as decoding
    # it alone does, so greedy speculation reproduces plain bf16 decoding token for token.
    model = bf16_dense_model
    lins = [m for m in model.modules() if isinstance(m, DenseLinear)]
    assert lins and all(m.fast for m in lins) and model.lm_head in lins
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", max_len=96, progress=False), model, None, {1})
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(PROMPTS, params)]
    assert len({tuple(t) for t in plain}) > 1
    for k in (3, 12):  # 12: blocks of 13 rows, past one pass of 8
        spec = SpecConfig(k_policy="fixed", method="layerskip", k=k, layers=2)
        assert [r.token_ids for r in engine.generate(PROMPTS, params, spec=spec)] == plain, k


@q8_only
def test_q8_speculative_decoding_matches_plain_decoding(tmp_path):
    # 8-bit activations are quantized per row, so they keep every row independent of the rows beside
    # it: plain decoding and greedy speculation share them and agree token for token.
    make_tiny(tmp_path, arch="qwen2", vocab=96, layers=4, dim=64, heads=4, kv_heads=2, seed=5, scale=3.0)
    auto, q8, stock = (build_model(open_source(tmp_path), torch.bfloat16, "int4", progress=False, kernels=kern)
                       for kern in ("auto", "q8", "stock"))
    lins = [m for m in q8.modules() if isinstance(m, Int4Linear)]
    assert lins and all(m.fast and m.q8 for m in lins)
    assert all(m.q8 == AUTO_Q8 for m in auto.modules() if isinstance(m, Int4Linear))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", max_len=96, progress=False), q8, None, {1})
    plain = [r.token_ids for r in engine.generate(PROMPTS, params)]
    assert len({tuple(t) for t in plain}) > 1
    for k in (3, 12):  # 12: blocks of 13 rows, past one pass of 8
        spec = SpecConfig(k_policy="fixed", method="layerskip", k=k, layers=2)
        assert [r.token_ids for r in engine.generate(PROMPTS, params, spec=spec)] == plain, k
    # The quantization moves the logits (this tiny model's large random weights amplify it; the real
    # model's agreement is checked in test_real_models): teacher-forced on the same text.
    seq = torch.tensor([PROMPTS[1] + plain[1]])
    pos = torch.arange(seq.shape[1])[None]
    with torch.inference_mode():
        a, b = (m(seq, pos, m.new_cache(1, 64))[0].float() for m in (stock, q8))
    assert 0 < (a - b).norm() <= 0.2 * a.norm()


def test_q8_where_the_cpu_cannot_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels, "q8_available", lambda: False)
    with pytest.raises(VerispecError, match="q8 needs .*AVX-512 VNNI"):
        make_linear(torch.randn(64, 64), None, "int4", torch.bfloat16, kernels="q8")


# Prompts longer than SMALL_M, so that their prefill runs the Python path (and its projections see
# [1, m, K] inputs); with PREFILL_M lowered below their length, the large-M path.
LONG_PROMPTS = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 47, 61)]


@fast_only
@pytest.mark.parametrize("kind", ["int4", "dense"])
def test_large_m_prefill_keeps_bf16_speculation_equal_to_plain(kind, int4_models, bf16_dense_model, monkeypatch):
    # Plain and speculative decoding share the prefill (whatever path it takes); every step after
    # it keeps the row-independent kernels, so greedy speculation still reproduces plain decoding.
    monkeypatch.setattr(linear, "PREFILL_M", 36)
    calls = count_expansions(monkeypatch)
    model = int4_models[(torch.bfloat16, "auto")] if kind == "int4" else bf16_dense_model
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", max_len=128, progress=False), model, None, {1})
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(LONG_PROMPTS, params)]
    assert len({tuple(t) for t in plain}) > 1
    per_prefill = len(model.layers) * 4  # q/k/v, o, gate/up, down (lm_head: the last position only)
    assert len(calls) == per_prefill * len(LONG_PROMPTS)  # the prefills, and nothing after them
    for k in (3, 12):
        spec = SpecConfig(k_policy="fixed", method="layerskip", k=k, layers=1)
        assert [r.token_ids for r in engine.generate(LONG_PROMPTS, params, spec=spec)] == plain, k


@fast_only
def test_widest_verification_keeps_the_kernels_at_the_lowest_large_m_threshold(int4_models, monkeypatch):
    # Where oneDNN runs on AMX the large-M path starts at VERIFY_M_MAX + 1 tokens per row: a prompt of
    # that many takes it, while a step scoring K_MAX drafts (VERIFY_M_MAX tokens) keeps the kernels,
    # so greedy speculation at the widest k still reproduces plain decoding.
    assert K_MAX + 1 == linear.VERIFY_M_MAX < linear.PREFILL_M
    monkeypatch.setattr(linear, "PREFILL_M", linear.VERIFY_M_MAX + 1)
    calls = count_expansions(monkeypatch)
    model = int4_models[(torch.bfloat16, "auto")]
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", max_len=320, progress=False), model, None, {1})
    prompts = [torch.randint(2, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (67, 90)]
    params = SamplingParams(max_tokens=140, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    per_prefill = len(model.layers) * 4
    assert len(calls) == per_prefill * len(prompts)
    calls.clear()
    spec = SpecConfig(k_policy="fixed", method="layerskip", k=K_MAX, layers=1)
    results = engine.generate(prompts, params, spec=spec)
    assert [r.token_ids for r in results] == plain
    assert all(max(r.metrics.k_chosen) == K_MAX for r in results)  # some steps scored K_MAX + 1 tokens
    assert len(calls) == per_prefill * len(prompts)  # the prefills, and no verification


@fast_only
def test_large_m_prefill_moves_logits_no_more_than_the_stock_kernel_does(int4_models, monkeypatch):
    # The two paths round differently (oneDNN multiplies bf16-rounded weights; the kernel applies
    # scales and zeros in fp32), and this model's scaled-up weights make bf16 chaotic (its bf16 logits
    # are 40-60% of the largest off its fp32 ones), so bit equality is out of reach and small flips of
    # near-ties happen. The measure: teacher-forced logits of long forwards move from the kernels' by
    # no more than twice what PyTorch's stock int4 kernel moves them (measured: 0.6-1.3x), and the
    # argmax agrees at 90% of positions or more.
    model, stock = int4_models[(torch.bfloat16, "auto")], int4_models[(torch.bfloat16, "stock")]
    calls = count_expansions(monkeypatch)
    agree = total = 0
    for prompt in LONG_PROMPTS:
        seq = torch.tensor([prompt])
        pos = torch.arange(seq.shape[1])[None]
        out = {}
        for name, mod, threshold in (("kernels", model, 10**9), ("large", model, 36), ("stock", stock, 36)):
            monkeypatch.setattr(linear, "PREFILL_M", threshold)
            with torch.inference_mode():
                out[name] = mod(seq, pos, mod.new_cache(1, 64))[0]
            assert bool(calls) == (name == "large"), name  # only that forward took the large-M path
            calls.clear()
        a, b = out["kernels"], out["large"]
        assert (a - b).abs().max() <= 2 * (a - out["stock"]).abs().max()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert agree >= 0.9 * total


def test_fp32_prefill_keeps_its_path_and_greedy_tokens(int4_models, monkeypatch):
    # fp32 models never take the large-M path (their exactness tests rely on it), however long the
    # prompt; the prefill's fused norms / silu * up (fused_ops) give the same tokens as the Python ops.
    monkeypatch.setattr(linear, "PREFILL_M", 36)
    calls = count_expansions(monkeypatch)
    model = int4_models[(torch.float32, "auto")]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    fused = model.fused_ops
    try:
        out = {}
        for ops in {fused, False}:
            model.fused_ops = ops
            out[ops] = [r.token_ids for r in engine_for(model).generate(LONG_PROMPTS, params)]
    finally:
        model.fused_ops = fused
    assert not calls
    assert len({tuple(t) for t in out[False]}) > 1
    assert out[fused] == out[False]


def test_gguf_int4_cache_follows_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    built = {kern: build_model(open_source(path), torch.float32, "int4", progress=False, kernels=kern)
             for kern in ("auto", "stock")}
    folders = sorted(p.parent.name.split("-int4-float32-")[1]
                     for p in (tmp_path / "home" / "converted").glob("tiny-*-int4-float32-*/model.safetensors"))
    cpu_tag = torch.backends.cpu.get_cpu_capability()
    assert folders == (sorted([cpu_tag + "-v2", "vs16-v2"]) if FAST or Q8 else [cpu_tag + "-v2"])
    again = build_model(open_source(path), torch.float32, "int4", progress=False)  # from the cache, no repacking
    for kern, model in built.items():
        names = dict(model.named_modules())
        for name, mod in dict(again.named_modules()).items():
            if hasattr(mod, "dequantized"):
                assert torch.equal(mod.dequantized(), names[name].dequantized()), (kern, name)
    tokens, pos = torch.tensor([[5, 9, 2, 33, 7]]), torch.arange(5)[None]
    with torch.inference_mode():
        a, b, c = (m(tokens, pos, m.new_cache(1, 8)) for m in (built["stock"], again, built["auto"]))
    assert torch.equal(b, c)
    assert (a - b).abs().max() <= (0.05 if AUTO_Q8 else 0.02) * a.abs().max()  # 8-bit activations move more


# -- the loader's fallbacks ----------------------------------------------------------------------------


def test_environment_forces_the_stock_kernels(monkeypatch):
    monkeypatch.setenv("VERISPEC_KERNELS", "stock")
    assert kernels._load(False) == (None, "VERISPEC_KERNELS=stock")


def test_a_failed_build_falls_back_without_raising(tmp_path, monkeypatch):
    bad = tmp_path / "wo_gemm.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "_SOURCES", (bad, *kernels._SOURCES[1:]))
    monkeypatch.setattr(kernels, "_HOME", tmp_path / "home")
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: None)  # get as far as the compiler on any CPU
    ext, why = kernels._load(False)
    assert ext is None and why.startswith("build failed")


@fast_only
@pytest.mark.parametrize("fmt", ["int4", "int8", "dense"])
def test_the_kernels_compile(fmt):
    # torch.compile sees them as operators (fake implementations give shapes), not graph breaks.
    torch.manual_seed(2)
    lin = make_linear(torch.randn(64, 96), torch.randn(64), fmt, torch.bfloat16)
    assert lin.fast
    x = torch.randn(3, 96).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True)
    assert torch.equal(compiled(x), lin(x))


@fast_only
def test_a_model_shares_one_weight_scratch(int4_models, monkeypatch):
    # The large-M path expands weights into one buffer per model (reused, so no page faults per call),
    # bounded by the largest expanded weight, not one per layer.
    model = int4_models[(torch.bfloat16, "auto")]
    fast = [m for m in model.modules() if getattr(m, "fast", False)]
    scratches = {id(m.scratch) for m in fast}
    assert fast and len(scratches) == 1 and None not in {m.scratch for m in fast}
    monkeypatch.setattr(linear, "PREFILL_M", 36)
    engine_for(model).generate(LONG_PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    buf = fast[0].scratch._buf
    assert buf is not None and buf.numel() == max(m.out_features * m.in_features for m in fast)
