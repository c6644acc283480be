"""What the machine is and can do: its description, memory read bandwidth and the decode roofline it implies."""

from __future__ import annotations

import platform
import time
from datetime import date
from typing import Any

import torch
from torch import nn


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import transformers

    from verispec.config import cpu_has_fast_bf16

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": date.today().isoformat(), "cpu": cpu, "threads": torch.get_num_threads(),
            "bf16_native": cpu_has_fast_bf16(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Measured memory read bandwidth in bytes/s (best of ``reps`` full reads of a ``gib`` GiB tensor).

    The tensor is far larger than any cache, so each pass streams from DRAM, as a decode
    step does with its weights.
    """
    x = torch.ones(int(gib * (1 << 30)) // 2, dtype=torch.bfloat16)
    x.sum()  # fault the pages in before timing
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer except the embedding table
    (a lookup touches one row) and the rotary tables."""
    skip = {id(t) for name, t in model.named_buffers() if "rope" in name}
    embed = getattr(model, "embed", None)
    if embed is not None:
        skip.add(id(embed.weight))
    total = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in skip or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.nbytes
    return total
