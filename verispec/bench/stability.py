"""The stability suite: awkward inputs every method must survive and decode exactly like plain decoding.

Each case runs greedily with a small ``max_tokens`` (so nothing can run long) and a wall-clock
deadline enforced through the streaming callback, which cancels a request that overruns it:
a cancelled request fails the case as a hang. A case passes for a method when the method
returns plain decoding's exact tokens, or, where the input is invalid, raises the same clear
:class:`VerispecError` as plain decoding does.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from verispec.bench.methods import BASELINE, Method
from verispec.config import PLAIN, SpecConfig
from verispec.drafters.base import Drafter, Proposal
from verispec.engine.engine import Engine, GenerationResult, Prompt
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

NULL_DRAFTER = "null-drafter"


class NullDrafter(Drafter):
    """Proposes nothing, ever: every step must fall back to the target's own token."""

    name = "null"

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        return Proposal([])


@dataclass(frozen=True)
class StabilityCase:
    """One input of the suite. ``expect_error``: the engine must refuse it with a VerispecError."""

    name: str
    prompt: Prompt
    chat: bool
    max_tokens: int = 16
    expect_error: bool = False
    description: str = ""


@dataclass(frozen=True)
class CaseResult:
    """One case on one method."""

    case: str
    method: str
    passed: bool
    detail: str
    wall_s: float
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


SPECIAL = "<|im_start|> </s> <s> {{ x }} {% if %} \\n \\t \" ' ` ~ $ ^ & * | \\ / [] {} <> @# %% ;; ... ???"
EMOJI = "Rocket 🚀, fire 🔥, family 👩‍👩‍👧‍👦, flags 🇩🇪🇯🇵, skin tones 👍🏽, keycap 1️⃣ — what do they mean?"
CONTROL = "bell\x07 null\x00 escape\x1b[31m red\x1b[0m tab\t cr\r formfeed\x0c del\x7f end"
MIXED = "English, русский, 中文, العربية, हिन्दी, 日本語, עברית, ελληνικά, 한국어, ไทย: say hello in each."


def cases(engine: Engine, max_tokens: int = 16) -> list[StabilityCase]:
    """The suite for ``engine``: its context limit decides the two length cases."""
    chat = bool(engine.tokenizer is not None and engine.tokenizer.chat_template)
    limit = engine.max_len
    vocab = engine.target.args.vocab_size
    if engine.tokenizer is not None:
        filler = engine.encode("The quick brown fox jumps over the lazy dog, then writes some code. ")
    else:
        filler = [(7 * i + 3) % vocab for i in range(64)]
    filler = filler or [0]

    def ids(n: int) -> list[int]:
        return (filler * (n // len(filler) + 1))[:n]

    near = max(1, limit - max(2, max_tokens // 2))
    out = [
        StabilityCase("near_context_limit", ids(near), False, max_tokens,
                      description=f"{near} prompt tokens in a {limit}-position context: stops at the limit"),
        StabilityCase("over_context_limit", ids(limit + 1), False, max_tokens, expect_error=True,
                      description=f"{limit + 1} prompt tokens: must be refused with a clear error"),
    ]
    if engine.tokenizer is not None:
        out += [
            StabilityCase("special_characters", SPECIAL, chat, max_tokens, description="template-like markup"),
            StabilityCase("emoji", EMOJI, chat, max_tokens, description="multi-codepoint emoji"),
            StabilityCase("control_characters", CONTROL, chat, max_tokens, description="NUL, ESC, BEL, DEL"),
            StabilityCase("mixed_scripts", MIXED, chat, max_tokens, description="ten scripts in one prompt"),
            StabilityCase("empty_prompt", "", chat, max_tokens, description="an empty user message"),
            StabilityCase("max_tokens_1", "Write a haiku about the sea.", chat, 1, description="max_tokens 1"),
            StabilityCase(NULL_DRAFTER, "Count from one to twenty.", chat, max_tokens,
                          description="a drafter that never proposes"),
        ]
    else:
        out += [
            StabilityCase("max_tokens_1", ids(8), False, 1, description="max_tokens 1"),
            StabilityCase(NULL_DRAFTER, ids(8), False, max_tokens, description="a drafter that never proposes"),
        ]
    return out


def _run(engine: Engine, case: StabilityCase, method: Method | None, deadline_s: float
         ) -> tuple[GenerationResult | None, VerispecError | None, float]:
    """Generate ``case`` with ``method`` (None: the null drafter); a VerispecError is returned, not raised."""
    params = SamplingParams(max_tokens=case.max_tokens)
    t0 = time.perf_counter()

    def within_deadline(_index: int, _tokens: list[int]) -> bool:
        return time.perf_counter() - t0 < deadline_s

    try:
        if method is None:
            # Any enabled spec will do: the drafter argument replaces the one the spec names; k = 5 applies.
            res = engine.generate(case.prompt, params, SpecConfig("ngram", 5, "fixed"), chat=case.chat,
                                  drafter=NullDrafter(),
                                  on_tokens=within_deadline)[0]
        else:
            res = engine.generate(case.prompt, params, method.spec, chat=case.chat, on_tokens=within_deadline)[0]
        return res, None, time.perf_counter() - t0
    except VerispecError as e:
        return None, e, time.perf_counter() - t0


def _judge(case: StabilityCase, res: GenerationResult | None, err: VerispecError | None,
           plain: GenerationResult | None, plain_err: VerispecError | None) -> tuple[bool, str]:
    if case.expect_error:
        return (True, f"refused: {err}") if err is not None else (False, "accepted an input it must refuse")
    if err is not None:
        if plain_err is not None:
            return True, f"refused like plain decoding: {err}"
        return False, f"error where plain decoding succeeded: {err}"
    assert res is not None
    if res.finish_reason == "cancelled":
        return False, "hang: overran the deadline and was cancelled"
    if len(res.token_ids) > case.max_tokens:
        return False, f"{len(res.token_ids)} tokens for max_tokens {case.max_tokens}"
    if plain_err is not None:
        return False, f"succeeded where plain decoding refused ({plain_err})"
    if plain is not None and res.token_ids != plain.token_ids:
        return False, f"tokens differ from plain decoding ({len(res.token_ids)} vs {len(plain.token_ids)})"
    return True, f"{len(res.token_ids)} tokens, finish {res.finish_reason}"


def run_suite(engine: Engine, methods: list[Method], max_tokens: int = 16, deadline_s: float = 300.0,
              progress: bool = True) -> list[CaseResult]:
    """Every case on plain decoding and every method; any exception other than VerispecError fails the case."""
    from tqdm import tqdm

    results = []
    speculative = [m for m in methods if not m.is_baseline]
    suite = cases(engine, max_tokens)
    for case in tqdm(suite, desc="stability", unit="case", disable=not progress or None):
        runs: list[tuple[str, Method | None]] = [(BASELINE, Method(BASELINE, PLAIN))]
        runs += [(NULL_DRAFTER, None)] if case.name == NULL_DRAFTER else [(m.label, m) for m in speculative]
        plain = plain_err = None
        for label, method in runs:
            try:
                res, err, wall = _run(engine, case, method, deadline_s)
            except Exception as e:  # noqa: BLE001 (a crash is exactly what this suite reports)
                results.append(CaseResult(case.name, label, False, f"crash: {type(e).__name__}: {e}", 0.0, 0))
                continue
            if label == BASELINE:
                plain, plain_err = res, err
            ok, detail = _judge(case, res, err, None if label == BASELINE else plain, plain_err)
            results.append(CaseResult(case.name, label, ok, detail, wall, len(res.token_ids) if res else 0))
    return results
