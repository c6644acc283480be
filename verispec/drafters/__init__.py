"""Drafters: the ways of proposing tokens. :func:`make_drafter` maps a method name to one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verispec.config import SpecConfig
from verispec.drafters.base import DraftContext, Drafter, Proposal
from verispec.errors import VerispecError

if TYPE_CHECKING:
    from verispec.drafters.datastore import Datastore

__all__ = ["DraftContext", "Drafter", "Proposal", "make_drafter"]


def make_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    """Build the drafter ``spec.method`` names, for ``ctx``'s target (and draft model).

    ``spec.draft_vocab`` reduces the draft model's head and ``spec.draft_window`` the prompt it reads
    (methods ``draft`` and ``hybrid`` with a draft model); drafters without a draft model ignore
    them, so a server's default spec carrying them still serves requests that ask for ``ngram``.
    """
    if spec.method == "draft":
        if ctx.draft is None:
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
    raise VerispecError(f"method '{spec.method}' is not available yet")


def _model_drafter(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.vocab import special_token_ids

    if spec.draft_vocab is not None and ctx.compiled:
        # The compiled forward (engine.compiled) has no head argument: it would score the full vocabulary.
        raise VerispecError(f"method '{spec.method}': a reduced draft vocabulary (vocab={spec.draft_vocab}) "
                            "does not work with --compile yet")
    assert ctx.draft is not None
    specials = special_token_ids(ctx.tokenizer, ctx.eos_ids) if spec.draft_vocab is not None else ()
    return ModelDrafter(ctx.draft, ctx.cache_len, ctx.target.args.vocab_size, spec.min_confidence,
                        spec.draft_vocab, specials, spec.draft_window)


def _open_datastore(spec: SpecConfig, ctx: DraftContext) -> Datastore:
    from verispec.drafters.datastore import Datastore
    from verispec.log import logger

    if not spec.datastore:
        raise VerispecError(f"method '{spec.method}' needs a datastore (--datastore; build one with "
                            "`verispec datastore build`)")
    if ctx.tokenizer is None:
        logger.warning("the model has no tokenizer: only the datastore's vocabulary size can be checked")
    return Datastore.open(spec.datastore, ctx.tokenizer, ctx.target.args.vocab_size)


def _make_hybrid(spec: SpecConfig, ctx: DraftContext) -> Drafter:
    """N-gram (plus the datastore, if given) when the match is long, else the draft model.

    Without a draft model the fallback is layer-skip on the target itself only when ``spec.layers``
    asks for it: early exits of models not trained for them are rarely accepted (see
    docs/drafters.md), so by default such steps decode plainly (lookup only).
    """
    from verispec.drafters.hybrid import HybridDrafter
    from verispec.drafters.layerskip import LayerSkipDrafter
    from verispec.drafters.ngram import NgramDrafter
    from verispec.drafters.retrieval import RetrievalDrafter

    retrieval = RetrievalDrafter(_open_datastore(spec, ctx)) if spec.datastore else None
    model: Drafter | None = None
    if ctx.draft is not None:
        model = _model_drafter(spec, ctx)
    elif spec.layers is not None:
        model = LayerSkipDrafter(ctx.target, ctx.target_cache, spec.layers, spec.min_confidence)
    return HybridDrafter(NgramDrafter(spec.ngram_max, spec.ngram_min), model, retrieval)
