"""Launching the engine over several processes: tensor parallelism under ``torchrun``.

Every rank calls :func:`tp_engine`. Rank 0 gets an :class:`~verispec.engine.engine.Engine` whose
target is sharded and mirrored (:mod:`verispec.parallel.tp`); the other ranks follow its target
forwards until rank 0 calls :func:`shutdown`.
"""

from __future__ import annotations

import os
from typing import Any

from verispec.config import EngineConfig, resolve_dtype
from verispec.engine.engine import Engine
from verispec.log import logger
from verispec.models.loader import build_model, open_source, resolve_weights
from verispec.parallel import tp


def tp_engine(model: str, draft: str | None = None, **kwargs: Any) -> Engine | None:
    """Build the engine on every rank of a ``torchrun`` launch.

    Rank 0 gets an :class:`Engine` whose target is sharded (use it as usual, then call
    :func:`shutdown`). The other ranks load and shard only the target, follow rank 0 until it
    shuts down, and get None. ``kwargs`` are :class:`EngineConfig` fields; ``tp`` defaults to the
    world size, and a CUDA target device becomes this rank's GPU (``cuda:LOCAL_RANK``).
    """
    device = kwargs.get("target_device") or kwargs.get("device") or "cpu"
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        kwargs["target_device"] = device
    rank, world = tp.init(kwargs.pop("tp", None), device)
    kwargs["tp"] = world
    if rank == 0:
        return Engine.from_pretrained(model, draft, **kwargs)
    config = EngineConfig(model=model, draft=draft, **kwargs)
    src = open_source(model)
    target = build_model(src, resolve_dtype(config.dtype, config.target_device),
                         resolve_weights(src, config.weights, tp=world), progress=False).to(config.target_device)
    tp.shard_transformer(target, rank, world)
    n = tp.follow(target)
    logger.info("rank %d: followed %d forwards", rank, n)
    return None


def shutdown(engine: Engine | None = None) -> None:
    """Release the followers (on rank 0, given its engine) and leave the process group."""
    tp.shutdown(engine.target if engine is not None else None)
