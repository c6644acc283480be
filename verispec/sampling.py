"""Sampling settings and the one transformation from logits to the distribution we sample.

Speculative sampling is exact only if the target's distribution p and the draft's q are
transformed identically (temperature, top-k, top-p) before the acceptance test, so every
path in verispec goes through :func:`probs_from_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.errors import VerispecError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise VerispecError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not self.temperature >= 0:  # also rejects NaN
            raise VerispecError(f"temperature must be >= 0 (got {self.temperature!r})")
        if not 0 < self.top_p <= 1:
            raise VerispecError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise VerispecError(f"top_k must be an integer >= 0 (got {self.top_k!r})")
        if any(not s for s in self.stop):
            raise VerispecError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows; the limit is greedy anyway (as vLLM).
        return self.temperature < 1e-5

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for this request: seeded when a seed is given, else from entropy."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


# Candidates the top-p cut is first looked for among: a row's nucleus is mostly far smaller, and on one
# core the top 256 of a 152k-token row take about 0.3 ms where sorting it takes over 10.
TOP_P_CANDIDATES = 256


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution (fp32) under ``params``.

    Greedy maps to a one-hot distribution on the argmax, so greedy and sampled decoding can
    share the verification code. Otherwise the logits are divided by the temperature, cut to the
    ``top_k`` largest (every token tied with the k-th stays), softmaxed, and cut to the nucleus of
    ``top_p``: the smallest set of most likely tokens whose mass reaches ``top_p`` (the most likely
    token always stays), renormalized.

    The nucleus is the prefix of the row sorted by descending probability, ties broken by token id
    (lower first): exactly what a full stable sort gives, without sorting the vocabulary (see
    :func:`_top_p`). Only a tie straddling the cut makes the tie rule matter.
    """
    if params.greedy:
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
            -1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every row of ``probs`` ``[..., V]`` outside its nucleus and renormalize.

    Token i of the sorted row is dropped when the mass before it reaches ``top_p``. That mass only
    grows along the row, so once a candidate is dropped every token after it is too: when the
    last of a row's :data:`TOP_P_CANDIDATES` most likely tokens is dropped (or is 0, and so is every
    token outside), the nucleus lies inside them and their cumulative sums give it: the same numbers
    as a full sort's, since the CPU's cumsum is a sequential scan, whose prefix does not depend on what
    follows. The other rows, and those whose cut falls inside a run of equal probabilities
    (the tie rule then decides which of them stay), go through :func:`_nucleus`. The result equals
    the full-sort rule bit for bit, renormalization included.
    """
    rows = probs.reshape(-1, probs.shape[-1])
    vocab = rows.shape[-1]
    vals, ids = rows.topk(min(TOP_P_CANDIDATES, vocab), dim=-1)
    drop = (vals.cumsum(-1) - vals) >= top_p
    out = torch.zeros_like(rows).scatter_(-1, ids, vals.masked_fill(drop, 0.0))
    # Rows to look at closer: the cut falls between two equal candidates, or past the last one
    # (unless that one is 0, and so is every token outside).
    tied = ((drop[:, 1:] > drop[:, :-1]) & (vals[:, 1:] == vals[:, :-1])).any(-1)
    beyond = ~drop[:, -1] & (vals[:, -1] > 0) if vocab > vals.shape[-1] else torch.zeros_like(tied)
    for r in (tied | beyond).nonzero()[:, 0].tolist():
        # Tied: the candidates are every token at least as likely as the cut (the smallest kept one).
        threshold = _mass_threshold(rows[r], top_p) if beyond[r] else float(vals[r, int((~drop[r]).sum()) - 1])
        out[r] = _nucleus(rows[r], top_p, threshold)
    out = out.view(probs.shape)
    return out / out.sum(-1, keepdim=True)


def _nucleus(p: torch.Tensor, top_p: float, threshold: float) -> torch.Tensor:
    """The kept probabilities of the 1-D row ``p`` in place (0 elsewhere), from the tokens ``p >= threshold``.

    Those candidates are the head of the row sorted by descending probability whatever the ties, and
    sorting them stably in token order breaks ties by id. If the cut lies beyond them, the whole row.
    """
    ids = (p >= threshold).nonzero()[:, 0] if threshold > 0 else torch.arange(len(p), device=p.device)
    vals, order = p[ids].sort(descending=True, stable=True)
    drop = (vals.cumsum(-1) - vals) >= top_p
    if threshold > 0 and len(ids) < len(p) and not drop[-1]:
        return _nucleus(p, top_p, 0.0)
    return torch.zeros_like(p).index_put_((ids[order],), vals.masked_fill(drop, 0.0))


def _mass_threshold(p: torch.Tensor, top_p: float) -> float:
    """A probability below which the 1-D row ``p`` likely holds none of its nucleus, from one pass over ``p``.

    The row's mass is binned by the float's exponent and top three mantissa bits (bins ordered like the
    values, each spanning a factor 1.125); the threshold is the lower edge of the first non-empty bin
    below the one where the mass from the top reaches ``top_p``, so the candidates hold one token past
    the cut. :func:`_nucleus` checks it.
    """
    bins = (p.view(torch.int32) >> 20).clamp_(min=0)
    mass = torch.bincount(bins, weights=p)
    reached = (mass.flip(0).cumsum(0).flip(0) >= top_p).nonzero()
    if len(reached) == 0:
        return 0.0
    below = (mass[: int(reached[-1])] > 0).nonzero()
    if len(below) == 0:
        return 0.0
    return float(torch.tensor(int(below[-1]) << 20, dtype=torch.int32).view(torch.float32))


# Token ids per block of the two-stage draw in :func:`sample`.
SAMPLE_BLOCK = 256


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution (weights need not sum to 1; a weight of 0 is never drawn).

    Inverse transform sampling in two stages, each with a float64 uniform against float64 running
    sums: a block of :data:`SAMPLE_BLOCK` consecutive ids by its mass, then an id within the block.
    So P(id) = probs[id] / probs.sum() to float64 rounding, for one pass over the vocabulary and two
    uniforms (``torch.multinomial`` draws one exponential per token: 30 times slower at 152k tokens
    on the CPU). On other devices ``torch.multinomial`` is one kernel and a draw here several host
    syncs, so they keep it.
    """
    if probs.device.type != "cpu":
        return int(torch.multinomial(probs, 1, generator=generator))
    n = len(probs)
    blocks = probs.new_zeros(-(-n // SAMPLE_BLOCK) * SAMPLE_BLOCK)
    blocks[:n] = probs
    blocks = blocks.view(-1, SAMPLE_BLOCK)
    u = torch.rand(2, dtype=torch.float64, generator=generator).tolist()
    b = _inverse_cdf(blocks.sum(-1, dtype=torch.float64), u[0])
    return b * SAMPLE_BLOCK + _inverse_cdf(blocks[b].double(), u[1])


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The first index whose running sum of ``weights`` exceeds ``u`` times their total (u in [0, 1))."""
    cdf = weights.cumsum(0)
    total = float(cdf[-1])
    if not 0 < total < float("inf"):
        raise ValueError(f"cannot sample from weights summing to {total}")
    i = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=cdf.dtype), right=True))
    # u * total can round up to total itself: then the last index with weight.
    return i if i < len(cdf) else int(weights.nonzero()[-1])
