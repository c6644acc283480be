"""A row's step, planned: where its draft comes from, and what the k policy knows of it."""

from __future__ import annotations

from collections.abc import Callable

from verispec.config import K_MAX
from verispec.engine.policy import CostPolicy, RowPlan
from verispec.engine.request import Request
from verispec.engine.stopping import k_cap


def plan_step(requests: list[Request], max_len: int, policy: Callable[[], CostPolicy],
              full_span: int | None) -> int | None:
    """Set each request's k (and draft source) for the next step; the k the cost policy chose, if it chose one.

    ``requests`` have room left in their slots (``max_len`` positions each); ``policy()`` is the
    engine's cost policy, profiled on first use; ``full_span``: the step covers that many slots (a
    compiled target's static shapes), else only the requests' span.
    """
    plans = [plan_row(req, max_len - len(req.seq), lambda: policy().costs.target_s(1)) for req in requests]
    policy_k = None
    if any(req.governed or plan.optional for req, plan in zip(requests, plans, strict=True)):
        slots = [r.slot for r in requests]
        span = full_span or max(slots) - min(slots) + 1
        ks = policy().choose(plans, span)
        policy_k = max((k for k, req in zip(ks, requests, strict=True) if req.governed), default=None)
    else:
        ks = [p.fixed_k for p in plans]
    for req, k, plan in zip(requests, ks, plans, strict=True):
        req.k = min(k, plan.cap)
    return policy_k


def plan_row(req: Request, room: int, target_token_s: Callable[[], float]) -> RowPlan:
    """Set up ``req``'s step (what its drafter offers for free) and say what the policy knows.

    ``room``: positions left in its slot (a step uses k + 1 of them); ``target_token_s()``: the target's
    seconds for one token, which prices a drafter that runs target layers.
    """
    n_out = req.n_out
    cap = k_cap(req.spec.k, req.params, n_out, room) if req.speculates else 0
    # A prediction is offered the widest k the cost policy prices (a request's own k policy keeps its k).
    offer = k_cap(K_MAX, req.params, n_out, room) if req.predictor and req.kpolicy is None else cap
    req.governed = False
    if not offer:  # nothing to draft (a plain request, or no room): nothing for a policy to decide
        req.lookup = None
        return RowPlan(0)
    # A trusted lookup (hybrid, a prediction) costs no draft time and is valued at the acceptance the
    # request's lookups of its kind reach; the cost policy drafts as much of it as pays (``optional``), a
    # request's own k policy all of it.
    # Without one a hybrid row drafts with the draft model (its drafter's ``drafting()``).
    drafter = req.drafter
    assert drafter is not None  # a row with something to offer speculates
    grammar = req.processor if req.processor is not None and req.processor.grammar else None
    allowed = None if grammar is None else (lambda tokens: grammar.allowed(req.seq, tokens))
    free = drafter.free_tokens(req.seq, offer, req.params, req.generator, allowed)
    source_drafter = drafter.drafting()
    lockstep = source_drafter.lockstep is not None
    source = req.prediction_acceptance if req.predictor and req.predictor.offering else req.lookup_acceptance
    req.lookup = source if free else None
    if free or drafter.lookups_only:
        return RowPlan(max(cap, free), fixed_k=free, optional=req.kpolicy is None, fixed_rate=source.rate)
    if req.kpolicy is not None:
        return RowPlan(cap, fixed_k=req.kpolicy.choose(cap), model_draft=lockstep)
    req.governed = True
    fraction = 0.0 if lockstep else source_drafter.forward_fraction
    own_s = fraction * target_token_s() if fraction else 0.0
    return RowPlan(cap, req.acceptance.rate, model_draft=lockstep, draft_token_s=own_s, probes=req.probes)
