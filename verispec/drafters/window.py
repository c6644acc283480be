"""The part of a long prompt a draft model reads: its first few tokens and the last ``window``.

A draft model must read the whole prompt (a forward over every token, like the target's prefill)
before it can draft. On a long prompt with a short answer (retrieval-augmented QA, summaries)
that read can cost more than the drafting saves: the 0.5B Qwen draft reads a prompt for about a
third of what the 1.5B target's prefill costs. A draft only proposes, and the target verifies
every token against its own full context, so the draft may read less and the output stays exactly
the target's: a window trades some acceptance for a cheaper first draft.

The draft reads ``seq[:sink] + seq[sink + skip:]`` at contiguous positions: the first ``sink``
tokens (attention sinks, after StreamingLLM, Xiao et al. 2024: models park attention there, and
dropping them hurts more than dropping any other tokens) and everything from the last ``window``
prompt tokens on, generated tokens included. ``skip`` is fixed when the request begins.
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.config import check_draft_window

# Tokens kept from the start of a windowed prompt (StreamingLLM keeps 4).
SINK_TOKENS = 4


@dataclass(frozen=True)
class DraftWindow:
    """Which tokens of a request's sequence its draft model reads; the default reads them all."""

    sink: int = 0
    skip: int = 0  # tokens dropped after the sink

    @classmethod
    def for_prompt(cls, prompt_len: int, window: int | None) -> DraftWindow:
        """The view of a request whose prompt has ``prompt_len`` tokens; ``window`` None reads everything."""
        check_draft_window(window)
        if window is None or prompt_len <= window + SINK_TOKENS:
            return cls()
        return cls(SINK_TOKENS, prompt_len - window - SINK_TOKENS)

    def view(self, seq: list[int]) -> list[int]:
        """The tokens of ``seq`` the draft reads, in order (positions 0, 1, ... in the draft's cache)."""
        if not self.skip:
            return seq
        return seq[: self.sink] + seq[self.sink + self.skip:]

    def draft_len(self, n: int) -> int:
        """How many of the draft's tokens the first ``n`` tokens of the sequence hold."""
        return n if n <= self.sink else max(self.sink, n - self.skip)
