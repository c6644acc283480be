"""Linear layers with a pluggable weight format.

Decoding is memory-bound: the bytes of weight read per token set the speed, so the storage
format of the projections is a first-class choice. ``dense`` keeps the compute dtype
(fp32/bf16); ``int8`` stores int8 weights with one scale per output channel and runs
PyTorch's own weight-only kernel, which reads half the bytes of bf16; ``int4`` stores 4-bit
codes in groups of 32 input channels with a bf16 scale and zero point per group and runs
PyTorch's tinygemm-style kernel (``_weight_int4pack_mm_for_cpu``; ``_weight_int4pack_mm`` on
CUDA), a quarter of the bytes of bf16 plus 1/8 byte per weight of scales. See docs/quantization.md.

On CPUs with AVX-512 BF16 both quantized layers, and dense bf16 ones, run verispec's own
kernels instead (:mod:`verispec.kernels`: weights repacked at load into the kernel's layout, cost
nearly flat over M = 1..8 rows); ``kernels="stock"`` keeps PyTorch's. A prefill (bf16 activations,
at least :data:`PREFILL_M` tokens per row) is compute-bound instead: those layers then expand the
weight to a temporary bf16 [N, K] and call ``F.linear`` (oneDNN's GEMM), see :func:`large_m`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels as fast_kernels
from verispec.errors import VerispecError
from verispec.log import logger

# "int4-all": int4 for every projection, even GGUF tensors stored with more bits (a draft model's:
# its logits only rank candidates the target verifies, and its step time is the bytes it reads).
WEIGHT_FORMATS = ("dense", "int8", "int4", "int4-all")
# What a user may ask for: a format, or "auto" (the source's own precision, see loader.resolve_weights).
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)
INT4_GROUP = 32

# The most tokens a verification scores per row (k <= 64 drafts plus the row's last token). Every forward
# of at most this many tokens per row keeps the kernels, so verification stays bit-identical to plain decoding.
VERIFY_M_MAX = 65


def onednn_amx() -> bool:
    """Whether oneDNN's bf16 GEMMs run on AMX tiles here: the CPU has them and the OS grants their state."""
    init = getattr(torch.cpu, "_init_amx", None)
    try:
        return bool(init is not None and init())
    except Exception:  # noqa: BLE001 (a private torch call: any failure means no AMX, never a failed import)
        return False


# Tokens per row from which the fast layers (int4, int8 and dense bf16 with verispec's kernels) run
# a bf16 product as dequantize-to-bf16 + F.linear (oneDNN) instead of their own kernel. Measured on
# the 2-core Zen 5 (bench/kernel_bench.py --large-m; prefill of the int4 Qwen2.5-Coder-1.5B with the
# threshold toggled): per layer the kernels win below ~192 tokens and tie at ~192-256 (int4 q/k/v, o,
# int8 down) or ~256 (int4 gate/up, 55 MB to expand); above, the oneDNN path wins by 10-25% at 512-900.
# For the whole prefill the kernels are 3% faster at 224 tokens, even at 256, and 3/10/11/23% slower at
# 300/384/512/900. Expanding writes 2 bytes per weight (55 MB for gate/up), which only many rows amortize.
# Where oneDNN runs bf16 GEMMs on AMX tiles the crossover is far lower (2-core Intel Xeon with AMX:
# dequantize + oneDNN is 2x the kernels per layer at 32 rows, 7x at 256; a 100-token prefill of the
# int4 1.5B takes 0.41 s instead of 1.47 s), so there the path starts just above VERIFY_M_MAX.
AMX = onednn_amx()
PREFILL_M = VERIFY_M_MAX + 1 if AMX else 256
# Weights larger than this many elements (a big vocabulary's lm_head asked for every position's
# logits) are expanded and multiplied in row chunks, so the scratch buffer stays bounded.
LARGE_M_CHUNK = 32 * 2**20


class WeightScratch:
    """One reused bf16 buffer for the large-M path's expanded weights, shared by a model's layers.

    A fresh tensor of tens of MiB pays its page faults on every call, about as much as writing it,
    so a model keeps one (grown as needed, never shrunk; at most :data:`LARGE_M_CHUNK` elements).
    A model's forwards run one at a time, so its layers can share it; a layer without one (built
    outside :meth:`Transformer.from_state_dict`) allocates per call.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def weight(self, n: int, k: int) -> torch.Tensor:
        """A bf16 [n, k] view of the buffer."""
        if self._buf is None or self._buf.numel() < n * k:
            self._buf = None  # free the old one before allocating the new one
            self._buf = torch.empty(n * k, dtype=torch.bfloat16)
        return self._buf[: n * k].view(n, k)


def large_m(x: torch.Tensor, q8: bool = False) -> bool:
    """Whether a fast layer takes ``x`` through the large-M path (dequantize + ``F.linear``).

    Only bf16 activations on a CPU, outside torch.compile (compiled graphs keep the kernels), and
    only ``x`` of at least 3 dims ``[..., m, K]`` with ``m >= PREFILL_M``: the decision is on the
    tokens per row, never on all rows together. A row's result must not depend on what it is batched
    with: a decode step of many rows x 1 token (and verification, k + 1 tokens per row) keeps the
    row-independent kernels whatever the batch size, so speculative verification stays bit-identical
    to plain decoding, and a prompt's prefill takes the same path alone or beside others. 2-D inputs
    (the fused decode path passes [B*m, K]) always keep the kernels. fp32 activations keep them too
    (their exactness matters more than prefill speed there). A layer on 8-bit activations (``q8``)
    keeps them at any m where oneDNN has no AMX: there its VNNI products beat dequantize + bf16 GEMM
    on a whole prefill (int4 1.5B on a 2-core Zen 4: 4.6 against 7.5 ms per token at 256 tokens,
    5.2 against 7.6 at 800, 6.7 against 7.6 at 1500).
    """
    return (x.dtype == torch.bfloat16 and (not q8 or AMX) and x.dim() >= 3 and x.shape[-2] >= PREFILL_M
            and x.device.type == "cpu" and not torch.compiler.is_compiling() and fast_kernels.available())


def small_m_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for the fused decode / verification path (``x`` 2-D ``[R, K]``, contiguous, in the
    model's dtype): the layer's ``small_m`` where it has one. That goes straight to the kernel,
    skipping ``nn.Module.__call__`` and :meth:`forward`'s shape, dtype and path checks: ~8 us of
    Python per projection here, about a tenth of a 0.5B model's decode step. Same result, bit for bit.
    """
    lean = getattr(type(layer), "small_m", None)
    return lean(layer, x) if lean is not None else layer(x)


def large_m_linear(x: torch.Tensor, n: int, k: int, expand: Callable[[int, int, torch.Tensor], torch.Tensor],
                   bias: torch.Tensor | None, scratch: WeightScratch | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with the bf16 weight rows ``[r0, r1)`` written by ``expand(r0, r1, out)``
    into ``scratch`` (or a fresh tensor), all at once or (past :data:`LARGE_M_CHUNK` elements) in chunks of rows."""
    if bias is not None:
        bias = bias.to(x.dtype)
    step = n if n * k <= LARGE_M_CHUNK else max(16, LARGE_M_CHUNK // k // 16 * 16)
    outs = []
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out = scratch.weight(r1 - r0, k) if scratch is not None else torch.empty(r1 - r0, k, dtype=torch.bfloat16)
        w = expand(r0, r1, out)
        outs.append(F.linear(x, w, None if bias is None else bias[r0:r1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class DenseLinear(nn.Module):
    """``x @ weight.T + bias`` in the weight's dtype.

    A bf16 weight on a CPU with the fast kernels (``kernels="auto"``) is held only in
    :mod:`verispec.kernels`' layout (buffer ``packed``, [ceil(N/16), K/2, 16, 2]) and every
    product below :data:`PREFILL_M` tokens per row runs :func:`~verispec.kernels.bf16_mm`, as
    :class:`Int8Linear` does with its kernel: PyTorch's matmul would need the [N, K] weight, and
    unpacking it per call costs several times a small-M matmul, while keeping both copies would
    double the model's memory. One kernel for every such M also keeps each row's result
    independent of what it is batched with (speculative verification = plain decoding, bit for
    bit). A prefill (:func:`large_m`) amortizes the unpacking and runs ``F.linear`` instead.
    ``weight`` unpacks on access (a copy, for tensor-parallel slicing and inspection; not for hot
    paths).
    fp32 (and other) weights stay an ``nn.Parameter`` and ``F.linear``, as before.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: str = "auto") -> None:
        super().__init__()
        self.scratch: WeightScratch | None = None  # the model's, set by Transformer.from_state_dict
        self.out_features, self.in_features = weight.shape
        self.fast = (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and self.in_features % 2 == 0
                     and fast_kernels.use_fast(kernels))
        if self.fast:
            self.register_buffer("packed", fast_kernels.bf16_pack(weight))
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        if self.fast:
            return fast_kernels.bf16_unpack(self.packed, self.out_features, self.in_features)
        w = self._parameters.get("weight")
        if w is None:  # nn.Module's hasattr check while the parameter is being registered
            raise AttributeError("weight")
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast and large_m(x):
            return large_m_linear(x, self.out_features, self.in_features, self._expand, self.bias, self.scratch)
        if self.fast and x.dtype == torch.bfloat16:
            shape = x.shape
            y = fast_kernels.bf16_mm(x.reshape(-1, shape[-1]), self.packed, self.out_features, self.bias)
            return y.reshape(*shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)

    def small_m(self, x: torch.Tensor) -> torch.Tensor:
        """What :meth:`forward` returns for the fused decode path's ``x`` (2-D ``[R, K]``, contiguous,
        bf16 or fp32), with the least Python in between (see :func:`small_m_call`)."""
        if self.fast and x.dtype == torch.bfloat16:
            return fast_kernels.ext().bf16_mm(x, self.packed, self.out_features, self.bias, False)
        return self.forward(x)

    def _expand(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Weight rows [r0, r1) (r0 a multiple of 16) unpacked into ``out`` (the large-M path)."""
        return fast_kernels.bf16_unpack(self.packed[r0 // 16: -(-r1 // 16)], r1 - r0, self.in_features, out)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # The packed layout is CPU- and bf16-only: anything else gets the plain weight back first.
        moved = fn(torch.empty(0, dtype=torch.bfloat16)) if self.fast else None
        if moved is not None and (moved.device.type != "cpu" or moved.dtype != torch.bfloat16):
            w = self.weight
            del self._buffers["packed"]
            self.fast = False
            self.weight = nn.Parameter(w, requires_grad=False)
        return super()._apply(fn, recurse)


@dataclass
class Int8Weight:
    """Symmetric int8 per output channel: ``w = qweight * scale[:, None]``. Rows concatenate freely.

    ``layout`` is ``"rows"`` (qweight int8 [N, K], PyTorch's kernel) or ``"vs16"`` (the layout of
    :mod:`verispec.kernels`: [ceil(N/16), K/2, 16, 2], rows padded with zeros to a multiple of 16).
    """

    qweight: torch.Tensor  # int8 [N, K] ("rows") or [ceil(N/16), K/2, 16, 2] ("vs16")
    scale: torch.Tensor  # [N], compute dtype
    layout: str = "rows"

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "vs16":
            return self.scale.shape[0], self.qweight.shape[1] * 2
        return tuple(self.qweight.shape)

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
        w = weight.to(dtype).float()  # quantize what the dense path would hold, cache or not
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        return cls(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(dtype))

    def rows(self) -> torch.Tensor:
        """The int8 codes [N, K] whatever the layout."""
        if self.layout == "rows":
            return self.qweight
        n, k = self.shape
        return self.qweight.permute(0, 2, 1, 3).reshape(-1, k)[:n].contiguous()

    def to_layout(self, layout: str) -> Int8Weight:
        if layout == self.layout:
            return self
        if layout == "rows":
            return Int8Weight(self.rows(), self.scale)
        if layout != "vs16":
            raise VerispecError(f"unknown int8 layout '{layout}'")
        n, k = self.shape
        if fast_kernels.layouts_available():
            return Int8Weight(fast_kernels.int8_pack(self.qweight), self.scale, "vs16")
        padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.int8)
        padded[:n] = self.qweight
        return Int8Weight(padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous(), self.scale, "vs16")

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        scale = torch.cat([p.scale for p in parts])
        layout = parts[0].layout
        if layout == "vs16" and all(p.layout == "vs16" for p in parts) and all(
                p.shape[0] % 16 == 0 for p in parts[:-1]):
            return Int8Weight(torch.cat([p.qweight for p in parts]), scale, "vs16")  # whole blocks follow
        return Int8Weight(torch.cat([p.rows() for p in parts]), scale).to_layout(layout)

    def dequantize(self) -> torch.Tensor:
        return self.rows().float() * self.scale.float()[:, None]


class Int8Linear(nn.Module):
    """Weight-only int8, symmetric, per output channel.

    With the fast kernels (``kernels="auto"`` on a CPU that runs them) ``qweight`` holds the
    kernel's layout (``vs16``, see :class:`Int8Weight`), else PyTorch's [N, K].
    """

    def __init__(self, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: str = "auto") -> None:
        super().__init__()
        self.scratch: WeightScratch | None = None  # the model's, set by Transformer.from_state_dict
        q = weight if isinstance(weight, Int8Weight) else Int8Weight.quantize(weight, dtype)
        self.out_features, self.in_features = q.shape
        fast, q8 = fast_kernels.quantized_path(kernels)
        # 8-bit activations (see verispec.kernels.int8_mm) need K in whole groups of 32; where they are
        # the only kernels this CPU runs, other K keep PyTorch's.
        q8 = q8 and self.in_features % 32 == 0
        self.fast = (fast and (q8 or fast_kernels.available()) and q.qweight.device.type == "cpu"
                     and self.in_features % 2 == 0 and dtype in (torch.float32, torch.bfloat16))
        self.q8 = self.fast and q8
        q = q.to_layout("vs16" if self.fast else "rows")
        self.register_buffer("qweight", q.qweight)
        self.register_buffer("scale", q.scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast and large_m(x, self.q8):
            return large_m_linear(x, self.out_features, self.in_features, self._expand, self.bias, self.scratch)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fast:
            out = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
            y = fast_kernels.int8_mm(x2.to(out), self.qweight, self.scale, self.out_features, self.bias, out, self.q8)
            return y.to(x.dtype).reshape(*shape[:-1], -1)
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scale)
        y = y.reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def small_m(self, x: torch.Tensor) -> torch.Tensor:
        """What :meth:`forward` returns for the fused decode path's ``x`` (2-D ``[R, K]``, contiguous,
        bf16 or fp32), with the least Python in between (see :func:`small_m_call`)."""
        if self.fast and x.dtype == torch.bfloat16:
            return fast_kernels.ext().int8_mm(x, self.qweight, self.scale, self.out_features, 1, self.bias, False,
                                              self.q8)
        return self.forward(x)

    def _expand(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Weight rows [r0, r1) (r0 a multiple of 16) as bf16 ``q * scale`` into ``out`` (the large-M path)."""
        return fast_kernels.int8_dequant(self.qweight[r0 // 16: -(-r1 // 16)], self.scale[r0:r1], r1 - r0,
                                         self.in_features, out)

    def int8_weight(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale, "vs16" if self.fast else "rows")

    def dequantized(self) -> torch.Tensor:
        return self.int8_weight().dequantize()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        if self.fast and fn(torch.empty(0)).device.type != "cpu":  # the kernel's layout is CPU-only
            self.qweight = self.int8_weight().rows()
            self.fast = False
        return super()._apply(fn, recurse)


# -- int4 ---------------------------------------------------------------------------------


@dataclass
class QuantizedTensor:
    """A [N, K] weight as 4-bit codes in groups along K: ``w = scales * codes - mins`` (per group).

    This is the form a GGUF Q4_K tensor decodes to without a float detour (sub-block scale
    ``d * sc`` and min ``dmin * m``); rows are output channels, so fused projections concatenate.
    """

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scales: torch.Tensor  # fp32 [N, K // group_size]
    mins: torch.Tensor  # fp32 [N, K // group_size]
    group_size: int = INT4_GROUP

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        q = self.codes.float().view(self.shape[0], -1, g)
        return (self.scales[..., None] * q - self.mins[..., None]).view(self.shape)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        return QuantizedTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.mins for p in parts]), parts[0].group_size)

    def permute_rows(self, index: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.codes[index], self.scales[index], self.mins[index], self.group_size)


def int4_supported(n: int, k: int, group_size: int = INT4_GROUP) -> bool:
    """Whether PyTorch's int4 kernels take an [n, k] weight in groups of ``group_size``."""
    return group_size in (32, 64, 128, 256) and k % group_size == 0 and n % 16 == 0 and k % 2 == 0


def _cpu_block_n() -> int:
    # weight_to_int4pack_kernel packs rows in blocks of 4 float vectors: 64 on AVX512, else 32.
    return 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32


@cache
def _cpu_block_layout(nb: int) -> torch.Tensor:
    """Row index held by each nibble of one k-slice of a packed block of ``nb`` rows.

    Found by packing probes of row indices (4 bits at a time), so it follows whatever the
    installed PyTorch does; returns [nb] = rows for (byte 0 lo, ..., byte nb/2-1 lo, byte 0 hi, ...).
    """
    rows = torch.arange(nb, dtype=torch.int32)
    digits = []
    for shift in (0, 4):
        probe = ((rows >> shift) & 15)[:, None].expand(nb, 2).contiguous()
        packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1).reshape(-1)[: nb // 2].to(torch.int32)
        digits.append(torch.cat([packed & 15, packed >> 4]) << shift)
    return (digits[0] | digits[1]).long()


def _unpack_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes [n, k] (uint8) back from ``_convert_weight_to_int4pack_for_cpu``'s layout."""
    bn = _cpu_block_n()
    flat = packed.reshape(-1)
    out = torch.empty(n, k, dtype=torch.uint8)
    start = 0
    while start < n:
        nb = bn if n - start >= bn else n - start
        count = (n - start) // bn if nb == bn else 1  # all full blocks at once, then the tail
        chunk = flat[start * k // 2: (start + count * nb) * k // 2].view(count, k, nb // 2)
        vals = torch.cat([chunk & 15, chunk >> 4], dim=-1)  # [count, k, nb] in nibble order
        block = torch.empty(count, nb, k, dtype=torch.uint8)
        block[:, _cpu_block_layout(nb)] = vals.transpose(1, 2)
        out[start: start + count * nb] = block.reshape(count * nb, k)
        start += count * nb
    return out


def _vs16_pack_reference(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] into :mod:`verispec.kernels`' int4 layout, in plain torch (the C++ packer is faster).

    Per 16 rows and 8 columns, 64 bytes = 32 little-endian words: word j holds row j // 2 and in its
    nibble t the code of column 8c + 2t + j % 2.
    """
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n // 16, 16, k // 8, 4, 2).permute(0, 2, 1, 4, 3)  # [nb, c, row, s, t]
    lo = c[..., 0] | (c[..., 1] << 4)
    hi = c[..., 2] | (c[..., 3] << 4)
    return torch.stack([lo, hi], dim=-1).reshape(n // 16, k * 8).contiguous()


def _vs16_unpack_reference(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    b = packed.reshape(n // 16, k // 8, 16, 2, 2)  # [nb, c, row, s, byte]
    t = torch.stack([b[..., 0] & 15, b[..., 0] >> 4, b[..., 1] & 15, b[..., 1] >> 4], dim=-1)  # [.., s, t]
    return t.permute(0, 2, 1, 4, 3).reshape(n, k).contiguous()


@dataclass
class Int4Weight:
    """An int4 weight ready for a kernel: packed codes plus scales and zeros (bf16).

    PyTorch's convention (tinygemm, as in gpt-fast/torchao): ``w = (q - 8) * scale + zero`` for
    codes q in 0..15. ``layout`` says how the bytes are arranged:

    - ``"cpu"``: PyTorch's CPU kernel layout (``_convert_weight_to_int4pack_for_cpu``, which depends
      on the CPU's vector width, see :func:`_cpu_block_n`); ``packed`` uint8 [N, K/2] and
      ``scales_and_zeros`` [K/G, N, 2].
    - ``"vs16"``: :mod:`verispec.kernels`' layout (CPU-independent, group size 32 only): ``packed``
      uint8 [N/16, 8K] (see :func:`_vs16_pack_reference`) and ``scales_and_zeros`` [N/16, K/G, 16, 2].
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int = INT4_GROUP
    layout: str = "cpu"

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "vs16":
            return self.scales_and_zeros.shape[0] * 16, self.scales_and_zeros.shape[1] * self.group_size
        return self.scales_and_zeros.shape[1], self.packed.shape[1] * 2

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int = INT4_GROUP) -> Int4Weight:
        """From codes [N, K] and per-group (bf16-rounded) scales/zeros [N, K // group_size]."""
        n, k = codes.shape
        if not int4_supported(n, k, group_size):
            raise VerispecError(f"int4 needs rows % 16 == 0 and columns % {group_size} == 0, got [{n}, {k}]")
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        return cls(packed, sz, group_size)

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor) -> Int4Weight:
        """``scale * q - min`` is ``(q - 8) * scale + zero`` with ``zero = 8 * scale - min``.

        Both are then held in bf16 (the kernel's dtype): ~3 significant digits, so a weight moves
        by at most about ``(8 * |scale| + |zero|) / 256``, a few percent of one quantization step.
        """
        return cls.from_codes(qt.codes, qt.scales, 8 * qt.scales - qt.mins, qt.group_size)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = INT4_GROUP) -> Int4Weight:
        """Asymmetric min/max quantization per group (as torchao's groupwise affine int4)."""
        w = weight.float()
        n, k = w.shape
        if not int4_supported(n, k, group_size):
            raise VerispecError(f"int4 needs rows % 16 == 0 and columns % {group_size} == 0, got [{n}, {k}]")
        g = w.view(n, k // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        # Round the scale/zero to bf16 first, then pick codes against the values the kernel will use.
        scale = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q = torch.round((g - (zero - 8 * scale)[..., None]) / scale[..., None]).clamp(0, 15)
        return cls.from_codes(q.to(torch.uint8).view(n, k), scale, zero, group_size)

    def codes(self) -> torch.Tensor:
        n, k = self.shape
        if self.layout == "vs16":
            if fast_kernels.layouts_available():
                return fast_kernels.int4_unpack(self.packed, n, k)
            return _vs16_unpack_reference(self.packed, n, k)
        return _unpack_cpu(self.packed, n, k)

    def stock_scales_and_zeros(self) -> torch.Tensor:
        """Scales and zeros as PyTorch's kernels take them: [K/G, N, 2]."""
        if self.layout == "vs16":
            nb, g = self.scales_and_zeros.shape[:2]
            return self.scales_and_zeros.permute(1, 0, 2, 3).reshape(g, nb * 16, 2).contiguous()
        return self.scales_and_zeros

    def to_layout(self, layout: str) -> Int4Weight:
        """The same weight in another layout (``"cpu"`` or ``"vs16"``)."""
        if layout == self.layout:
            return self
        n, k = self.shape
        if layout == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
            return Int4Weight(packed, self.stock_scales_and_zeros(), self.group_size)
        if layout != "vs16" or self.group_size != 32:
            raise VerispecError(f"cannot hold an int4 weight (group {self.group_size}) in layout '{layout}'")
        sz = self.scales_and_zeros.view(k // 32, n // 16, 16, 2).permute(1, 0, 2, 3).contiguous()
        bn = _cpu_block_n()
        if not fast_kernels.layouts_available():
            packed = _vs16_pack_reference(self.codes())
        elif n % bn == 0:  # straight from PyTorch's whole blocks (all real models)
            packed = fast_kernels.int4_from_stock(self.packed, n, k, _cpu_block_layout(bn))
        else:
            packed = fast_kernels.int4_pack(self.codes())
        return Int4Weight(packed, sz, self.group_size, "vs16")

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Concatenate along output rows (fused q/k/v and gate/up projections)."""
        g, layout = parts[0].group_size, parts[0].layout
        parts = [p.to_layout(layout) for p in parts]
        if layout == "vs16":  # 16-row blocks, and every part has whole blocks
            return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scales_and_zeros for p in parts]),
                              g, "vs16")
        sz = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        if all(p.shape[0] % _cpu_block_n() == 0 for p in parts[:-1]):
            # Packed blocks never straddle a part: the packed bytes simply follow each other.
            return Int4Weight(torch.cat([p.packed for p in parts]), sz, g)
        codes = torch.cat([p.codes() for p in parts])
        return Int4Weight(torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1), sz, g)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        sz = self.stock_scales_and_zeros().float()  # [K/G, N, 2]
        q = self.codes().float().view(n, k // self.group_size, self.group_size) - 8
        return (q * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).view(n, k)


class Int4Linear(nn.Module):
    """Weight-only int4 in groups along the input dimension, asymmetric (scale and zero point).

    The CPU kernel is vectorised for bf16 only (its fp32 path is scalar and ~10x slower), so
    activations are cast to bf16 around each matmul whatever the model's dtype.

    With the fast kernels (``kernels="auto"`` on a CPU that runs them, group size 32) the
    buffers hold their ``vs16`` layout (see :class:`Int4Weight`) and the output is accumulated
    in fp32 and rounded once to the model's dtype (fp32 models keep an fp32 output), bias included.
    """

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: str = "auto") -> None:
        super().__init__()
        self.scratch: WeightScratch | None = None  # the model's, set by Transformer.from_state_dict
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        fast, q8 = fast_kernels.quantized_path(kernels)
        self.fast = fast and weight.packed.device.type == "cpu" and self.group_size == 32
        self.q8 = self.fast and q8  # 8-bit activations (see verispec.kernels.int4_mm)
        weight = weight.to_layout("vs16" if self.fast else "cpu")
        self.register_buffer("qweight", weight.packed)
        self.register_buffer("scales_and_zeros", weight.scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast and large_m(x, self.q8):
            return large_m_linear(x, self.out_features, self.in_features, self._expand, self.bias, self.scratch)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.fast:
            out = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
            bias = self.bias if self.bias is None or self.bias.dtype in (torch.float32, torch.bfloat16) else None
            y = fast_kernels.int4_mm(x2, self.qweight, self.scales_and_zeros, self.out_features, bias, out, self.q8)
            y = y.to(x.dtype).reshape(*shape[:-1], -1)
            return y if bias is not None or self.bias is None else y + self.bias
        if self.qweight.is_cuda:
            y = torch._weight_int4pack_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def small_m(self, x: torch.Tensor) -> torch.Tensor:
        """What :meth:`forward` returns for the fused decode path's ``x`` (2-D ``[R, K]``, contiguous,
        bf16 or fp32), with the least Python in between (see :func:`small_m_call`)."""
        if self.fast and x.dtype in (torch.bfloat16, torch.float32):
            xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
            return fast_kernels.ext().int4_mm(xb, self.qweight, self.scales_and_zeros, self.out_features, self.bias,
                                              x.dtype == torch.float32, self.q8)
        return self.forward(x)

    def _expand(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Weight rows [r0, r1) (multiples of 16) as bf16 ``(q - 8) * scale + zero`` into ``out`` (the large-M path)."""
        b0, b1 = r0 // 16, r1 // 16
        return fast_kernels.int4_dequant(self.qweight[b0:b1], self.scales_and_zeros[b0:b1], r1 - r0,
                                         self.in_features, out)

    def int4_weight(self) -> Int4Weight:
        """The weight as this layer holds it (layout ``vs16`` with the fast kernels, else ``cpu``)."""
        if self.qweight.is_cuda:
            raise VerispecError("int4 weights packed for CUDA cannot be unpacked")
        return Int4Weight(self.qweight, self.scales_and_zeros, self.group_size, "vs16" if self.fast else "cpu")

    def dequantized(self) -> torch.Tensor:
        return self.int4_weight().dequantize()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # Moving to CUDA: the packed layouts differ, so unpack the codes here and repack there
        # (checked on a GPU by tests/test_gpu.py, docs/gpu.md).
        before = self.qweight.device
        after = fn(torch.empty(0, device=before)).device
        codes = self.int4_weight().codes() if after.type == "cuda" and before.type != "cuda" else None
        if after.type != "cuda" and before.type == "cuda":
            raise VerispecError("int4 weights cannot move from CUDA back to the CPU; reload the model")
        if self.fast and after.type != "cpu":  # the fast layout is CPU-only; CUDA takes PyTorch's scales
            self.scales_and_zeros = self.int4_weight().stock_scales_and_zeros()
            self.fast = False
        super()._apply(fn, recurse)
        if codes is not None:
            k = self.in_features
            tiles = next((t for t in (8, 4, 2) if k % (t * 16) == 0), None)
            if tiles is None:
                raise VerispecError(f"CUDA int4 needs in_features % 32 == 0, got {k}")
            codes = codes.to(after)
            nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
            self.qweight = torch._convert_weight_to_int4pack(nibbles, tiles)
        return self


def matmul_kernels(*models: nn.Module | None) -> str:
    """Which matmuls the projections of ``models`` (None entries skipped) run: ``"verispec"`` when every
    one runs :mod:`verispec.kernels`, ``"stock"`` when none does (PyTorch's), else ``"mixed"``."""
    fast = {bool(m.fast) for model in models if model is not None for m in model.modules()
            if isinstance(m, DenseLinear | Int8Linear | Int4Linear)}
    return "mixed" if len(fast) > 1 else "verispec" if fast == {True} else "stock"


def make_linear(weight: torch.Tensor | QuantizedTensor | Int4Weight | Int8Weight, bias: torch.Tensor | None,
                fmt: str, dtype: torch.dtype, kernels: str = "auto") -> nn.Module:
    """A linear layer computing ``x @ weight.T + bias`` with weights stored as ``fmt``.

    ``weight`` is a float tensor, or already quantized: an :class:`Int4Weight` / :class:`Int8Weight`
    is used as it is, a :class:`QuantizedTensor` (4-bit codes, e.g. from Q4_K) becomes int4
    without a float detour, or is dequantized for the other formats. ``kernels`` picks the int4/int8
    (and dense bf16) matmul: ``"auto"`` (verispec's kernels where the CPU runs them, else PyTorch's)
    or ``"stock"``.
    """
    if kernels not in fast_kernels.KERNEL_CHOICES:
        raise VerispecError(f"unknown kernels '{kernels}' (choose from {', '.join(fast_kernels.KERNEL_CHOICES)})")
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias, dtype, kernels)
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, bias, dtype, kernels)
    if fmt not in WEIGHT_FORMATS:
        raise VerispecError(f"unknown weight format '{fmt}' (choose from {', '.join(WEIGHT_FORMATS)})")
    if fmt == "int4-all":
        fmt = "int4"
    if fmt == "int4" and int4_supported(*weight.shape):
        if isinstance(weight, QuantizedTensor):
            return Int4Linear(Int4Weight.from_quantized(weight), bias, dtype, kernels)
        return Int4Linear(Int4Weight.quantize(weight.to(dtype)), bias, dtype, kernels)
    if fmt == "int4":
        logger.debug("int4 does not fit a [%d, %d] weight; keeping it dense", *weight.shape)
        fmt = "dense"
    if isinstance(weight, QuantizedTensor):
        weight = weight.dequantize()
    if fmt == "dense":
        return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype), kernels)
    return Int8Linear(weight, bias, dtype, kernels)
