"""Linear layers with a pluggable weight format.

Decoding is memory-bound: the bytes of weight read per token set the speed, so the storage
format of the projections is a first-class choice. ``dense`` keeps the compute dtype
(fp32/bf16); ``int8`` stores int8 weights with one scale per output channel and runs
PyTorch's own weight-only kernel, which reads half the bytes of bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import VerispecError

WEIGHT_FORMATS = ("dense", "int8")


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8, symmetric, per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.to(dtype).float()  # quantize what the dense path would hold, cache or not
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight, self.scale)
        y = y.reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype) -> nn.Module:
    """A linear layer computing ``x @ weight.T + bias`` with weights stored as ``fmt``."""
    if fmt == "dense":
        return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype))
    if fmt == "int8":
        return Int8Linear(weight, bias, dtype)
    raise VerispecError(f"unknown weight format '{fmt}' (choose from {', '.join(WEIGHT_FORMATS)})")
