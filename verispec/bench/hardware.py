"""What the machine is and can do: its description, memory read bandwidth and the decode roofline it implies."""

from __future__ import annotations

import platform
import time
from datetime import date
from typing import Any

import torch
from torch import nn

# AMD families and model ranges -> core generation (family 25 holds Zen 3 and Zen 4; family 26 is Zen 5).
_AMD_CORES = ((25, range(0x10, 0x20), "Zen 4"), (25, range(0x60, 0x80), "Zen 4"), (25, range(0xA0, 0xB0), "Zen 4"),
              (25, range(0x00, 0x100), "Zen 3"), (26, range(0x00, 0x100), "Zen 5"), (23, range(0x00, 0x100), "Zen 2"))


def cpu_description(cpuinfo: str) -> str:
    """The CPU as figures must name it: model name, family and model (and AMD's core generation), and
    the widest vector extension the kernels can use (and AMX, which oneDNN's GEMMs use), from the text of
    /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    name = fields.get("model name") or platform.processor() or platform.machine()
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return name
    where = f"family {family} model {model}"
    if fields.get("vendor_id") == "AuthenticAMD":
        core = next((c for f, models, c in _AMD_CORES if f == family and model in models), None)
        where += f", {core}" if core else ""
    flags = set(fields.get("flags", "").split())
    isa = ("AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else "no AVX2")
    isa += ", AMX" if "amx_bf16" in flags else ""
    return f"{name} ({where}; {isa})"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import transformers

    from verispec.config import cpu_has_fast_bf16

    try:
        with open("/proc/cpuinfo") as f:
            cpu = cpu_description(f.read())
    except OSError:
        cpu = platform.processor() or platform.machine()
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
