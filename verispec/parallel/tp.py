"""Tensor parallelism for the target model, in the Megatron layout (as gpt-fast's ``tp.py``).

Each of N ranks (one process per device, launched by ``torchrun``) holds 1/N of every layer:

* ``wqkv`` is column-parallel, split by heads: each rank keeps ``n_heads / N`` query heads and
  ``n_kv_heads / N`` key/value heads. The fused weight (and the Qwen2 biases) is split per part
  (q, k, v) and re-fused per rank, so a rank's slice is still ``[q | k | v]``.
* ``wo`` is row-parallel (split by input columns, the heads this rank computed); the partial
  outputs are summed with one all-reduce.
* ``w_gate_up`` is column-parallel over the intermediate size (gate and up split separately,
  re-fused); ``w_down`` is row-parallel, followed by an all-reduce.
* The KV cache is sharded by kv heads: ``model.args`` becomes the per-rank shape, so
  ``new_cache`` allocates ``n_kv_heads / N`` heads per rank.
* Embeddings, norms and ``lm_head`` are replicated (simplest; every rank computes the logits).

Two all-reduces per layer, as in Megatron. Only dense weights are sharded.

Rank 0 runs the engine unchanged: the drafter, verification and stopping all happen there. Its
target's ``forward`` is replaced by :class:`Leader`, which broadcasts each forward's inputs (a
small header: which cache, rows, m, kv_len; then the ``[2, B, m]`` tokens and positions) before
running it. Those tokens are exactly the step's inputs: the last accepted token and the drafts
(or the prompt, for a prefill). The other ranks run :func:`follow`, a loop that receives the
inputs and runs the same forward on their shard of the weights and cache, in lockstep. Nothing
of this touches the single-process path: without ``tp > 1`` this module is never imported.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.kv_cache import KVCache
from verispec.models.linear import DenseLinear
from verispec.models.llama import Transformer

if TYPE_CHECKING:
    from verispec.engine.engine import Engine

# Header of a message from rank 0: op, cache slot, batch, m, kv_len, row start, row stop, last_only, n_layers.
HEADER = 9
STOP, FORWARD, NEW_CACHE, FREE_CACHE = 0, 1, 2, 3


def init(tp: int | None = None, device: str = "cpu", timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (or reuse one already set up); return (rank, world).

    NCCL for CUDA devices, gloo on CPUs. ``tp``, when given, must equal the world size.
    """
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
            raise VerispecError("tensor parallelism runs one process per rank: launch with "
                                f"`torchrun --nproc-per-node {tp or 'N'} -m verispec.cli generate ... --tp "
                                f"{tp or 'N'}`")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp is not None and tp != world:
        raise VerispecError(f"--tp {tp} but the launch has {world} processes (torchrun --nproc-per-node {tp})")
    return rank, world


# -- sharding --------------------------------------------------------------------------------


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's input columns, then an all-reduce of the partial sums."""

    def __init__(self, linear: DenseLinear, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias  # added once, after the sum


def _dense(lin: nn.Module, what: str) -> DenseLinear:
    if not isinstance(lin, DenseLinear):
        raise VerispecError(f"tensor parallelism shards dense weights only; {what} is {type(lin).__name__} "
                            "(int8/int4 weights cannot be split: load the target with --weights dense)")
    return lin


def _column(lin: nn.Module, parts: list[int], rank: int, world: int, what: str) -> DenseLinear:
    """Rows of each fused part (q/k/v or gate/up) split N ways; this rank's slices re-fused."""
    lin = _dense(lin, what)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.chunk(world, dim=0)[rank] for p in t.split(parts, dim=0)]).clone()

    return DenseLinear(shard(lin.weight.data), None if lin.bias is None else shard(lin.bias.data))


def _row(lin: nn.Module, rank: int, world: int, what: str) -> RowParallel:
    lin = _dense(lin, what)
    w = lin.weight.data.chunk(world, dim=1)[rank].clone()
    return RowParallel(DenseLinear(w, None), None if lin.bias is None else lin.bias.data.clone())


def shard_transformer(model: Transformer, rank: int | None = None, world: int | None = None) -> Transformer:
    """Keep this rank's shard of every layer of an already built ``model`` (in place; returns it).

    ``rank`` and ``world`` default to the process group's. After sharding, ``model.args`` holds the
    per-rank head counts and intermediate size, so caches made by ``new_cache`` are sharded too.
    """
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    a = model.args
    if a.n_heads % world or a.n_kv_heads % world:
        raise VerispecError(f"tensor parallelism over {world} ranks needs head counts divisible by {world} "
                            f"(this model has {a.n_heads} query and {a.n_kv_heads} key/value heads)")
    if a.intermediate_size % world:
        raise VerispecError(f"the intermediate size {a.intermediate_size} does not split over {world} ranks")
    hd, inter = a.head_dim, a.intermediate_size
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.attn, layer.mlp
        attn.wqkv = _column(attn.wqkv, [a.n_heads * hd, a.n_kv_heads * hd, a.n_kv_heads * hd], rank, world,
                            f"layer {i} wqkv")
        attn.wo = _row(attn.wo, rank, world, f"layer {i} wo")
        attn.n_heads, attn.n_kv_heads = a.n_heads // world, a.n_kv_heads // world
        mlp.w_gate_up = _column(mlp.w_gate_up, [inter, inter], rank, world, f"layer {i} w_gate_up")
        mlp.w_down = _row(mlp.w_down, rank, world, f"layer {i} w_down")
    model.args = dataclasses.replace(a, n_heads=a.n_heads // world, n_kv_heads=a.n_kv_heads // world,
                                     intermediate_size=inter // world)
    model.tp = (rank, world)
    return model


# -- lockstep: rank 0 leads, the others follow -----------------------------------------------


def _header(device: torch.device, *values: int) -> None:
    dist.broadcast(torch.tensor([*values] + [0] * (HEADER - len(values)), dtype=torch.long, device=device), src=0)


class Leader:
    """Rank 0's ``forward``: broadcast the inputs to the other ranks, then run this rank's shard."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.eager = model, model.forward
        self.slots: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()
        self.next_slot = 0
        self.freed: list[int] = []
        self.closed = False

    def _slot(self, cache: KVCache) -> int:
        slot = self.slots.get(cache)
        if slot is None:
            dev = self.model.device
            while self.freed:  # caches rank 0 dropped: the followers drop theirs
                _header(dev, FREE_CACHE, self.freed.pop())
            slot, self.next_slot = self.next_slot, self.next_slot + 1
            _header(dev, NEW_CACHE, slot, cache.batch, cache.max_len)
            self.slots[cache] = slot
            weakref.finalize(cache, self.freed.append, slot)
        return slot

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int | None = None,
                 rows: slice = slice(None), last_only: bool = False, n_layers: int | None = None) -> torch.Tensor:
        if self.closed:
            raise VerispecError("the tensor-parallel group has been shut down")
        b, m = tokens.shape
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        start, stop, step = rows.indices(cache.batch)
        if step != 1:
            raise ValueError("rows must be a contiguous slice")
        slot = self._slot(cache)
        _header(self.model.device, FORWARD, slot, b, m, kv_len, start, stop, int(last_only), n_layers or 0)
        dist.broadcast(torch.stack([tokens, positions.to(tokens.device)]).long().contiguous(), src=0)
        return self.eager(tokens, positions, cache, kv_len, rows, last_only, n_layers)

    def close(self) -> None:
        """Release the followers (they leave :func:`follow`)."""
        if not self.closed:
            self.closed = True
            _header(self.model.device, STOP)


def lead(model: Transformer, tp: int | None = None) -> Transformer:
    """On rank 0: shard ``model`` and make every forward of it run on all ranks (returns it)."""
    rank, world = init(tp, device=str(model.device))
    if rank != 0:
        raise VerispecError("only rank 0 leads; the other ranks run verispec.parallel.tp.follow")
    shard_transformer(model, rank, world)
    model.forward = Leader(model)  # type: ignore[method-assign]
    logger.info("tensor parallel over %d ranks: rank 0 leads", world)
    return model


@torch.inference_mode()
def follow(model: Transformer) -> int:
    """On ranks > 0: run the forwards rank 0 announces, on this rank's shard, until it says stop.

    Returns the number of forwards run.
    """
    dev = model.device
    caches: dict[int, KVCache] = {}
    header = torch.empty(HEADER, dtype=torch.long, device=dev)
    n = 0
    while True:
        dist.broadcast(header, src=0)
        op, slot, b, m, kv_len, start, stop, last_only, n_layers = header.tolist()
        if op == STOP:
            return n
        if op == NEW_CACHE:
            caches[slot] = model.new_cache(b, m)
        elif op == FREE_CACHE:
            caches.pop(slot, None)
        elif op == FORWARD:
            inputs = torch.empty(2, b, m, dtype=torch.long, device=dev)
            dist.broadcast(inputs, src=0)
            model(inputs[0], inputs[1], caches[slot], kv_len, slice(start, stop), bool(last_only), n_layers or None)
            n += 1
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")


# -- launching -------------------------------------------------------------------------------


def tp_engine(model: str, draft: str | None = None, **kwargs: Any) -> Engine | None:
    """Build the engine on every rank of a ``torchrun`` launch.

    Rank 0 gets an :class:`Engine` whose target is sharded (use it as usual, then call
    :func:`shutdown`). The other ranks load and shard only the target, follow rank 0 until it
    shuts down, and get None. ``kwargs`` are :class:`EngineConfig` fields; ``tp`` defaults to the
    world size, and a CUDA target device becomes this rank's GPU (``cuda:LOCAL_RANK``).
    """
    from verispec.config import EngineConfig, resolve_dtype
    from verispec.engine.engine import Engine
    from verispec.models.loader import build_model, open_source, resolve_weights

    device = kwargs.get("target_device") or kwargs.get("device") or "cpu"
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        kwargs["target_device"] = device
    rank, world = init(kwargs.pop("tp", None), device)
    kwargs["tp"] = world
    if rank == 0:
        return Engine.from_pretrained(model, draft, **kwargs)
    config = EngineConfig(model=model, draft=draft, **kwargs)
    src = open_source(model)
    target = build_model(src, resolve_dtype(config.dtype, config.target_device),
                         resolve_weights(src, config.weights, tp=world), progress=False).to(config.target_device)
    shard_transformer(target, rank, world)
    n = follow(target)
    logger.info("rank %d: followed %d forwards", rank, n)
    return None


def shutdown(engine: Engine | None = None) -> None:
    """Release the followers (on rank 0, given its engine) and leave the process group."""
    forward = getattr(engine.target, "forward", None) if engine is not None else None
    if isinstance(forward, Leader):
        forward.close()
    if dist.is_initialized():
        dist.destroy_process_group()
