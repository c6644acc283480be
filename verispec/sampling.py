"""Sampling settings and the one transformation from logits to the distribution we sample.

Speculative sampling is exact only if the target's distribution p and the draft's q are
transformed identically (temperature, top-k, top-p) before the acceptance test, so every
path in verispec goes through :func:`probs_from_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.errors import VerispecError

# The most alternatives a request may ask log-probabilities for (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


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
    # Changes to the target's logits, before temperature (verispec.constraints.RowLogits): OpenAI's
    # penalties (-2..2, on the output's tokens) and logit bias (token id -> -100..100, a dict or pairs).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities of each emitted token and of the ``logprobs`` most likely (0..20); None: none.
    logprobs: int | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise VerispecError(f"{name} must be in [-2, 2] (got {getattr(self, name)!r})")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError) as e:
            raise VerispecError("logit_bias maps token ids to numbers") from e
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in pairs):
            raise VerispecError("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", pairs)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise VerispecError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (got {self.logprobs!r})")

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


# Candidates the top-p cut is first looked for among, and the factor they grow by where the nucleus is
# larger: a row's nucleus is mostly far smaller, and on one core the top 256 of a 152k-token row take
# about 0.3 ms where sorting it takes over 10.
TOP_P_CANDIDATES = 256
TOP_P_GROWTH = 16


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution (fp32) under ``params``.

    Greedy maps to a one-hot distribution on the argmax, so greedy and sampled decoding can
    share the verification code. Otherwise the logits are divided by the temperature, cut to the
    ``top_k`` largest (every token tied with the k-th stays), softmaxed, and cut to the nucleus of
    ``top_p``: the smallest set of most likely tokens whose mass reaches ``top_p`` (the most likely
    token always stays), renormalized.

    The nucleus is found among the row's most likely tokens without sorting the vocabulary (see
    :func:`_top_p`). Which of several equally likely tokens at the cut stay is up to ``torch.topk``:
    deterministic, and the same rule for target and draft, which is all exactness needs.
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

    A row's C most likely tokens, in descending order, give the cut: token i is dropped once the
    mass before it reaches ``top_p``, and that mass only grows along the row, so once the last
    candidate is dropped (or is 0, as is everything outside) the nucleus lies inside them. Rows
    where it does not are tried again with ``TOP_P_GROWTH`` times the candidates, up to the whole row.
    """
    rows = probs.reshape(-1, probs.shape[-1])
    vocab = rows.shape[-1]
    out = torch.zeros_like(rows)
    todo = torch.arange(len(rows), device=rows.device)
    c = min(TOP_P_CANDIDATES, vocab)
    while len(todo):
        vals, ids = rows[todo].topk(c, dim=-1)
        drop = (vals.cumsum(-1) - vals) >= top_p
        drop[:, 0] = False  # the most likely token stays, even where top_p rounds to 0 in fp32
        settled = drop[:, -1] | (vals[:, -1] == 0) if c < vocab else torch.ones_like(drop[:, -1])
        done = todo[settled]
        out[done] = out[done].scatter_(-1, ids[settled], vals[settled].masked_fill(drop[settled], 0.0))
        todo, c = todo[~settled], min(c * TOP_P_GROWTH, vocab)
    out = out.view(probs.shape)
    return out / out.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution (weights need not sum to 1; a weight of 0 is never drawn).

    On the CPU by inverse transform: one float64 uniform against the float64 running sum of the
    weights (``torch.multinomial`` draws one exponential per token there, some ten times slower at
    152k tokens). Other devices keep ``torch.multinomial``, one kernel without a host sync.
    """
    if probs.device.type != "cpu":
        return int(torch.multinomial(probs, 1, generator=generator))
    cdf = probs.double().cumsum(0)
    total = float(cdf[-1])
    if not 0 < total < float("inf"):
        raise ValueError(f"cannot sample from weights summing to {total}")
    u = torch.rand(1, dtype=torch.float64, generator=generator) * total
    i = int(torch.searchsorted(cdf, u, right=True))
    # u can round up to the total itself: then the last id with weight.
    return i if i < len(cdf) else int(probs.nonzero()[-1])


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the ``top`` most likely tokens' at its position, as
    (token id, log-probability) pairs in descending order."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of ``tokens[i]`` under row i of ``logits`` ``[>= len(tokens), V]``.

    Taken from the model's own distribution (log-softmax of its logits, before temperature, penalties,
    bias and constraints: vLLM's raw log-probabilities), so a token's value is the same whether a
    draft proposed it or the target picked it.
    """
    if not tokens:
        return []
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top:
        vals, ids = lp.topk(top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops, strict=True)]
