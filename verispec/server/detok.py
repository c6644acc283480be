"""Incremental detokenization for streaming: emit only text that later tokens cannot change.

Byte-level tokenizers split multi-byte UTF-8 characters across tokens, so decoding a prefix
can end in U+FFFD that the next token turns into a real character. Stop strings add a second
reason to wait: text that might be the start of a stop string must not be sent before we
know, because the final text is cut at the stop string.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Decodes only a short window (from the last clean boundary) per push, so the cost stays
    flat as the output grows. Joined, the deltas plus :meth:`flush` equal decoding all ids.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: a boundary where decoding was clean
        self._read = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty)."""
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """Everything not yet emitted, an unfinished character included (the output has ended)."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


class StreamText:
    """Text deltas for a streamed choice: stable text minus anything a stop string may still claim.

    While generating, the last ``max(len(stop)) - 1`` characters are held back and nothing at
    or past a stop string is sent. :meth:`finish` sends the rest of the engine's final text,
    which is cut at the first stop string, so the deltas always join to exactly that text.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._sent = 0

    @property
    def decoded(self) -> int:
        """Characters of stable text so far, sent or still held back: where the next push's text starts."""
        return len(self._text)

    def push(self, token_ids: list[int]) -> str:
        """Add a step's tokens; return the text that can be sent now."""
        self._text += self._detok.push(token_ids)
        limit = len(self._text) - self._hold
        for s in self._stop:
            i = self._text.find(s)
            if i >= 0:
                limit = min(limit, i)
        if limit <= self._sent:
            return ""
        delta, self._sent = self._text[self._sent:limit], limit
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's complete text) after what was already sent."""
        sent = self._text[:self._sent]
        if not final_text.startswith(sent):  # cannot happen with a consistent tokenizer; never repeat text
            return ""
        self._sent = len(final_text)
        return final_text[len(sent):]
