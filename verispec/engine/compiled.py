"""Compilation bolted onto the plain forward (as gpt-fast does): nothing else changes.

``compile_model`` swaps a model's forward for a ``torch.compile``d version with static
shapes. The attended length is always the whole cache (the mask hides what is not yet
written; the extra keys cost a few percent of a step's bytes), and the number of new tokens
m is padded up to a few buckets, so each bucket compiles once and steady-state steps reuse
the compiled graphs. Padding with trailing tokens is harmless: they
sit at positions after the real ones, so causal masking hides them from real queries, and the
cache lengths the engine sets never include them. The cache gets slack positions so padding
never overwrites a real entry.

On CUDA the ``reduce-overhead`` mode captures CUDA graphs. If compilation is unavailable or
fails, the model keeps its eager forward and one warning says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from verispec.log import logger
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer

M_BUCKETS = (1, 2, 4, 8, 16, 32)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), n)


class CompiledForward:
    """A drop-in replacement for ``Transformer.forward`` running compiled, bucketed shapes."""

    def __init__(self, model: Transformer, mode: str | None = None) -> None:
        self.model = model
        self.eager: Callable = model.forward
        self.compiled = torch.compile(self.eager, dynamic=False, mode=mode)
        self.failed = False

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                 rows: slice = slice(None), last_only: bool = False, n_layers: int | None = None) -> torch.Tensor:
        b, m = tokens.shape
        if self.failed or m > M_BUCKETS[-1]:  # long prefills run eagerly: one-off shapes
            return self.eager(tokens, positions, cache, kv_len, rows, last_only, n_layers)
        mb = _bucket(m, M_BUCKETS)
        if mb != m:
            pad = mb - m
            tokens = torch.cat([tokens, tokens[:, -1:].expand(b, pad)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)],
                                  dim=1)
        try:
            out = self.compiled(tokens, positions, cache, cache.max_len, rows, False, n_layers)
        except Exception as e:  # any backend failure: fall back for good, once
            logger.warning("torch.compile failed (%s: %s); running eagerly", type(e).__name__, str(e)[:200])
            self.failed = True
            return self.eager(tokens[:, :m], positions[:, :m], cache, kv_len, rows, last_only, n_layers)
        return out[:, m - 1:m] if last_only else out[:, :m]


def compile_model(model: Transformer, cache_len: int, warmup: tuple[int, ...] = (1,),
                  mode: str | None = None) -> CompiledForward:
    """Compile ``model``'s forward in place and warm up the m buckets in ``warmup``.

    Graphs are specialised to the cache size, so ``cache_len`` must be the length of the caches
    the model will run with.
    """
    if mode is None and model.device.type == "cuda":
        mode = "reduce-overhead"  # CUDA graphs: one launch per step instead of hundreds
    wrapper = CompiledForward(model, mode)
    model.forward = wrapper  # type: ignore[method-assign]
    cache = model.new_cache(1, cache_len)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for m in sorted({_bucket(m, M_BUCKETS) for m in warmup}):
            model(torch.zeros(1, m, dtype=torch.long, device=model.device),
                  torch.arange(m, device=model.device).unsqueeze(0), cache)
    logger.info("compiled the forward for m in %s in %.1f s", warmup, time.perf_counter() - t0)
    return wrapper


def cache_slack() -> int:
    """Extra cache positions a compiled model needs beyond max_len for bucket padding."""
    return M_BUCKETS[-1]
