"""Memory figures: resident set size of the process and what a drafter adds on top of the target."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch


def rss_bytes() -> int:
    """The process's current resident set size."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (``getrusage``; Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass(frozen=True)
class DraftFootprint:
    """What a drafter holds beyond the target: a draft model's weights and its own KV cache."""

    model_bytes: int = 0
    cache_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.cache_bytes


def drafter_footprint(engine: Any, drafter: Any | None, draft_model: bool = False) -> DraftFootprint:
    """Bytes of the weights and KV caches a drafter holds beyond ``engine``'s target and cache.

    ``draft_model``: the method drafts with the engine's draft model (``draft``, ``hybrid``), whose
    weights and cache (the engine's draft runner) count as the drafter's.

    Looks at the drafter's attributes and those of drafters it wraps (a hybrid's parts): tensors
    of any ``nn.Module`` count as weights unless the target owns them (a layer-skip drafter reuses
    the target's layers), anything with an ``nbytes()`` method (a KV cache) counts as cache unless
    it is the engine's own. Drafters with no model (n-gram, retrieval) score 0.
    """
    target_ptrs = {t.data_ptr() for t in (*engine.target.parameters(), *engine.target.buffers())}
    tensors: dict[int, torch.Tensor] = {}
    caches: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 2 or not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        for value in vars(obj).values():
            for v in value if isinstance(value, list | tuple) else [value]:
                if isinstance(v, torch.nn.Module):
                    for t in (*v.parameters(), *v.buffers()):
                        if t.data_ptr() not in target_ptrs:
                            tensors[t.data_ptr()] = t
                elif callable(getattr(v, "nbytes", None)) and v is not getattr(engine, "cache", None):
                    caches[id(v)] = v
                elif type(v).__module__.startswith(("verispec.drafters", "verispec.engine.draft_runner")):
                    visit(v, depth + 1)

    visit(drafter, 0)
    if draft_model:
        visit(getattr(engine, "draft_runner", None), 0)
    return DraftFootprint(sum(t.numel() * t.element_size() for t in tensors.values()),
                          sum(int(c.nbytes()) for c in caches.values()))


@dataclass
class MemoryTracker:
    """The largest RSS seen right after each method's generations (RSS is sampled outside the timed calls)."""

    max_rss: dict[str, int] = field(default_factory=dict)

    def sample(self, label: str) -> None:
        rss = rss_bytes()
        self.max_rss[label] = max(rss, self.max_rss.get(label, 0))
