"""What a request changes in the target's distribution before any token is picked: logit bias, presence
and frequency penalties, and a grammar (a JSON schema, JSON mode, a regex or a Lark grammar).

Speculation stays exact under these because each is a function of the tokens before a position, and
every scored position is processed with the tokens before it *on its own path*: the output so far plus
the draft tokens ahead of it (:meth:`RowLogits.apply`). Position i of a chain [d1..dk] is processed as
if d1..d(i-1) had been emitted; the draft model drafts under the same processing (its q is then the
processed draft distribution it really drew from). Verification compares processed p with q, so the
output is the processed target's, token for token under greedy and in distribution under sampling.

Grammar matching uses llguidance (one :class:`GrammarTokenizer` per tokenizer, one matcher per
request). A request's matcher only ever moves forward with the output; a step's draft paths are walked on
copies of it. A draft token the grammar refuses is never scored past: a deterministic draft (a
lookup) is cut before it; a sampled draft keeps it, since cutting would make the position's outcome
depend on which way its own draw fell: verification rejects it (p = 0) and draws from the residual.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

ConstraintKind = Literal["json_schema", "json_object", "regex", "lark", "llguidance"]
# Finish reason of a request whose grammar allows no token and cannot end (it can only arise from a
# grammar that allows nothing at some point, e.g. an unsatisfiable schema).
DEAD_END = "constraint_dead_end"


class ConstraintError(VerispecError):
    """A constraint that cannot be compiled (an invalid schema, regex or grammar, an unsupported feature)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover (a dependency; a broken install)
        raise ConstraintError("constraints need the llguidance package (pip install llguidance)") from e
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow, checked when built (:class:`ConstraintError` if it cannot compile).

    ``kind``: ``json_schema`` (``source`` is the schema as JSON text), ``json_object`` (any JSON
    object), ``regex`` (the whole output matches it) or ``lark`` (llguidance's Lark dialect, which
    also embeds JSON schemas with ``%json``), or ``llguidance`` (a grammar already in llguidance's own
    format, as its ``grammar_from_*`` functions return). The output ends when the grammar is complete.
    """

    kind: ConstraintKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "regex", "lark", "llguidance"):
            raise ConstraintError(f"unknown constraint kind {self.kind!r} (json_schema, json_object, regex, lark "
                                  "or llguidance)")
        if not isinstance(self.source, str):
            raise ConstraintError(f"a {self.kind} constraint is given as text, not {type(self.source).__name__}")
        error = _llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ConstraintError(f"invalid {self.kind.replace('_', ' ')}: {error.strip()}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        """Output is JSON valid under ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema is an object, not {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        """Output is one JSON object (OpenAI's JSON mode)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        return cls("lark", grammar)

    def grammar(self) -> str:
        """The llguidance grammar this constraint compiles to."""
        m = _llguidance().LLMatcher
        if self.kind == "json_schema":
            try:
                return m.grammar_from_json_schema(self.source)
            except ValueError as e:
                raise ConstraintError(f"invalid JSON schema: {e}") from e
        if self.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"})
        if self.kind == "llguidance":
            return self.source
        return m.grammar_from_regex(self.source) if self.kind == "regex" else m.grammar_from_lark(self.source)


class GrammarTokenizer:
    """A tokenizer as llguidance sees it (building one takes a few seconds: an engine keeps one).

    ``vocab_size`` is the model's (its embedding may have padding rows past the tokenizer's); any of
    ``eos_ids`` ends a complete grammar.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        llg = _llguidance()
        import llguidance.hf

        self.vocab_size = vocab_size
        self._llg = llg
        try:
            self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except (ValueError, TypeError, AttributeError) as e:
            raise ConstraintError(f"this model's tokenizer cannot be used for constraints: {e}") from e
        # The first mask on a tokenizer builds llguidance's token tables (about 2 s for 150k tokens): pay it here.
        self.matcher(Constraint.json_object()).compute_bitmask()

    def matcher(self, constraint: Constraint) -> Any:
        m = self._llg.LLMatcher(self.ll, constraint.grammar(), log_level=0)
        if m.is_error():
            raise ConstraintError(f"invalid {constraint.kind.replace('_', ' ')}: {m.get_error()}")
        return m


def processes(params: SamplingParams) -> bool:
    """True when ``params`` change the target's logits (penalties or logit bias)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias)


class RowLogits:
    """One request's processing of the target's logits: bias, penalties and its grammar matcher.

    Penalties count the output's tokens (not the prompt's), as vLLM does: ``presence_penalty`` is
    subtracted once from every token that has appeared, ``frequency_penalty`` once per appearance;
    ``logit_bias`` is added to its tokens. They apply to the logits, before temperature.
    """

    def __init__(self, params: SamplingParams, prompt_len: int, vocab_size: int, matcher: Any | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.prompt_len, self.vocab_size, self.matcher = prompt_len, vocab_size, matcher
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.penalties = bool(self.presence or self.frequency)
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)
            ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
            self.bias[ids] = torch.tensor([b for _, b in params.logit_bias], device=device)
        self.counts = torch.zeros(vocab_size, device=device) if self.penalties else None
        self._seen = 0  # output tokens folded into the counts and the matcher
        self._now: tuple[int, torch.Tensor] | None = None  # (self._seen, the bitmask there)
        self.seconds = 0.0  # spent in masks and penalties

    @property
    def grammar(self) -> bool:
        return self.matcher is not None

    def _sync(self, seq: list[int]) -> None:
        new = seq[self.prompt_len + self._seen:]
        if not new:
            return
        if self.counts is not None:
            self.counts.index_add_(0, torch.tensor(new, device=self.counts.device),
                                   torch.ones(len(new), device=self.counts.device))
        if self.matcher is not None and not self.matcher.consume_tokens(new):
            # Only an output the grammar allowed is ever appended; a refusal here is a matcher fault.
            raise RuntimeError(f"the grammar refused an emitted token: {self.matcher.get_error()}")
        self._seen += len(new)

    def allowed(self, seq: list[int], draft: list[int]) -> int:
        """How many leading tokens of ``draft`` the grammar accepts after ``seq``."""
        if self.matcher is None:
            return len(draft)
        t0 = time.perf_counter()
        self._sync(seq)
        n = self.matcher.validate_tokens(draft)
        self.seconds += time.perf_counter() - t0
        return n

    def finish_reason(self, seq: list[int]) -> str | None:
        """``"stop"`` once the grammar is complete (only the end can follow), :data:`DEAD_END` when it
        allows nothing, else None."""
        if self.matcher is None:
            return None
        t0 = time.perf_counter()
        self._sync(seq)
        self._now = (self._seen, self._masks([[]])[0])  # a dead end shows once the mask is computed; the step reuses it
        self.seconds += time.perf_counter() - t0
        if self.matcher.is_error():
            return DEAD_END
        if self.matcher.is_stopped():  # nothing but the end can follow: complete, or stuck short of it
            return "stop" if self.matcher.is_accepting() else DEAD_END
        return None

    def apply(self, logits: torch.Tensor, seq: list[int], paths: list[list[int]]) -> torch.Tensor:
        """Processed ``logits`` ``[n, V]`` (a new tensor): row i as if ``seq`` were followed by ``paths[i]``.

        A path the grammar refuses (a sampled draft's refused token; see the module) leaves its row
        without a mask: that row is never used.
        """
        t0 = time.perf_counter()
        self._sync(seq)
        out = logits.float().clone()
        if self.bias is not None:
            out += self.bias
        if self.counts is not None:
            self._penalize(out, paths)
        if self.matcher is not None:
            out.masked_fill_(~self._allowed(paths).to(out.device), float("-inf"))
        self.seconds += time.perf_counter() - t0
        return out

    def _penalize(self, out: torch.Tensor, paths: list[list[int]]) -> None:
        counts = self.counts
        assert counts is not None
        out -= self.frequency * counts + self.presence * (counts > 0)
        for i, path in enumerate(paths):
            extra: dict[int, int] = {}
            for t in path:
                extra[t] = extra.get(t, 0) + 1
            for t, c in extra.items():
                out[i, t] -= self.frequency * c + (self.presence if counts[t] == 0 else 0.0)

    def _allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """``[n, V]`` bool: the tokens the grammar allows after each path (all, for a refused path)."""
        bits = self._masks(paths)
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(unpacked[:, : self.vocab_size]).bool()

    def _masks(self, paths: list[list[int]]) -> torch.Tensor:
        """The grammar's bitmask ``[n, ceil(V / 32)]`` after each path (all ones for a refused path).

        Paths are walked on copies of the matcher (a few microseconds each), never by consuming and rolling
        back on the request's own: its state only ever moves forward with the output. A chain's paths extend
        one another, so one copy walks them all.
        """
        bits = torch.full((len(paths), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        walker, walked, refused = None, [], False
        for i, path in enumerate(paths):
            if not path:
                if self._now is not None and self._now[0] == self._seen:
                    bits[i] = self._now[1]
                else:
                    _fill_mask(self.matcher, bits, i)
                continue
            if walker is None or path[: len(walked)] != walked or refused:
                walker, walked, refused = self.matcher.deep_copy(), [], False
            rest = path[len(walked):]
            taken = walker.try_consume_tokens(rest)
            walked = walked + rest[:taken]
            refused = taken < len(rest)
            if not refused:
                _fill_mask(walker, bits, i)
        return bits


def _fill_mask(matcher: Any, bits: torch.Tensor, i: int) -> None:
    """Write ``matcher``'s next-token bitmask into row ``i`` of ``bits`` (int32, contiguous, on the CPU).

    llguidance.torch has this helper, but importing that module imports torch.compile: about 2 s added to the
    first constrained request of every process.
    """
    row = bits[i]
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
