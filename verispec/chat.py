"""``verispec chat``: a conversation with a model in the terminal, answers streamed as they are verified.

The history is a list of role/content messages sent through the model's chat template on every
turn. On a terminal, tokens the drafter proposed and the target accepted are printed in green and
the target's own tokens (one per step) plain, so speculation can be watched at work.

Ctrl-C stops an answer after the step being computed; the answer stays in the history as it was
printed. A second Ctrl-C abandons the turn at once: the question and the partial answer are
dropped. When the conversation and an answer of ``max_tokens`` no longer fit the context, the
oldest exchanges are dropped (the system prompt stays), with a notice.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from verispec.config import SpecConfig
from verispec.console import ACCEPTED, RESET, AnswerPrinter, dim, use_colour
from verispec.constraints import Constraint
from verispec.engine.engine import Engine, GenerationResult
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

PROMPT = ">>> "
HELP = """/stats   cumulative figures: answers, tokens, tokens/s, acceptance, mean accepted length
/reset   forget the conversation (the system prompt stays)
/edit FILE  the next message quotes FILE in a code block, and FILE's text is the answer's predicted output
            (drafted where the answer repeats it: edits of that file come back fast)
/help    this list
/exit    leave (Ctrl-D too)
Ctrl-C stops an answer (kept as shown); twice drops the whole exchange."""


def answer_line(m: Metrics, finish: str) -> str:
    """One answer's figures: tokens, tokens/s, acceptance and mean accepted length."""
    acceptance = f"{m.acceptance_rate:.0%}" if m.drafted else "-"
    line = (f"[{m.generated_tokens} tokens, {m.tokens_per_s:.1f} tokens/s, acceptance {acceptance}, "
            f"mean accepted length {m.mean_accepted_length:.2f}")
    if m.accepted_prediction_tokens or m.rejected_prediction_tokens:
        line += f", prediction {m.accepted_prediction_tokens} accepted / {m.rejected_prediction_tokens} rejected"
    return line + ("]" if finish == "stop" else f", finish: {finish}]")


def stats_text(m: Metrics) -> str:
    """Cumulative figures over every answer so far."""
    acceptance = f"{m.acceptance_rate:.1%} ({m.accepted} of {m.drafted} drafted tokens)" if m.drafted else "-"
    return (f"answers: {m.requests}\n"
            f"tokens: {m.generated_tokens} in {m.total_s:.2f} s, {m.tokens_per_s:.1f} tokens/s\n"
            f"acceptance: {acceptance}\n"
            f"mean accepted length: {m.mean_accepted_length:.2f} tokens per target forward")


class Chat:
    """A conversation with ``engine``: :meth:`ask` answers one message, :meth:`run` is the REPL.

    ``colour`` defaults to :func:`~verispec.console.use_colour` of ``out``.
    """

    def __init__(self, engine: Engine, params: SamplingParams, spec: SpecConfig, system: str | None = None,
                 out: TextIO | None = None, err: TextIO | None = None, colour: bool | None = None,
                 constraint: Constraint | None = None) -> None:
        tok = engine.tokenizer
        if tok is None or not tok.chat_template:
            raise VerispecError(f"{engine.config.model} has no chat template; `verispec chat` needs a chat model "
                                "(use `verispec generate --raw` for plain completion)")
        if params.max_tokens >= engine.max_len:
            raise VerispecError(f"--max-tokens {params.max_tokens} leaves no room for a question in a context of "
                                f"{engine.max_len} tokens (--max-len)")
        self.engine, self.params, self.spec, self.constraint = engine, params, spec, constraint
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.colour = use_colour(self.out) if colour is None else colour
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, str]] = list(self.system)
        self.total = Metrics()
        self._cancelled = False
        self.attached: str | None = None  # /edit: the file text the next message quotes and predicts

    # -- one turn -------------------------------------------------------------------------

    def ask(self, text: str) -> GenerationResult | None:
        """Answer ``text`` in the conversation, streaming to ``out``; None if the turn was dropped.

        A file attached by ``/edit`` is quoted after ``text`` and is the answer's predicted output.
        """
        prediction, self.attached = self.attached, None
        if prediction is not None:
            text = f"{text}\n\n```\n{prediction}\n```"
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._prompt_ids()
        except VerispecError as e:
            self.messages.pop()
            self._error(str(e))
            return None
        printer = AnswerPrinter(self.engine.tokenizer, self.params.stop, self.out, self.colour)

        def on_tokens(_: int, tokens: list[int]) -> bool:
            printer.push(tokens)
            return not self._cancelled

        self._cancelled = False
        try:
            with self._sigint():
                result = self.engine.generate(ids, self.params, self.spec, on_tokens=on_tokens,
                                              prediction=prediction, constraint=self.constraint)[0]
            printer.finish(result.text)
            self.out.write("\n")
            self.messages.append({"role": "assistant", "content": result.text or ""})
        except KeyboardInterrupt:
            self.messages.pop()
            self._say("\n" + dim("[interrupted: this question and its partial answer are dropped]", self.colour))
            return None
        except VerispecError as e:
            self.messages.pop()
            self._error(str(e))
            return None
        self.total.merge(result.metrics)
        self._say(dim(answer_line(result.metrics, result.finish_reason), self.colour))
        return result

    def cancel(self) -> None:
        """Stop the answer being generated after its current step (what Ctrl-C does)."""
        self._cancelled = True

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""
        self.messages = list(self.system)

    def _prompt_ids(self) -> list[int]:
        """The conversation's token ids; the oldest exchanges are dropped while it leaves no room for an answer."""
        max_len, dropped = self.engine.max_len, 0
        while True:
            try:
                ids = self.engine.encode(self.messages)
            except VerispecError:  # longer than the whole context
                if not self._drop_oldest():
                    raise
            else:
                if len(ids) + self.params.max_tokens <= max_len or not self._drop_oldest():
                    break  # fits, or is the question alone: the answer gets the room there is
            dropped += 1
        if dropped:
            self._say(dim(f"[the conversation outgrew the context of {max_len} tokens: dropped the oldest "
                          f"{dropped} exchange{'s' if dropped > 1 else ''}]", self.colour))
        return ids

    def _drop_oldest(self) -> bool:
        """Remove the oldest question and its answer, never the system prompt or the question being asked."""
        start = len(self.system)
        if len(self.messages) - start < 2:
            return False
        end = start + 1
        while end < len(self.messages) - 1 and self.messages[end]["role"] != "user":
            end += 1
        del self.messages[start:end]
        return True

    @contextmanager
    def _sigint(self) -> Iterator[None]:
        """While generating: a first Ctrl-C cancels after the current step, a second one interrupts."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:
            if self._cancelled:
                raise KeyboardInterrupt
            self.cancel()

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    # -- the REPL -------------------------------------------------------------------------

    def handle(self, line: str) -> bool:
        """Act on one input line (a message or a command); False when the user leaves."""
        line = line.strip()
        if not line:
            return True
        if not line.startswith("/"):
            self.ask(line)
            return True
        command = line.split()[0].lower()
        if command in ("/exit", "/quit"):
            return False
        if command == "/stats":
            self._say(stats_text(self.total))
        elif command == "/reset":
            self.reset()
            self._say(dim("[conversation cleared]", self.colour))
        elif command == "/edit":
            self._attach(line.split(maxsplit=1)[1] if len(line.split(maxsplit=1)) > 1 else "")
        elif command == "/help":
            self._say(HELP)
        else:
            self._error(f"unknown command {command}; /help lists them")
        return True

    def run(self, read: Callable[[str], str] = input) -> int:
        """Read lines until Ctrl-D or /exit; returns the exit status (0)."""
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        banner = dim(f"verispec chat with {self.engine.config.model} ({self._method()})", self.colour)
        if self.colour and self.spec.enabled:
            banner += dim(", accepted drafts in ", True) + f"{ACCEPTED}green{RESET}"
        self._say(banner + dim(". /help for commands, Ctrl-D to leave.", self.colour))
        while True:
            try:
                line = read(PROMPT)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, like a shell
                self.out.write("\n")
                continue
            try:
                if not self.handle(line):
                    return 0
            except KeyboardInterrupt:  # outside generation: a question never stays without its answer
                if len(self.messages) > len(self.system) and self.messages[-1]["role"] == "user":
                    self.messages.pop()
                self.out.write("\n")

    def _attach(self, path: str) -> None:
        if not path:
            self._error("/edit needs a file: /edit path/to/file")
            return
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8").rstrip("\n")
        except (OSError, UnicodeDecodeError) as e:
            self._error(f"/edit: cannot read {path}: {e}")
            return
        self.attached = text
        self._say(dim(f"[{path} attached: your next message quotes it, and the answer is drafted from it]",
                      self.colour))

    def _method(self) -> str:
        return f"{self.spec.method}, k={self.spec.k}" if self.spec.enabled else "plain decoding"

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _error(self, message: str) -> None:
        self.out.flush()
        self.err.write(f"verispec: error: {message}\n")
        self.err.flush()
