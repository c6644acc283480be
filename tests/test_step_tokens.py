"""What ``on_tokens`` callbacks learn of each step: which of its tokens were accepted drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
from drafters_common import build_tok_model

from verispec import Engine, SamplingParams, SpecConfig
from verispec.drafters.base import Drafter, Proposal
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.request import Request
from verispec.engine.stopping import StepTokens

# The draft model is the target itself: every draft is accepted, so each step is k drafts and one bonus token.
SELF_DRAFT = SpecConfig(method="draft", k=3, k_policy="fixed")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder: Path = build_tok_model(tmp_path_factory.mktemp("step_model"))
    return Engine.from_pretrained(str(folder), draft=str(folder), dtype="float32", max_len=128, progress=False)


def test_step_tokens_count_the_accepted_drafts_a_cut_step_keeps():
    out = [9, 9]
    new = [5, 6, 7, 8]  # three accepted drafts, then the target's token
    full = StepTokens.of(new, [*out, *new], 2)
    assert full == new and full.drafted == 3
    cut = StepTokens.of(new, [*out, 5, 6], 2)  # a stop string after the second draft
    assert cut == [5, 6] and cut.drafted == 2
    assert StepTokens.of([4], [*out, 4], 2).drafted == 0  # plain decoding: the target's token only
    assert StepTokens.of([4], out, 2) == [] and StepTokens.of([4], out, 2).drafted == 0  # EOS
    with pytest.raises(ValueError):
        StepTokens([1, 2], drafted=3)


def test_a_self_drafting_step_marks_all_but_its_last_token_accepted(engine):
    chunks: list[StepTokens] = []
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    result = engine.generate("hello world", params, SELF_DRAFT, chat=True,
                             on_tokens=lambda _, t: chunks.append(t))[0]
    assert sum(chunks, []) == result.token_ids and result.metrics.acceptance_rate == 1.0
    assert [len(c) for c in chunks] == [4, 4, 4, 2]  # the last step's k is capped by max_tokens
    assert all(c.drafted == len(c) - 1 for c in chunks)

    # A stop string on a drafted token cuts its step: the chunk then holds accepted drafts only.
    words = [engine.decode([t]) for t in result.token_ids]
    j = next(j for j in range(12) if j % 4 != 3 and words[j] and not any(words[j] in w for w in words[:j]))
    cut: list[StepTokens] = []
    stopped = engine.generate("hello world", SamplingParams(max_tokens=14, ignore_eos=True, stop=(words[j],)),
                              SELF_DRAFT, chat=True, on_tokens=lambda _, t: cut.append(t))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == j + 1
    assert len(cut[-1]) == j % 4 + 1 and cut[-1].drafted == len(cut[-1])


class WrongSecond(Drafter):
    """The target's own greedy draft (a one-slot draft runner over the engine's draft model, the target
    itself) with its second token changed: each step accepts one draft exactly."""

    def __init__(self, engine: Engine) -> None:
        self.vocab = engine.target.args.vocab_size
        self.inner = DraftRunner(engine.draft, 1, engine.max_len + 128, self.vocab)

    def begin(self, prompt: list[int]) -> None:
        self.inner.release(0)
        self.inner.begin(0, prompt)

    def propose(self, seq, k, params, generator) -> Proposal:
        tokens = list(self.inner.propose([Request(seq, params, slot=0, k=k, generator=generator)])[0].tokens)
        if len(tokens) > 1:
            tokens[1] = (tokens[1] + 1) % self.vocab
        return Proposal(tokens)

    def commit(self, n_valid: int) -> None:
        self.inner.commit(0, n_valid)


def test_callbacks_count_exactly_the_accepted_drafts(engine):
    """With a drafter that is partly wrong, each chunk marks its accepted drafts, and they add up to the metrics'."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    drafter = WrongSecond(engine)
    chunks: list[StepTokens] = []
    m = engine.generate("hello world", params, SELF_DRAFT, chat=True, drafter=drafter,
                        on_tokens=lambda _, t: chunks.append(t))[0].metrics
    assert [(len(c), c.drafted) for c in chunks] == [(2, 1)] * 6  # one accepted draft, then the correction
    assert m.accepted == sum(c.drafted for c in chunks) == 6 < m.drafted

    batch_chunks: list[StepTokens] = []
    be = engine.with_config(max_batch=2)
    handle = be.submit("hello world", params, SELF_DRAFT, chat=True, on_tokens=batch_chunks.append)
    be.run_until_done()
    bm = handle.result().metrics
    assert [(len(c), c.drafted) for c in batch_chunks] == [(4, 3)] * 3
    assert sum(c.drafted for c in batch_chunks) == bm.accepted
