"""A reduced draft vocabulary (``vocab=N``): the first N ids plus special and prompt tokens.

The prefix module is the full head's first N rows in the same weight format (outputs equal bit
for bit); the reduced head's logits are -inf outside the subset and the full head's inside (the
prefix exactly; the extra rows, scored with F.linear on the dequantized rows, within fp rounding);
speculation with it stays lossless (greedy token for token, sampling by chi-square) for the draft
and hybrid methods, alone and batched; bad values are VerispecErrors.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from drafters_common import GREEDY, PROMPTS, chi_square_p, exact_first_two, make_engine, sampled_first_two
from tiny import make_tiny

from verispec import SamplingParams, SpecConfig, VerispecError
from verispec.bench.methods import parse_method
from verispec.config import DEFAULT_SPEC
from verispec.drafters import make_drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.vocab import DraftVocab, linear_rows, prefix_linear, special_token_ids
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.request import Request
from verispec.kernels import use_fast
from verispec.models.linear import make_linear
from verispec.models.loader import build_model, open_source

# Prompts with ids beyond N = 32 (so prompt extras exist) and the shared test prompts.
N = 32
VOCAB_PROMPTS = [[40, 41, 42, 40, 41], [3, 70, 5, 71, 3, 70], *PROMPTS]

# (weight format, dtype, kernels): every layout a head can be held in on a CPU.
FORMATS = [("dense", torch.float32, "auto"), ("dense", torch.bfloat16, "auto"), ("dense", torch.bfloat16, "stock"),
           ("int8", torch.float32, "auto"), ("int8", torch.bfloat16, "auto"), ("int8", torch.float32, "stock"),
           ("int4", torch.float32, "auto"), ("int4", torch.bfloat16, "auto"), ("int4", torch.bfloat16, "stock")]


def _fmt_id(f: tuple) -> str:
    return f"{f[0]}-{str(f[1]).removeprefix('torch.')}-{f[2]}"


def _weight_storage(m: torch.nn.Module) -> int:
    """Where a linear layer's (packed) weight lives; scales may be small copies."""
    for name in ("qweight", "packed"):
        if name in m._buffers:
            return m._buffers[name].untyped_storage().data_ptr()
    return m._parameters["weight"].untyped_storage().data_ptr()


# -- the prefix module and the rows of a head ----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_prefix_module_equals_the_first_rows(fmt):
    name, dtype, kernels = fmt
    gen = torch.Generator().manual_seed(0)
    # 400 rows: not a multiple of 64, so PyTorch's CPU int4 layout ends in a partial block.
    full = make_linear(torch.randn(400, 128, generator=gen), None, name, dtype, kernels)
    x = torch.randn(3, 128, generator=gen).to(dtype)
    ref = full(x)
    for n in (16, 48, 64, 192, 384):
        head = prefix_linear(full, n, dtype)
        assert type(head) is type(full) and head.out_features == n
        for path in ("fast", "q8"):  # the same kernel path
            assert getattr(head, path, None) == getattr(full, path, None)
        assert torch.equal(head(x), ref[:, :n]), n
        if n % 64 == 0:  # whole blocks of every layout: the prefix is a view, no new memory
            assert _weight_storage(head) == _weight_storage(full)
    assert prefix_linear(full, 400, dtype) is full and prefix_linear(full, 512, dtype) is full


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_rows_are_the_heads_dequantized_rows(fmt):
    name, dtype, kernels = fmt
    full = make_linear(torch.randn(400, 128, generator=torch.Generator().manual_seed(1)), None, name, dtype, kernels)
    ids = torch.tensor([399, 0, 5, 17, 200, 383, 384, 16, 17])
    assert torch.equal(linear_rows(full, ids), full.dequantized().float()[ids])
    assert linear_rows(full, torch.tensor([], dtype=torch.long)).shape == (0, 128)


# -- the reduced head inside a model -------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tied (llama) and an untied (qwen2) tiny model, 96 tokens."""
    tied, untied = tmp_path_factory.mktemp("vocab_tied"), tmp_path_factory.mktemp("vocab_untied")
    make_tiny(tied, arch="llama", vocab=96, layers=1, dim=64, heads=4, kv_heads=2, seed=3, tie=True)
    make_tiny(untied, arch="qwen2", vocab=96, layers=1, dim=64, heads=4, kv_heads=2, seed=4, tie=False)
    return {"tied": tied, "untied": untied}


# Tolerance of the extra rows against the full head: the same weights, another matmul (F.linear
# in the model's dtype instead of the head's kernel), so only the order of the sums and, in bf16,
# the rounding of the weights/outputs to bf16 differ.
EXTRA_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("tie", ["tied", "untied"])
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@torch.inference_mode()
def test_subset_head_logits(folders, tie, fmt):
    name, dtype, kernels = fmt
    model = build_model(open_source(folders[tie]), dtype, name, progress=False, kernels=kernels)
    vocab = DraftVocab(model, N, special_ids={1, 90, 95, 500})  # 1 is in the prefix, 500 past the vocabulary
    prompt = [3, 40, 70, 40, 2, 31]
    head = vocab.head(prompt)
    extra = [40, 70, 90, 95]
    assert head.extra_ids.tolist() == extra and head.size == N + 4
    tokens = torch.tensor([[5, 9, 40, 2], [7, 70, 3, 3]])
    pos = torch.arange(4).expand(2, 4)
    full = model(tokens, pos, model.new_cache(2, 8))
    cut = model(tokens, pos, model.new_cache(2, 8), head=head)
    assert cut.dtype == torch.float32 and cut.shape == full.shape
    inside = torch.zeros(96, dtype=torch.bool)
    inside[:N] = True
    inside[extra] = True
    assert torch.isneginf(cut[..., ~inside]).all()
    assert torch.equal(cut[..., :N], full[..., :N])
    # PyTorch's stock int4 kernel takes bf16 activations (verispec's kernel takes fp32 ones), so
    # there the full head rounds like a bf16 model whatever the model's dtype.
    bf16_head = name == "int4" and not use_fast(kernels)
    if getattr(model.lm_head, "q8", False):  # the full head quantizes its activations to 8 bits, F.linear does not
        assert (cut[..., extra] - full[..., extra]).abs().max() <= 0.05 * full.abs().max()
    else:
        tol = EXTRA_TOL[torch.bfloat16 if bf16_head else dtype]
        torch.testing.assert_close(cut[..., extra], full[..., extra], **tol)
    assert torch.isfinite(cut[..., inside]).all()


def test_special_token_ids_of_a_tokenizer():
    class Tok:  # a regular vocabulary of 90 ids, 6 added tokens, and specials inside the regular range
        vocab_size = 90
        all_special_ids = [0, 2]
        added_tokens_decoder = {90: "<a>", 95: "<f>"}

        def __len__(self) -> int:
            return 96

    assert special_token_ids(Tok(), {1, 93}) == {0, 1, 2, 90, 91, 92, 93, 94, 95}
    assert special_token_ids(None, {1, 93}) == {1, 93}


# -- lossless speculation --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(noisy_pair_engine):
    return noisy_pair_engine


@pytest.fixture(scope="module")
def plain(engine):
    return [r.token_ids for r in engine.generate(VOCAB_PROMPTS, GREEDY)]


def _record(runner: DraftRunner) -> list[int]:
    """Wrap ``runner.propose`` (an engine's draft runner) to collect every token it proposes."""
    seen: list[int] = []
    propose = runner.propose

    def recording(rows):
        proposals = propose(rows)
        for p in proposals:
            seen.extend(p.tokens)
        return proposals

    runner.propose = recording
    return seen


def _runner(engine, slots: int = 1) -> DraftRunner:
    """A draft runner of its own over ``engine``'s draft model (the engine's special ids)."""
    return DraftRunner(engine.draft, slots, 64, engine.target.args.vocab_size, engine.eos_ids)


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_greedy_output_equals_plain(engine, plain, method):
    spec = SpecConfig(k_policy="fixed", method=method, k=4, draft_vocab=N)
    own = engine.with_config()  # a new engine over the same models: a draft runner of its own to watch
    runner = own.draft_runner
    proposed = _record(runner)
    results = own.generate(VOCAB_PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert sum(r.metrics.accepted for r in results) > 0
    # One row at a time, every one begun with the reduced vocabulary: every draft forward ran the reduced head.
    assert runner.forwards > 0 and runner.reduced_forwards == runner.forwards
    # Every draft token is in the prefix, a special token or the prompt it was drafted for.
    allowed = set(range(N)) | engine.eos_ids | {t for p in VOCAB_PROMPTS for t in p}
    assert proposed and set(proposed) <= allowed
    # The full head drafts outside that set here, so the cut really changed the drafts.
    full = engine.with_config()
    full_proposed = _record(full.draft_runner)
    assert [r.token_ids for r in full.generate(VOCAB_PROMPTS, GREEDY, replace(spec, draft_vocab=None))] == plain
    assert full.draft_runner.forwards > 0 and full.draft_runner.reduced_forwards == 0
    assert not set(full_proposed) <= allowed


@torch.inference_mode()
def test_prompt_ids_are_draftable(engine):
    runner = _runner(engine)
    runner.begin(0, [40, 41, 42], N)
    assert runner._row_vocab[0][1].tolist() == [40, 41, 42]
    runner.propose([Request([40, 41, 42], GREEDY, slot=0, k=2)])
    assert runner._head is not None and runner._head.extra_ids.tolist() == [40, 41, 42]
    runner.release(0)
    runner.begin(0, [3, 4], N)  # the next request's head has that request's prompt ids only
    assert runner._row_vocab[0][1].tolist() == []
    runner.propose([Request([3, 4], GREEDY, slot=0, k=2)])
    assert runner._head.extra_ids.tolist() == []
    assert runner.reduced_forwards == runner.forwards == 4


@torch.inference_mode()
def test_full_size_is_a_no_op(engine):
    runner = _runner(engine)
    runner.begin(0, [40], 96)
    assert 0 not in runner._row_vocab
    runner.propose([Request([40], GREEDY, slot=0, k=2)])
    assert runner._head is None and runner.reduced_forwards == 0 and runner.forwards == 2


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_batched_hybrid_equals_plain(engine, plain, batch):
    spec = SpecConfig(k_policy="fixed", method="hybrid", k=4, draft_vocab=N)
    results = engine.with_config(max_batch=batch).generate(VOCAB_PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain


def test_batched_draft_uses_the_reduced_head(engine, plain):
    spec = SpecConfig(k_policy="fixed", method="draft", k=4, draft_vocab=N)
    be = engine.with_config(max_batch=4)
    results = be.generate(VOCAB_PROMPTS, GREEDY, spec)
    assert [r.token_ids for r in results] == plain
    assert be.draft_runner.reduced_forwards > 0


@torch.inference_mode()
def _batch_proposals(engine, vocabs: list[int | None], prompts: list[list[int]], k: int = 4) -> list[list[int]]:
    runner = _runner(engine, len(prompts))
    for slot, (p, v) in enumerate(zip(prompts, vocabs, strict=True)):
        runner.begin(slot, p, v)
    rows = [Request(p, GREEDY, slot=slot, k=k) for slot, p in enumerate(prompts)]
    out = [p.tokens for p in runner.propose(rows)]
    assert runner.reduced_forwards == (k if all(v == N for v in vocabs) else 0)
    return out


@torch.inference_mode()
@pytest.mark.parametrize("vocabs", [[N, N, N], [N, None, N], [None, None, None]])
def test_each_row_drafts_what_it_drafts_alone(engine, vocabs):
    """Each row of a draft runner drafts what a one-slot runner drafts for it alone, whatever the other rows'
    prompts or vocabularies."""
    prompts = [[40, 41, 42, 40, 41], [3, 70, 5, 71, 3, 70], [10, 20, 30, 40, 50, 60, 10, 20, 30]]
    batched = _batch_proposals(engine, vocabs, prompts)
    alone = []
    for p, v in zip(prompts, vocabs, strict=True):
        one = _runner(engine)
        one.begin(0, p, v)
        alone.append(one.propose([Request(p, GREEDY, slot=0, k=4)])[0].tokens)
        assert one.reduced_forwards == (4 if v == N else 0)
    assert batched == alone
    for toks, p, v in zip(batched, prompts, vocabs, strict=True):
        if v is not None:
            assert set(toks) <= set(range(N)) | set(p) | engine.eos_ids


# -- sampling keeps the target's distribution -----------------------------------------------------


@pytest.fixture(scope="module")
def vocab32(tmp_path_factory):
    """A 32-token target with decisive distributions; it also drafts for itself, so q differs from p only by the
    vocabulary cut (ids >= 16 get q = 0)."""
    folder = tmp_path_factory.mktemp("vocab32")
    make_tiny(folder, arch="qwen2", vocab=32, layers=1, dim=32, heads=2, kv_heads=1, seed=0, scale=4.0)
    return build_model(open_source(folder), torch.float32, progress=False)


def test_sampling_matches_the_target(vocab32):
    engine = make_engine(vocab32, vocab32)
    prompt, params = [3, 5, 7, 2], SamplingParams(temperature=1.0)
    spec = SpecConfig(k_policy="fixed", method="draft", k=2, draft_vocab=16)
    exact = exact_first_two(vocab32, prompt, params)
    # The cut matters: the target puts real mass on ids outside the draft's subset.
    outside = exact.reshape(32, 32)
    assert outside[16:].sum() + outside[:, 16:].sum() > 0.2
    proposed = _record(engine.draft_runner)
    counts = sampled_first_two(engine, prompt, params, spec, 3000)
    p = chi_square_p(counts, exact)
    assert p > 1e-3, f"speculative samples deviate from the target distribution (p = {p:.2e})"
    # The draft never proposed outside its subset, yet the output has such tokens (from the residual).
    assert proposed and max(proposed) < 16
    assert counts.reshape(32, 32)[16:].sum() > 0


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-16, 100, 8, True, 32.0, "32"])
def test_bad_vocab_values(value):
    with pytest.raises(VerispecError, match="multiple of 16"):
        SpecConfig(method="draft", draft_vocab=value)


@pytest.mark.parametrize("text", ["draft:vocab=100", "draft:vocab=8", "hybrid:vocab=-32"])
def test_bad_method_option_values(text):
    with pytest.raises(VerispecError, match="multiple of 16"):
        parse_method(text)


def test_method_option_parses():
    m = parse_method("hybrid:policy=cost,vocab=32768")
    assert m.spec.draft_vocab == 32768 and m.spec.k_policy == "cost" and m.spec.method == "hybrid"
    assert parse_method("draft:draft_vocab=16").spec.draft_vocab == 16
    with pytest.raises(VerispecError, match="vocab must be int"):
        parse_method("draft:vocab=lots")


def test_prefix_needs_a_multiple_of_16():
    full = make_linear(torch.randn(64, 32), None, "dense", torch.float32)
    with pytest.raises(VerispecError, match="multiple of 16"):
        prefix_linear(full, 24, torch.float32)


def test_reduced_vocab_with_compile_is_refused(engine):
    # The context a compiled engine hands its drafters, without compiling anything.
    ctx = replace(engine.draft_context, compiled=True)
    for method in ("draft", "hybrid"):
        with pytest.raises(VerispecError, match="--compile"):
            make_drafter(SpecConfig(method=method, draft_vocab=N), ctx)
    full = make_drafter(SpecConfig(method="draft"), ctx)  # the full head compiles
    assert isinstance(full, ModelDrafter) and full.draft_vocab is None


def test_drafters_without_a_draft_model_ignore_it(engine):
    # A server whose default spec carries vocab=N still serves n-gram requests.
    spec = SpecConfig(k_policy="fixed", method="ngram", k=3, draft_vocab=N)
    assert engine.generate(PROMPTS[0], GREEDY, spec)[0].token_ids == \
        engine.generate(PROMPTS[0], GREEDY)[0].token_ids


def test_cli_takes_a_draft_vocab_and_refuses_bad_ones(capsys):
    from verispec.cli import _spec_from, build_parser, main

    base = ["generate", "--model", "m", "--draft", "d", "--prompt", "hi"]
    assert _spec_from(build_parser().parse_args([*base, "--draft-vocab", "1024"])).draft_vocab == 1024
    # With a draft model the default speculation reduces the head; 0 keeps the full one.
    assert _spec_from(build_parser().parse_args(base)).draft_vocab == DEFAULT_SPEC.draft_vocab is not None
    assert _spec_from(build_parser().parse_args([*base, "--draft-vocab", "0"])).draft_vocab is None
    assert SpecConfig(method="draft", draft_vocab=0).draft_vocab is None
    assert parse_method("hybrid:vocab=0").spec.draft_vocab is None
    assert main([*base, "--draft-vocab", "100"]) == 2  # refused before any model is opened
    assert "multiple of 16" in capsys.readouterr().err
