"""The drafter interface: every way of proposing tokens plugs in here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from verispec.sampling import SamplingParams, probs_from_logits, sample

if TYPE_CHECKING:
    from verispec.constraints import RowLogits
    from verispec.models.kv_cache import KVCache
    from verispec.models.llama import Transformer


Allowed = Callable[[list[int]], int]
"""How many leading tokens of a draft a row's grammar accepts after its sequence."""


class DraftingRow(Protocol):
    """What a :class:`Lockstep` reads of a row (an engine request): its slot, full sequence, k, sampling
    settings and generator, the confidence below which it stops drafting, and the processing of its
    logits (penalties, a grammar) that its drafts are drawn under."""

    slot: int
    seq: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None
    min_confidence: float
    processor: RowLogits | None


class Lockstep(Protocol):
    """A draft model that drafts many rows in one forward per token (the engine's draft runner).

    Rows draft through it with a :class:`~verispec.drafters.model.ModelDrafter` each; a step collects
    the rows whose drafter drafts through the same lockstep and calls :meth:`propose` once for them.
    """

    def begin(self, slot: int, prompt: list[int] | None = None, draft_vocab: int | None = None,
              window: int | None = None) -> int: ...

    def propose(self, rows: list[DraftingRow]) -> list[Proposal]: ...

    def commit(self, slot: int, n_valid: int) -> None: ...

    def release(self, slot: int, seq: list[int] | None = None) -> None: ...


@dataclass(frozen=True)
class DraftContext:
    """What drafters are built from: the models, cache and tokenizer of the engine that runs them.

    The engine builds it; drafters see nothing else of the engine.
    """

    target: Transformer
    target_cache: KVCache  # the target's cache, a row per engine slot (layer-skip drafts on its request's row)
    draft: Transformer | None  # a smaller same-tokenizer model, if the engine loaded one
    tokenizer: Any | None
    compiled: bool  # the forwards are compiled: they take no head argument (no reduced draft vocabulary)
    # State the drafters of one engine share, by key (the suffix drafter's index of earlier outputs). The
    # engine passes one dict to every context it builds, so nothing is shared across engines.
    shared: dict[Hashable, Any] = field(default_factory=dict)
    # The target's forward takes token trees (an eager forward in one process; compiled and tensor-parallel
    # forwards take chains only).
    trees: bool = True
    lockstep: Lockstep | None = None  # the draft model's runner, when the engine has a draft model


@dataclass
class Proposal:
    """Up to k proposed tokens and, for sampled drafts, the distributions they were drawn from.

    ``probs`` is ``[len(tokens), V]``; None means the proposal is deterministic (q is one-hot),
    which keeps rejection sampling exact for drafters that have no distribution.
    ``parents`` makes the tokens a token tree: each token's parent (-1: the sequence's last token),
    parents before children, siblings distinct; None is a chain. Trees are deterministic (no
    ``probs``), and the engine scores every node in one forward; metrics and k policies count a tree
    as drafting the positions of its deepest path. A drafter's :meth:`Drafter.commit`
    counts only the tree's leading chain (tokens 0, 1, ... each the child of the one before) as its
    own, so a drafter that caches its proposal puts that chain first.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None and (len(self.parents) != len(self.tokens) or self.probs is not None):
            raise ValueError("a token tree names one parent per token and has no draft distributions")

    def cut(self, k: int) -> Proposal:
        """The first ``k`` tokens (a tree keeps its first k nodes: their parents come before them)."""
        return Proposal(self.tokens[:k], None if self.probs is None else self.probs[:k],
                        None if self.parents is None else self.parents[:k])


class Drafter(ABC):
    """Proposes continuations of a sequence; told after each step how much of it is final.

    A drafter sees the whole token sequence (prompt and generated) on every call and keeps
    whatever state it likes; :meth:`commit` tells it the length of the verified prefix so it
    can roll its own state (a KV cache, an index) back.
    """

    name: str = "drafter"
    # Seconds per drafted token as a share of a one-token target forward: what the cost policy charges
    # for this drafter's proposals (0: a lookup, next to free).
    forward_fraction: float = 0.0
    # It proposes only what :meth:`free_tokens` offers (hybrid's lookups without a draft model): without an
    # offer its row decodes plainly; the k policy never sizes its proposals.
    lookups_only: bool = False
    # The shared forward this drafter's rows draft through together (a draft model's rows), else None:
    # the step calls ``lockstep.propose`` once for all of them instead of each row's :meth:`propose`.
    lockstep: Lockstep | None = None

    def use_row(self, slot: int) -> None:  # noqa: B027 (optional hook)
        """The next request runs in row ``slot`` of the engine's caches (called before :meth:`begin`)."""

    def begin(self, prompt: list[int]) -> None:  # noqa: B027 (optional hook)
        """A new request starts with ``prompt``."""

    @abstractmethod
    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        """Propose up to ``k`` tokens to follow ``seq`` (fewer, even none, is allowed)."""

    def commit(self, n_valid: int) -> None:  # noqa: B027 (optional hook)
        """The first ``n_valid`` tokens of the sequence are final; anything past them is not."""

    def end(self, seq: list[int]) -> None:  # noqa: B027 (optional hook)
        """The request ended with ``seq`` (its prompt and every token generated) final.

        Called once per completed request, after its last :meth:`commit`; not for a request that failed.
        """

    def drafting(self) -> Drafter:
        """The drafter that drafts this step (after :meth:`free_tokens`): this one, or one it wraps (the
        hybrid's draft model where no lookup is offered)."""
        return self

    def model_drafted(self) -> None:  # noqa: B027 (optional hook)
        """The step's draft came from :meth:`drafting`'s lockstep, not from :meth:`propose` (a drafter that
        tallies its sources counts it)."""

    def free_tokens(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None,
                    allowed: Allowed | None = None) -> int:
        """How many tokens (at most ``k``) this drafter would propose here at no draft cost and trusts.

        A lookup with a long match costs nothing to make, so the engine drafts it whatever its k
        policy would choose (even plain decoding); the next :meth:`propose` for ``seq`` returns it.
        0 (the default) leaves the choice to the k policy. ``allowed``, for a row with a grammar, says how
        many leading tokens of a draft the grammar accepts: an offer holds only those, so a lookup the
        grammar refuses leaves the step to the draft model rather than to plain decoding.
        """
        return 0


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                min_confidence: float = 0.0) -> tuple[int | None, torch.Tensor | None]:
    """The next draft token from a drafter's ``logits``, picked as the request samples.

    Returns (token, q): q is the distribution it was drawn from (None for greedy). Returns
    (None, None) when the top probability is below ``min_confidence``: such a draft would
    likely be rejected, so the drafter should stop here.
    """
    if params.greedy:
        tok = int(logits.argmax())
        if min_confidence and float(torch.softmax(logits.float(), -1)[tok]) < min_confidence:
            return None, None
        return tok, None
    q = probs_from_logits(logits, params)
    if min_confidence and float(q.max()) < min_confidence:
        return None, None
    return sample(q, generator), q
