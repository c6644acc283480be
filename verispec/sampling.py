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


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution (fp32) under ``params``.

    Greedy maps to a one-hot distribution on the argmax, so greedy and sampled decoding can
    share the verification code.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
