"""The speculative step: every stepping row proposes, one target forward scores them all, each row verifies.

For each row (Leviathan et al., 2023): (1) propose up to k draft tokens d1..dk; (2) score
[last token, d1..dk] with the target; (3) verify, keeping the longest valid prefix d1..dn plus one
token of the target's (so even an all-rejected step yields a token, and plain decoding is k = 0);
(4) roll back to what was accepted. Invariant: a row's target cache holds ``seq[:-1]``.
A proposal may be a token tree (:class:`~verispec.drafters.base.Proposal` ``parents``): its nodes
take the same consecutive slots, each attends to its own root path (the forward's ``tree`` masks),
verification keeps one root path, and rollback moves that path's K/V to the slots right after the
row's last token (compaction; a chain's accepted prefix is already there).
A step feeds each row ``[last token, d1..dk_row]`` at its own positions; rows are right-padded to
the batch's widest ``k + 1`` with copies of their last token at the following positions. Padding
K/V land past the row's length, are hidden from its real queries by the causal-by-position mask,
and are overwritten by later steps, so they cost compute but never change a result. Verification
and rollback are per row, so a row's result never depends on its companions.

The forward covers the contiguous slot span of the stepping rows (the model addresses cache rows
by slice); slots inside the span that are not stepping (free, or still prefilling) get dummy
tokens at positions from their own cache length on, which are equally harmless.

A row whose own drafter raises (in ``propose`` or ``commit``) is left out of the step and
reported in ``StepReport.failed``; the other rows' results do not depend on it (a row's result
never depends on its companions). Any other exception propagates before any row's cache length,
drafter or metrics change: every row is verified first, and only then are all rolled forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verispec.drafters.base import Lockstep, Proposal
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.metrics import sync
from verispec.engine.request import Request
from verispec.models.kv_cache import KVCache
from verispec.models.llama import Transformer, span_forward
from verispec.sampling import TokenLogprob, probs_from_logits, token_logprobs
from verispec.verify import verify_greedy, verify_sampling, verify_tree_sampling


@dataclass
class StepReport:
    """What one batched step did: rows, padded width, tokens scored and seconds per stage."""

    rows: int
    span: int  # cache rows the target forward covered (rows plus holes between them)
    width: int  # the padded number of positions per row (max k + 1)
    draft_forwards: int
    propose_s: float  # catch-ups included
    score_s: float
    verify_s: float
    new_tokens: list[list[int]] = field(default_factory=list)  # per row: its 1..k+1 new tokens
    drafted: list[int] = field(default_factory=list)  # per row
    accepted: list[int] = field(default_factory=list)  # per row
    catch_ups: int = 0  # rows whose draft caught up alone, the context they read and its seconds
    catch_up_tokens: int = 0
    catch_up_s: float = 0.0
    context: int = 0  # the longest row's tokens before the step: what the forward's keys were padded to
    failed: dict[int, BaseException] = field(default_factory=dict)  # row index -> what its own drafter raised
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # per row asking: its new tokens'
    retried: bool = False  # the rows ran one by one after the batched step raised (Engine._run_step)

    @property
    def scored_tokens(self) -> int:
        return self.span * self.width


@torch.inference_mode()
def speculative_step(target: Transformer, cache: KVCache, rows: list[Request], draft_model: DraftRunner | None,
                     full_span: bool = False) -> StepReport:
    """Extend every row by one speculative step; ``report.new_tokens[i]`` are row i's 1..k+1 new tokens.

    A row in ``report.failed`` (its drafter raised) did not step: no new tokens, cache unchanged.
    ``full_span``: the forward covers every slot (a compiled target's static shapes).
    """
    t0 = time.perf_counter()
    before = _draft_counters(draft_model)
    proposals, failed = _propose(rows)
    live = [i for i in range(len(rows)) if i not in failed]
    t1 = time.perf_counter()
    report = StepReport(len(rows), 0, 0, 0, t1 - t0, 0.0, 0.0, context=max(len(r.seq) for r in rows),
                        new_tokens=[[] for _ in rows], drafted=[0] * len(rows), accepted=[0] * len(rows),
                        failed=failed)
    if not live:
        return report
    logits, lo = _score(target, cache, rows, proposals, live, full_span, report)
    t2 = time.perf_counter()
    report.score_s = t2 - t1
    _verify(cache, rows, proposals, live, logits, lo, report)
    report.verify_s = time.perf_counter() - t2
    after = _draft_counters(draft_model)
    report.draft_forwards, report.catch_ups, report.catch_up_tokens = (a - b for a, b in zip(after[:3], before[:3],
                                                                                           strict=True))
    report.catch_up_s = after[3] - before[3]
    # Each request waited for the whole step, so each is charged every stage's full time.
    for r in (rows[i] for i in live if i not in failed):
        for stage, s in (("propose", report.propose_s), ("score", report.score_s), ("verify", report.verify_s)):
            r.metrics.stage_s[stage] += s
    return report


def _draft_counters(draft_model: DraftRunner | None) -> tuple[int, int, int, float]:
    if draft_model is None:
        return 0, 0, 0, 0.0
    return draft_model.forwards, draft_model.catch_ups, draft_model.catch_up_tokens, draft_model.catch_up_s


def _propose(rows: list[Request]) -> tuple[list[Proposal], dict[int, BaseException]]:
    """1. Propose: rows whose drafter drafts through a lockstep (the draft model) draft together, one call
    per lockstep; the other drafters one by one; each proposal cut to its row's k."""
    proposals = [Proposal([])] * len(rows)
    failed: dict[int, BaseException] = {}
    together: dict[int, tuple[Lockstep, list[int]]] = {}
    alone = []
    for i, r in enumerate(rows):
        if r.drafter is not None and r.k > 0:
            lockstep = r.drafter.drafting().lockstep
            if lockstep is None:
                alone.append(i)
            else:
                together.setdefault(id(lockstep), (lockstep, []))[1].append(i)
    for lockstep, rows_of in together.values():
        for i, p in zip(rows_of, lockstep.propose([rows[i] for i in rows_of]), strict=True):
            proposals[i] = p
            rows[i].drafter.model_drafted()
    for i in alone:
        r = rows[i]
        try:
            proposals[i] = r.drafter.propose(r.seq, r.k, r.params, r.generator)
        except Exception as e:  # noqa: BLE001 (this row's drafter: the row fails, the step goes on)
            failed[i] = e
    return [_grammatical(p.cut(r.k), r) for p, r in zip(proposals, rows, strict=True)], failed


def _grammatical(p: Proposal, r: Request) -> Proposal:
    """``p`` without what ``r``'s grammar refuses: a chain cut before its first refused token (a sampled
    chain keeps that token: see :mod:`verispec.constraints`), a tree without refused nodes and their subtrees."""
    if r.processor is None or not r.processor.grammar or not p.tokens:
        return p
    if p.parents is None:
        n = r.processor.allowed(r.seq, p.tokens)
        return p.cut(n + 1 if p.probs is not None else n)
    keep: list[int] = []
    index: dict[int, int] = {-1: -1}  # old node -> new node
    for i, parent in enumerate(p.parents):
        if parent in index and r.processor.allowed(r.seq, _path(p, i)) == len(_path(p, i)):
            index[i] = len(keep)
            keep.append(i)
    return Proposal([p.tokens[i] for i in keep], None, [index[p.parents[i]] for i in keep])


def _path(p: Proposal, node: int) -> list[int]:
    """The draft tokens on the root path to ``node`` (``node`` included; none for -1)."""
    if p.parents is None:
        return p.tokens[: node + 1]
    path = []
    while node >= 0:
        path.append(p.tokens[node])
        node = p.parents[node]
    return path[::-1]


def _score(target: Transformer, cache: KVCache, rows: list[Request], proposals: list[Proposal], live: list[int],
           full_span: bool, report: StepReport) -> tuple[torch.Tensor, int]:
    """2. Score: one forward over the slot span, each row padded to the widest k + 1; its logits, the span's start."""
    feeds = {rows[i].slot: [rows[i].seq[-1], *proposals[i].tokens] for i in live}
    width = max(len(f) for f in feeds.values())
    # Keys up to the stepping rows' last position: a hole's dummies may sit further out (a row still
    # prefilling, a free slot's cached prefix); they are written all the same, and what their queries
    # attend to is never read. Every row attending to a hole's length would pay for it.
    kv_len = max(len(r.seq) for r in rows) - 1 + width
    logits, lo = span_forward(target, cache, feeds, {rows[i].slot: len(rows[i].seq) - 1 for i in live}, kv_len,
                              full_span, {rows[i].slot: proposals[i].parents for i in live
                                          if proposals[i].parents is not None})
    sync(logits.device)  # charge the forward to "score", not to the first sync in "verify"
    report.span, report.width = logits.shape[0], width
    return logits, lo


def _verify(cache: KVCache, rows: list[Request], proposals: list[Proposal], live: list[int], logits: torch.Tensor,
            lo: int, report: StepReport) -> None:
    """3. Verify each row against its own slice of the logits, with its own generator (nothing changes yet);
    4. roll back to what was accepted: the row keeps K/V for seq[-1] and its accepted path d_a1..d_an."""
    verdicts = []
    for i in live:
        r, d, p = rows[i], proposals[i].tokens, proposals[i]
        raw = logits[r.slot - lo, : len(d) + 1]
        # Row 0 follows the sequence, row j + 1 draft token j's root path.
        row_logits = raw if r.processor is None else r.processor.apply(
            raw, r.seq, [[]] + [_path(p, j) for j in range(len(d))])
        if r.params.greedy:
            verdicts.append(verify_greedy(d, row_logits, p.parents))
        elif p.parents is not None:
            verdicts.append(verify_tree_sampling(d, p.parents, probs_from_logits(row_logits, r.params), r.generator))
        else:
            q = None if p.probs is None else p.probs[: len(d)].to(row_logits.device)
            n, extra = verify_sampling(d, q, probs_from_logits(row_logits, r.params), r.generator)
            verdicts.append((list(range(n)), extra))
        if r.params.logprobs is not None:
            path, extra = verdicts[-1]
            report.logprobs[i] = token_logprobs(raw[[0] + [node + 1 for node in path]],
                                                [d[node] for node in path] + [extra], r.params.logprobs)
    for i, (path, extra) in zip(live, verdicts, strict=True):
        r, d, n = rows[i], proposals[i].tokens, len(path)
        chain_n = next((j for j, node in enumerate(path) if node != j), n)  # the drafter's own chain, kept
        if r.drafter is not None:
            try:
                r.drafter.commit(len(r.seq) + chain_n)
            except Exception as e:  # noqa: BLE001 (this row's drafter, as in propose: its cache stays put)
                report.failed[i] = e
                continue
        if chain_n < n:
            _compact(cache, r.slot, len(r.seq), path)
        cache.lengths[r.slot] = len(r.seq) + n
        # A tree drafts the positions of its deepest path: acceptance counts per position, as for a chain.
        drafted = len(d) if proposals[i].parents is None else _depth(proposals[i].parents)
        r.metrics.record_step(r.k, drafted, n)
        report.new_tokens[i] = [d[node] for node in path] + [extra]
        report.drafted[i] = drafted
        report.accepted[i] = n


def _depth(parents: list[int]) -> int:
    """The number of tokens on a tree's deepest root path."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 + (depths[parent] if parent >= 0 else 0))
    return max(depths, default=0)


def _compact(cache: KVCache, row: int, first: int, path: list[int]) -> None:
    """Move the K/V of a tree's accepted ``path`` (draft indices; node i sits at slot ``first + i``) to
    slots ``first, first + 1, ...``. Their keys are already rotated for those positions: a node's
    rotary position is its depth."""
    device = cache.k[0].device
    src = torch.tensor([first + node for node in path], device=device)
    dst = torch.arange(first, first + len(path), device=device)
    for k, v in zip(cache.k, cache.v, strict=True):  # each gather is a copy: overlapping slots are safe
        k[row, :, dst] = k[row, :, src]
        v[row, :, dst] = v[row, :, src]
