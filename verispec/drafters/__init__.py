"""Drafters: the ways of proposing tokens. :func:`make_drafter` maps a method name to one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from verispec.config import SpecConfig
from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.errors import VerispecError

if TYPE_CHECKING:
    from verispec.drafters.datastore import Datastore
    from verispec.drafters.suffix import SuffixDrafter

__all__ = ["CustomDrafter", "DraftContext", "Drafter", "DrafterPool", "Proposal", "make_drafter", "own_drafter"]

# A caller's own drafter: one Drafter (it keeps one sequence's state, so its requests run one at a time)
# or a callable that builds one per request (they run batched, as built-in drafters do).
CustomDrafter = Drafter | Callable[[], Drafter]


def own_drafter(drafter: CustomDrafter) -> Drafter:
    """A caller's drafter for one request: ``drafter`` itself, or the one it builds."""
    built = drafter if isinstance(drafter, Drafter) else drafter()
    if not isinstance(built, Drafter):
        raise VerispecError(f"the drafter factory built {type(built).__name__}, not a Drafter")
    return built


def make_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter | None:
    """Build the per-row drafter ``spec.method`` names, for ``ctx``'s target (and draft model).

    A draft model's rows draft through the engine's lockstep runner (``ctx.lockstep``), each with a
    :class:`~verispec.drafters.model.ModelDrafter`: method ``draft``'s, and ``hybrid``'s for the steps
    its lookups are not trusted on. ``spec.draft_vocab`` reduces the draft model's head and
    ``spec.draft_window`` the prompt it reads; methods without a draft model ignore them, so a
    server's default spec carrying them still serves requests that ask for ``ngram``.
    """
    if spec.method in ("draft", "hybrid") and ctx.draft is not None:
        _check_draft_model(spec, ctx)
    if spec.method == "draft":
        if ctx.draft is None or ctx.lockstep is None:
            raise VerispecError("method 'draft' needs a draft model (--draft)")
        return _model_drafter(spec, ctx)
    if spec.method == "ngram":
        from verispec.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.ngram_max, spec.ngram_min)
    if spec.method == "retrieval":
        from verispec.drafters.retrieval import RetrievalDrafter

        return RetrievalDrafter(_open_datastore(spec, ctx))
    if spec.method == "layerskip":
        from verispec.drafters.layerskip import LayerSkipDrafter

        return LayerSkipDrafter(ctx.target, ctx.target_cache, spec.layers, spec.min_confidence)
    if spec.method == "hybrid":
        return _make_hybrid(spec, ctx)
    if spec.method == "suffix":
        return _make_suffix(spec, ctx)
    raise VerispecError(f"method '{spec.method}' is not available yet")


def _model_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter | None:
    """A row's drafter on the draft model (None without one)."""
    from verispec.drafters.model import ModelDrafter

    if ctx.lockstep is None:
        return None
    return ModelDrafter(ctx.lockstep, spec.draft_vocab, spec.draft_window, spec.min_confidence)


def _check_draft_model(spec: SpecConfig, ctx: DraftContext) -> None:
    # draft_vocab and draft_window were checked when the SpecConfig was built.
    if spec.draft_vocab is not None and ctx.compiled:
        # The compiled forward (engine.compiled) has no head argument: it would score the full vocabulary.
        raise VerispecError(f"method '{spec.method}': a reduced draft vocabulary (vocab={spec.draft_vocab}) "
                            "does not work with --compile yet")


def _open_datastore(spec: SpecConfig, ctx: DraftContext) -> Datastore:
    from verispec.drafters.datastore import Datastore
    from verispec.log import logger

    if not spec.datastore:
        raise VerispecError(f"method '{spec.method}' needs a datastore (--datastore; build one with "
                            "`verispec datastore build`)")
    if ctx.tokenizer is None:
        logger.warning("the model has no tokenizer: only the datastore's vocabulary size can be checked")
    return Datastore.open(spec.datastore, ctx.tokenizer, ctx.target.args.vocab_size)


def _make_suffix(spec: SpecConfig, ctx: DraftContext) -> SuffixDrafter:
    """A suffix drafter over its request and, unless ``spec.suffix_global`` is 0, the engine's shared index
    of earlier outputs (one per drafter key, kept in ``ctx.shared``)."""
    from verispec.drafters.suffix import OutputIndex, SuffixDrafter

    if spec.suffix_width > 1 and not ctx.trees:
        raise VerispecError(f"suffix_width={spec.suffix_width} drafts token trees, which do not work with "
                            "--compile or tensor parallelism yet (use suffix_width=1)")
    # One index per drafter key (the settings but k): requests that speculate alike share it, and methods
    # compared in one benchmark run never draft from each other's answers to the same prompt.
    outputs = OutputIndex.shared(ctx.shared, spec.suffix_global, spec.drafter_key) if spec.suffix_global else None
    return SuffixDrafter(outputs, spec.suffix_min_prob, spec.suffix_factor, width=spec.suffix_width)


def _make_hybrid(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    """The context lookup (n-gram or suffix; plus the datastore, if given) when the match is long, else the
    engine's draft model.

    Without a draft model, steps without a trusted match decode plainly (lookup only). Layer-skip
    is no fallback: early exits of models not trained for them are rarely accepted (see
    docs/drafters.md); it is a method of its own.
    """
    from verispec.drafters.hybrid import HybridDrafter
    from verispec.drafters.ngram import NgramDrafter
    from verispec.drafters.retrieval import RetrievalDrafter

    if spec.layers is not None and ctx.draft is None:
        raise VerispecError("hybrid falls back to a draft model (--draft), not to layer-skip; "
                            "use --method layerskip for early-exit drafts")
    retrieval = RetrievalDrafter(_open_datastore(spec, ctx)) if spec.datastore else None
    lookup = _make_suffix(spec, ctx) if spec.lookup == "suffix" else NgramDrafter(spec.ngram_max, spec.ngram_min)
    return HybridDrafter(lookup, retrieval, model=_model_drafter(spec, ctx))


class DrafterPool:
    """Per-row drafters (the draft model's, n-gram, retrieval, layer-skip, hybrid), one per running request.

    Drafters keep per-sequence state, so two rows never share one; finished requests return
    theirs for reuse (``begin`` resets it), so a drafter is built at most once per slot.
    """

    def __init__(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.free: dict[str, list[Drafter]] = {}

    def acquire(self, spec: SpecConfig) -> Drafter | None:
        pool = self.free.setdefault(spec.drafter_key, [])
        return pool.pop() if pool else make_drafter(spec, self.ctx)

    def release(self, spec: SpecConfig, drafter: Drafter) -> None:
        self.free.setdefault(spec.drafter_key, []).append(drafter)
