"""Compilation bolted onto the plain forward (as gpt-fast does): nothing else changes.

``compile_model`` swaps a model's forward for a ``torch.compile``d version with static shapes: every
slot of the engine's cache (the step covers them all) by a bucket of scored tokens, as nano-vllm
captures a graph per batch size. The attended length is always the whole cache (the mask hides what
is not yet written; the extra keys cost a few percent of a step's bytes), and the number of new
tokens m is padded up to a few buckets, so each bucket compiles once and steady-state steps reuse
the compiled graphs. Padding with trailing tokens is harmless: they sit at positions after the real
ones, so causal masking hides them from real queries, and the cache lengths the engine sets never
include them. The cache gets slack positions so padding never overwrites a real entry.

On CUDA each (cache, batch, bucket) shape is also captured once as a CUDA graph over static
token/position buffers (as nano-vllm does), so a step is one graph launch instead of hundreds
of kernel launches. We capture ourselves rather than use ``mode="reduce-overhead"``: the KV
cache is an input the forward writes into, and inductor's graph trees skip capture for
mutated inputs that are not module buffers. If compilation is unavailable or fails, the model
keeps its eager forward and one warning says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.log import logger
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer

M_BUCKETS = (1, 2, 4, 8, 16, 32)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), n)


@dataclass
class _Graph:
    """One captured forward: replay after copying new inputs into ``tokens``/``positions``."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor
    cache: KVCache  # held so its id (part of the key) is never reused while the graph lives


class CompiledForward:
    """A drop-in replacement for ``Transformer.forward`` running compiled, bucketed shapes.

    ``inductor=False`` skips ``torch.compile`` and only captures CUDA graphs of the eager
    forward (CUDA only; no compilation time). ``buckets`` are the padded m sizes.
    """

    def __init__(self, model: Transformer, mode: str | None = None, inductor: bool = True,
                 buckets: tuple[int, ...] = M_BUCKETS) -> None:
        self.model = model
        forward = model.forward
        self.eager: Callable = forward.eager if isinstance(forward, CompiledForward) else forward  # recompiling
        self.compiled = torch.compile(self.eager, dynamic=False, mode=mode) if inductor else self.eager
        self.buckets = buckets
        self.cuda_graphs = model.device.type == "cuda"
        self.graphs: dict[tuple, _Graph] = {}
        self._pool = None  # one memory pool shared by every captured graph
        self.failed = False

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                 rows: slice = slice(None), last_only: bool = False, n_layers: int | None = None) -> torch.Tensor:
        b, m = tokens.shape
        # Compiled shapes cover the whole cache (every slot): a prefill or catch-up of one row, and long
        # prefills, run eagerly (one-off shapes).
        if self.failed or m > self.buckets[-1] or rows != slice(None):
            return self.eager(tokens, positions, cache, kv_len, rows, last_only, n_layers)
        mb = _bucket(m, self.buckets)
        if mb != m:
            pad = mb - m
            tokens = torch.cat([tokens, tokens[:, -1:].expand(b, pad)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)],
                                  dim=1)
        try:
            if self.cuda_graphs:
                out = self._replay(tokens, positions, cache, rows, n_layers)
            else:
                out = self.compiled(tokens, positions, cache, cache.max_len, rows, False, n_layers)
        except Exception as e:  # any backend failure: fall back for good, once
            self.fail(e)
            return self.eager(tokens[:, :m], positions[:, :m], cache, kv_len, rows, last_only, n_layers)
        return out[:, m - 1:m] if last_only else out[:, :m]

    def fail(self, error: Exception) -> None:
        """Run eagerly from now on, saying why once."""
        logger.warning("torch.compile failed (%s: %s); running eagerly", type(error).__name__, str(error)[:200])
        self.failed = True

    def _replay(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: slice,
                n_layers: int | None) -> torch.Tensor:
        key = (id(cache), tuple(tokens.shape), rows.start, rows.stop, rows.step, n_layers)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(tokens, positions, cache, rows, n_layers)
        g.tokens.copy_(tokens)
        g.positions.copy_(positions)
        g.graph.replay()
        # The output buffer is rewritten by the next replay; callers may keep logits longer.
        return g.logits.clone()

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: slice,
                 n_layers: int | None) -> _Graph:
        static_tokens, static_positions = tokens.clone(), positions.clone()

        def run() -> torch.Tensor:
            return self.compiled(static_tokens, static_positions, cache, cache.max_len, rows, False, n_layers)

        # Warm up on a side stream (compilation, cuBLAS workspaces) before capturing, as
        # torch.cuda.graphs requires. Rerunning the real tokens at their positions rewrites the
        # same K/V, so the cache is left as the real call would leave it.
        side = torch.cuda.Stream(device=tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = run()
        self._pool = graph.pool()
        return _Graph(graph, static_tokens, static_positions, logits, cache)


def compile_model(model: Transformer, cache_len: int, warmup: tuple[int, ...] = (1,),
                  mode: str | None = None, inductor: bool = True,
                  buckets: tuple[int, ...] = M_BUCKETS, batch: int = 1) -> CompiledForward:
    """Compile ``model``'s forward in place and warm up the m buckets in ``warmup``.

    Graphs are specialised to the cache's shape, so ``cache_len`` and ``batch`` (its rows) must be
    those of the caches the model will run with; only forwards over every row of such a cache run
    compiled. On CUDA, CUDA graphs are captured per cache on first use.
    """
    wrapper = CompiledForward(model, mode, inductor, buckets)
    model.forward = wrapper  # type: ignore[method-assign]
    if not inductor:
        return wrapper  # CUDA graphs are captured per cache on first use; nothing to compile
    cache = model.new_cache(batch, cache_len)
    t0 = time.perf_counter()
    with torch.inference_mode():
        # The compiled function directly, not the graph path: graphs of this throwaway cache
        # would be captured only to be dropped.
        try:
            for m in sorted({_bucket(m, buckets) for m in warmup}):
                wrapper.compiled(torch.zeros(batch, m, dtype=torch.long, device=model.device),
                                 torch.arange(m, device=model.device).expand(batch, -1), cache, cache_len,
                                 slice(None), False, None)
        except Exception as e:
            wrapper.fail(e)
    logger.info("compiled the forward for m in %s in %.1f s", warmup, time.perf_counter() - t0)
    return wrapper
