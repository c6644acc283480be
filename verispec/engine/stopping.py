"""When a request stops: stop conditions and streamed chunks of the engine's requests.

A step yields 1 to k + 1 tokens at once; they are appended one by one so that EOS, a stop string
or ``max_tokens`` hit in the middle of a step cut it exactly where plain decoding would have
stopped. Keeping this in one place is what makes a request's output the same alone or in a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from verispec.sampling import SamplingParams, TokenLogprob

Decode = Callable[[list[int]], str | None]


class StepTokens(list[int]):
    """The tokens one step added to an output, as ``on_tokens`` callbacks receive them.

    A plain list of token ids that also says where they came from: the first ``drafted`` are the
    drafter's proposals the target accepted; the rest (none or one) is the target's own token, the
    bonus after a fully accepted draft or the correction of the first rejected one. A stop
    condition may cut the step anywhere, so a cut chunk can consist of accepted drafts only.
    ``logprobs`` are their log-probabilities when the request asks for them.
    """

    def __init__(self, tokens: Iterable[int] = (), drafted: int = 0) -> None:
        super().__init__(tokens)
        if not 0 <= drafted <= len(self):
            raise ValueError(f"drafted must be in [0, {len(self)}], got {drafted}")
        self.drafted = drafted
        self.logprobs: list[TokenLogprob] | None = None  # one per token, when the request asks for them

    @classmethod
    def of(cls, new: Sequence[int], out: list[int], n_before: int) -> StepTokens:
        """What a step's ``new`` tokens (accepted drafts, then the target's token) added to ``out``.

        ``out`` (an output, or a whole sequence) held ``n_before`` tokens before :func:`append_tokens`
        appended a prefix of ``new``.
        """
        kept = out[n_before:]
        return cls(kept, min(len(kept), len(new) - 1))


def k_cap(k: int, params: SamplingParams, n_out: int, room: int) -> int:
    """The most drafts a step may score: ``k``, but never past ``max_tokens`` or the cache.

    A step drafting k tokens yields up to k + 1 and writes k + 1 positions, hence the -1s.
    """
    return max(0, min(k, params.max_tokens - n_out - 1, room - 1))


def hit_stop(out: list[int], stops: tuple[str, ...], decode: Decode) -> bool:
    """True when the decoded tail of ``out`` contains one of ``stops``."""
    # Only the tail can hold a stop string completed by the newest token.
    window = max(len(s) for s in stops) + 8
    text = decode(out[-window:]) or ""
    return any(s in text for s in stops)


def append_tokens(new: list[int], seq: list[int], start: int, params: SamplingParams, eos_ids: Collection[int],
                  decode: Decode) -> str | None:
    """Append a step's ``new`` tokens to ``seq`` (whose output begins at ``start``) up to the first stop condition.

    Returns the finish reason (``"stop"`` for EOS or a stop string, ``"length"`` for
    ``max_tokens``) or None to go on. EOS itself is not appended.
    """
    window = max((len(s) for s in params.stop), default=0) + 8
    for tok in new:
        if tok in eos_ids and not params.ignore_eos:
            return "stop"
        seq.append(tok)
        if params.stop and hit_stop(seq[max(start, len(seq) - window):], params.stop, decode):
            return "stop"
        if len(seq) - start >= params.max_tokens:
            return "length"
    return None


def final_text(text: str | None, stops: tuple[str, ...]) -> str | None:
    """The decoded output cut before the first stop string it contains."""
    if text is not None and stops:
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
    return text
