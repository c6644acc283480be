"""Printing an answer as it streams: stable text only, accepted drafts optionally in colour.

Text goes through the server's :class:`~verispec.server.detok.StreamText`, so a character split
across tokens is printed whole and text a stop string may still cut is held back: what is printed
always joins to the engine's final text. With colour on, the text the drafter's accepted proposals
decoded to is green; the target's own tokens (the bonus or the correction ending each step) are
printed plain.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from typing import Any, TextIO

from verispec.server.detok import StreamText

ACCEPTED = "\x1b[32m"  # green: tokens the drafter proposed and the target accepted
DIM = "\x1b[2m"
RESET = "\x1b[0m"


def use_colour(stream: TextIO) -> bool:
    """ANSI colour on a terminal unless ``NO_COLOR`` is set to anything but the empty string."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def dim(text: str, colour: bool) -> str:
    """``text`` dimmed when ``colour`` is on (figures and notices, set apart from answers)."""
    return f"{DIM}{text}{RESET}" if colour else text


class AnswerPrinter:
    """Writes one answer to ``out`` as its tokens arrive; ``shown`` is everything written, without colour.

    Feed it every step's tokens with :meth:`push` (or pass :meth:`on_tokens` as the engine's
    callback), then call :meth:`finish` with the result's text, which prints what was held back.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), out: TextIO | None = None,
                 colour: bool = False) -> None:
        self._stream = StreamText(tokenizer, stop)
        self._out = out
        self._colour = colour
        # Stretches of the decoded text, as (end position, made by accepted drafts), merged when alike;
        # positions count characters of the stream's text, the coordinates of what is shown.
        self._runs: deque[tuple[int, bool]] = deque()
        self.shown = ""

    def push(self, tokens: Sequence[int]) -> None:
        """Print what a step's tokens make printable; their ``drafted`` attribute, if any, picks the colour."""
        if not self._colour:
            self._write(self._stream.push(list(tokens)))
            return
        drafted = getattr(tokens, "drafted", 0)
        for part, accepted in ((tokens[:drafted], True), (tokens[drafted:], False)):
            if not part:
                continue
            delta = self._stream.push(list(part))
            end = self._stream.decoded
            if self._runs and self._runs[-1][1] == accepted:
                self._runs.pop()
            self._runs.append((end, accepted))
            self._write(delta)

    def on_tokens(self, _: int, tokens: Sequence[int]) -> None:
        """:meth:`push` with the signature of :meth:`Engine.generate`'s ``on_tokens``."""
        self.push(tokens)

    def finish(self, text: str | None) -> None:
        """Print the rest of the engine's final ``text`` (None, as for a model without a tokenizer, prints nothing)."""
        if text is not None:
            self._write(self._stream.finish(text))

    def _write(self, delta: str) -> None:
        if not delta:
            return
        start, end = len(self.shown), len(self.shown) + len(delta)
        self.shown += delta
        if self._colour:
            pieces, pos = [], start
            while pos < end and self._runs:
                run_end, accepted = self._runs[0]
                if run_end <= pos:
                    self._runs.popleft()
                    continue
                stop = min(run_end, end)
                piece = self.shown[pos:stop]
                pieces.append(f"{ACCEPTED}{piece}{RESET}" if accepted else piece)
                pos = stop
            pieces.append(self.shown[pos:end])  # past every run: only the final text's remainder
            delta = "".join(pieces)
        if self._out is not None:
            self._out.write(delta)
            self._out.flush()
