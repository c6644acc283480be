"""A draft window (``window=N``): the draft model reads a long prompt's first 4 and last N tokens.

The view is exact bookkeeping (which tokens, which cache lengths); a windowed row of the draft
runner drafts exactly what an unwindowed one drafts for the view, alone or among other rows;
speculation with it stays lossless (greedy token for token alone and batched, sampling by
chi-square); the k policy is charged only the window's catch-up; bad values are VerispecErrors.
"""

from __future__ import annotations

import pytest
import torch
from drafters_common import GREEDY, PROMPTS, chi_square_p, exact_first_two, make_engine, sampled_first_two
from tiny import make_tiny

from verispec import SamplingParams, SpecConfig, VerispecError
from verispec.bench.methods import parse_method
from verispec.config import DEFAULT_SPEC, check_draft_window
from verispec.drafters.window import SINK_TOKENS, DraftWindow
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.request import Request
from verispec.models.loader import build_model, open_source

W = 8
# 40- and 30-token prompts (longer than the window plus the sink) with repeats, and the short shared ones.
LONG = [(7 * i) % 50 + 2 for i in range(40)]
LONGER = [(11 * i) % 60 + 2 for i in range(30)]
WINDOW_PROMPTS = [LONG, LONGER, *PROMPTS]


def test_the_view_keeps_the_sink_and_the_window():
    assert DraftWindow.for_prompt(40, None) == DraftWindow()
    assert DraftWindow.for_prompt(W + SINK_TOKENS, W) == DraftWindow()  # short enough: read it all
    win = DraftWindow.for_prompt(40, W)
    assert (win.sink, win.skip) == (SINK_TOKENS, 40 - W - SINK_TOKENS)
    seq = list(range(45))  # the prompt and 5 generated tokens
    assert win.view(seq) == [0, 1, 2, 3, *range(32, 45)]
    assert win.draft_len(40) == SINK_TOKENS + W and win.draft_len(45) == SINK_TOKENS + W + 5
    assert win.draft_len(2) == 2 and win.draft_len(20) == SINK_TOKENS  # inside the sink, inside the skipped part
    assert DraftWindow().view(seq) is seq and DraftWindow().draft_len(45) == 45


@pytest.fixture(scope="module")
def engine(noisy_pair_engine):
    return noisy_pair_engine


@pytest.fixture(scope="module")
def plain(engine):
    return [r.token_ids for r in engine.generate(WINDOW_PROMPTS, GREEDY)]


def _watch_windows(runner: DraftRunner) -> list[DraftWindow]:
    """Wrap ``runner.propose`` (an engine's draft runner) to collect the window of every row it drafts."""
    seen: list[DraftWindow] = []
    propose = runner.propose

    def recording(rows):
        seen.extend(runner._windows[r.slot] for r in rows)
        return propose(rows)

    runner.propose = recording
    return seen


def _one_slot(engine) -> DraftRunner:
    return DraftRunner(engine.draft, 1, 128, engine.target.args.vocab_size)


@torch.inference_mode()
def test_a_windowed_row_drafts_what_it_would_for_the_view(engine):
    windowed, whole = _one_slot(engine), _one_slot(engine)
    windowed.begin(0, LONG, window=W)
    view = windowed._windows[0].view(LONG)
    assert len(view) == SINK_TOKENS + W
    whole.begin(0, view)
    first = windowed.propose([Request(LONG, GREEDY, slot=0, k=4)])[0].tokens
    assert first == whole.propose([Request(view, GREEDY, slot=0, k=4)])[0].tokens and len(first) == 4
    assert windowed.catch_up_tokens == whole.catch_up_tokens == len(view) - 1
    # One draft accepted plus the target's token; then both roll back and draft again.
    seq = [*LONG, first[0], 17]
    windowed.commit(0, len(LONG) + 1)
    whole.commit(0, len(view) + 1)
    assert windowed.cache.lengths[0] == whole.cache.lengths[0] == len(view) + 1
    assert windowed.propose([Request(seq, GREEDY, slot=0, k=3)])[0].tokens == \
        whole.propose([Request(windowed._windows[0].view(seq), GREEDY, slot=0, k=3)])[0].tokens
    windowed.release(0)
    windowed.begin(0, PROMPTS[0], window=W)  # the next request is short: it reads all of it
    assert windowed._windows[0] == DraftWindow()


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_greedy_output_equals_plain(engine, plain, method):
    spec = SpecConfig(k_policy="fixed", method=method, k=4, draft_window=W)
    own = engine.with_config()  # a new engine over the same models: a draft runner of its own to watch
    windows = _watch_windows(own.draft_runner)
    results = own.generate(WINDOW_PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert sum(r.metrics.accepted for r in results) > 0
    # Alone, the long prompt's draft cache ends with the window and the answer, not the whole prompt.
    windows.clear()
    assert own.generate(LONG, GREEDY, spec)[0].token_ids == plain[0]
    assert windows and all(w.skip == len(LONG) - W - SINK_TOKENS for w in windows)
    assert own.draft_runner.cache.lengths[0] <= SINK_TOKENS + W + GREEDY.max_tokens + spec.k


def test_the_cost_policy_keeps_greedy_output(engine, plain):
    spec = SpecConfig(method="hybrid", k=4, draft_window=W)
    assert [r.token_ids for r in engine.generate(WINDOW_PROMPTS, GREEDY, spec)] == plain


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_batched_output_equals_plain(engine, plain, method):
    spec = SpecConfig(k_policy="fixed", method=method, k=4, draft_window=W)
    results = engine.with_config(max_batch=3).generate(WINDOW_PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain


@torch.inference_mode()
@pytest.mark.parametrize("windows", [[W, None, W], [None, None, None], [W, W, W]])
def test_each_row_drafts_what_it_drafts_alone(engine, windows):
    """Each row of a draft runner drafts what a one-slot runner drafts for it alone, whatever the other rows'
    windows."""
    prompts = [LONG, LONGER, PROMPTS[1]]
    vocab = engine.target.args.vocab_size
    runner = DraftRunner(engine.draft, len(prompts), 128, vocab)
    for slot, (p, w) in enumerate(zip(prompts, windows, strict=True)):
        runner.begin(slot, p, window=w)
    batched = [p.tokens for p in runner.propose([Request(p, GREEDY, slot=s, k=4) for s, p in enumerate(prompts)])]
    alone = []
    for p, w in zip(prompts, windows, strict=True):
        one = _one_slot(engine)
        one.begin(0, p, window=w)
        alone.append(one.propose([Request(p, GREEDY, slot=0, k=4)])[0].tokens)
    assert batched == alone
    for slot, (p, w) in enumerate(zip(prompts, windows, strict=True)):
        runner.commit(slot, len(p) + 1)
        assert runner.cache.lengths[slot] == DraftWindow.for_prompt(len(p), w).draft_len(len(p) + 1)


def test_sampling_matches_the_target(tmp_path):
    make_tiny(tmp_path, arch="qwen2", vocab=32, layers=1, dim=32, heads=2, kv_heads=1, seed=0, scale=4.0)
    target = build_model(open_source(tmp_path), torch.float32, progress=False)
    engine = make_engine(target, target)  # it drafts for itself: q differs from p only by the context cut
    prompt, params = [3, 5, 7, 2, 9, 11, 4, 6, 8, 10], SamplingParams(temperature=1.0)
    spec = SpecConfig(k_policy="fixed", method="draft", k=2, draft_window=2)
    windows = _watch_windows(engine.draft_runner)
    counts = sampled_first_two(engine, prompt, params, spec, 3000)
    p = chi_square_p(counts, exact_first_two(target, prompt, params))
    assert p > 1e-3, f"speculative samples deviate from the target distribution (p = {p:.2e})"
    assert windows and all(w.skip == len(prompt) - 2 - SINK_TOKENS for w in windows)


@pytest.mark.parametrize("value", [-8, True, 2.5, "8"])
def test_bad_window_values(value):
    with pytest.raises(VerispecError, match="draft window"):
        SpecConfig(method="draft", draft_window=value)
    with pytest.raises(VerispecError, match="draft window"):
        check_draft_window(value)  # what a draft runner's begin checks before it touches the model
    with pytest.raises(VerispecError, match="draft window"):
        DraftWindow.for_prompt(40, value)


def test_method_option_parses_and_refuses_bad_values():
    m = parse_method("hybrid:policy=cost,window=256")
    assert m.spec.draft_window == 256 and m.spec.method == "hybrid"
    assert parse_method("draft:draft_window=64").spec.draft_window == 64
    with pytest.raises(VerispecError, match="draft window"):
        parse_method("draft:window=-1")
    assert parse_method("hybrid:window=0").spec.draft_window is None  # 0: the whole prompt
    with pytest.raises(VerispecError, match="window must be int"):
        parse_method("draft:window=wide")


def test_cli_takes_a_draft_window_and_refuses_bad_ones(capsys):
    from verispec.cli import _spec_from, build_parser, main

    base = ["generate", "--model", "m", "--draft", "d", "--prompt", "hi"]
    assert _spec_from(build_parser().parse_args([*base, "--draft-window", "64"])).draft_window == 64
    # With a draft model the default speculation cuts long prompts; 0 lets the draft read all of them.
    assert _spec_from(build_parser().parse_args(base)).draft_window == DEFAULT_SPEC.draft_window is not None
    assert _spec_from(build_parser().parse_args([*base, "--draft-window", "0"])).draft_window is None
    assert SpecConfig(method="draft", draft_window=0).draft_window is None
    with pytest.raises(VerispecError, match="draft window"):
        DraftWindow.for_prompt(40, 0)  # below the config (a draft runner's begin), None alone means off
    assert main([*base, "--draft-window", "-1"]) == 2  # refused before any model is opened
    assert "draft window" in capsys.readouterr().err
