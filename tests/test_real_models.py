"""Checks on the real weights (installed and cached by ``make test``), in fp32 for exactness."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

from verispec import Engine, SamplingParams, SpecConfig, VerispecError, hub, kernels
from verispec.bench import datasets
from verispec.cli import main
from verispec.config import DEFAULT_SPEC, PLAIN
from verispec.engine.costs import CostCurve, CostModel

TARGET, DRAFT, SMOL = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", autouse=True)
def all_threads():
    """conftest pins one thread for the tiny models; real models are memory-bound and want every core."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Question: What is the capital of France?\nAnswer:",
]


def _require_installed(*names: str) -> None:
    missing = [n for n in names if not hub.is_installed(n)]
    if missing:
        pytest.fail(f"real models not installed ({', '.join(missing)}); run: make models")


@pytest.fixture(scope="module")
def pair() -> Engine:
    _require_installed(TARGET, DRAFT)
    # Dense weights: the checks against transformers compare with the GGUF's own dequantized floats.
    engine = Engine.from_pretrained(TARGET, draft=DRAFT, dtype="float32", weights="dense", draft_weights="dense",
                                    max_len=1024, progress=False)
    yield engine
    del engine
    gc.collect()


def _hf_greedy(gguf_name: str, prompts: list[list[int]], max_new: int, eos: list[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = hub.model_file(gguf_name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos[0])
            new = y[0, len(ids):].tolist()
            while new and new[-1] in eos:  # we report EOS as a finish reason, not a token
                new.pop()
            outs.append(new)
    del model
    gc.collect()
    return outs


def test_target_greedy_matches_transformers(pair: Engine) -> None:
    params = SamplingParams(max_tokens=24)
    ours = pair.generate(PROMPTS, params)
    ids = [r.prompt_token_ids for r in ours]
    theirs = _hf_greedy(TARGET, ids, params.max_tokens, sorted(pair.eos_ids))
    for r, ref in zip(ours, theirs, strict=True):
        assert r.token_ids == ref, f"diverged on {pair.decode(r.prompt_token_ids)!r}"
        assert len(r.token_ids) > 0


def test_smollm2_llama_gguf_matches_transformers() -> None:
    """SmolLM2 is a llama-architecture GGUF: checks the q/k un-permutation and tied embeddings."""
    _require_installed(SMOL)
    engine = Engine.from_pretrained(SMOL, dtype="float32", weights="dense", max_len=512, progress=False)
    params = SamplingParams(max_tokens=24)
    ours = engine.generate(PROMPTS, params)
    theirs = _hf_greedy(SMOL, [r.prompt_token_ids for r in ours], params.max_tokens, sorted(engine.eos_ids))
    assert [r.token_ids for r in ours] == theirs


def _spec_bench_prompts() -> list[datasets.BenchPrompt]:
    cats = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    return datasets.spec_bench(per_category=1, seed=1, categories=cats)  # the packaged questions


def test_speculative_greedy_equals_plain_on_real_pair(pair: Engine) -> None:
    prompts = _spec_bench_prompts()
    assert len({p.category for p in prompts}) >= 5
    params = SamplingParams(max_tokens=32)
    texts = [p.text for p in prompts]
    plain = pair.generate(texts, params, chat=True)
    # The window (64 tokens) cuts the summarization and RAG prompts the draft reads.
    for spec in (SpecConfig(k_policy="fixed", method="draft", k=4), SpecConfig(k_policy="fixed", method="ngram", k=4),
                 SpecConfig(k_policy="fixed", method="draft", k=4, draft_window=64)):
        spec_out = pair.generate(texts, params, spec, chat=True)
        for p, a, b in zip(prompts, plain, spec_out, strict=True):
            assert a.token_ids == b.token_ids, f"{spec.method} diverged on {p.category} prompt {p.id}"
        total = sum(r.metrics.accepted for r in spec_out)
        if spec.draft_window is not None:
            lengths = [len(pair.encode(t, chat=True)) for t in texts]
            assert max(lengths) > 2 * spec.draft_window, "no prompt long enough to cut"
        if spec.method == "draft":
            assert total > 0, "the same-family draft should get some tokens accepted"
            steps = sum(r.metrics.steps for r in spec_out)
            assert steps < sum(r.metrics.steps for r in plain)


@pytest.mark.skipif(not (kernels.available() and kernels.q8_available()),
                    reason="the bf16-activation side of the comparison needs AVX-512 BF16")
def test_q8_kernels_keep_the_int4_pair_lossless_and_close_to_bf16_activations() -> None:
    """``kernels="q8"`` (int4 layers on 8-bit activations): speculation still reproduces plain decoding
    token for token, and teacher-forced on bf16-activation text the greedy choice rarely moves."""
    _require_installed(TARGET, DRAFT)
    texts = [p.text for p in _spec_bench_prompts()[:2]] + [PROMPTS[0]]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    engines = {kern: Engine.from_pretrained(TARGET, draft=DRAFT, dtype="bfloat16", weights="int4",
                                            draft_weights="int4-all", max_len=1024, progress=False, kernels=kern)
               for kern in ("auto", "q8")}
    q8 = engines["q8"]
    plain = q8.generate(texts, params, chat=True)
    assert [r.token_ids for r in q8.generate(texts, params, DEFAULT_SPEC, chat=True)] == [r.token_ids for r in plain]
    agree = total = 0
    for text, res in zip(texts, engines["auto"].generate(texts, params, chat=True), strict=True):
        seq = torch.tensor([q8.encode(text, chat=True) + res.token_ids])
        pos = torch.arange(seq.shape[1])[None]
        with torch.inference_mode():
            a, b = (e.target(seq, pos, e.target.new_cache(1, seq.shape[1]))[0, -len(res.token_ids):].argmax(-1)
                    for e in engines.values())
        agree, total = agree + int((a == b).sum()), total + len(res.token_ids)
    assert agree >= 0.95 * total, f"{agree} of {total}"


def test_suffix_trees_keep_the_int4_pair_lossless() -> None:
    """Suffix drafts as token trees on the int4 pair in the host's default dtype (bf16 with AVX-512 BF16, fp32
    on AVX2; the fused kernels where the CPU runs them): every node scores as its root path would alone, so
    the greedy output is plain decoding's, token for token."""
    _require_installed(TARGET, DRAFT)
    engine = Engine.from_pretrained(TARGET, draft=DRAFT, dtype="auto", weights="int4", draft_weights="int4-all",
                                    max_len=1024, progress=False)
    texts = [p.text for p in datasets.load("code_edit")[:4]]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(texts, params, chat=True)]
    spec = SpecConfig(method="hybrid", lookup="suffix", suffix_global=0, suffix_width=3, suffix_min_prob=0.0)
    trees = engine.generate(texts, params, spec, chat=True)
    assert [r.token_ids for r in trees] == plain
    assert sum(r.metrics.accepted for r in trees) > 0


def test_predicted_outputs_keep_the_int4_pair_lossless() -> None:
    """Code edits with their quoted code as the prediction (a correct start, then the edit's divergences), with
    another edit's code (unrelated), on the int4 pair in the host's default dtype and kernels: greedy output is
    plain decoding's token for token, batched and with the default speculation or none, and the prediction
    drafts most of an answer that repeats it."""
    _require_installed(TARGET, DRAFT)
    engine = Engine.from_pretrained(TARGET, draft=DRAFT, weights="int4", draft_weights="int4-all", max_len=2048,
                                    progress=False)
    edits = datasets.load("code_edit,code_edit_polyglot")
    edits = [edits[1], edits[43], edits[44]]  # Python type hints and a docstring; Rust derives; a Rust rename
    texts, own = [p.text for p in edits], [p.prediction for p in edits]
    params = SamplingParams(max_tokens=160)
    plain = [r.token_ids for r in engine.generate(texts, params, chat=True)]
    for spec in (DEFAULT_SPEC, None):
        for predictions in (own, own[1:] + own[:1]):
            out = engine.generate(texts, params, spec, chat=True, prediction=predictions)
            assert [r.token_ids for r in out] == plain
            if predictions is own:
                accepted = sum(r.metrics.accepted_prediction_tokens for r in out)
                assert accepted > 0.3 * sum(len(t) for t in plain), accepted


def test_batched_greedy_equals_each_request_alone_on_real_pair(pair: Engine) -> None:
    # Rows of different prompt lengths (Spec-Bench's six categories, RAG and summaries long, plus two
    # short prompts) and limits, each drafting its own way (draft model at a fixed k and under the
    # batch policy, lookups, none), must each give what the request gives decoded alone. Eight slots:
    # the batch shrinks from 8 rows to 1 as answers end; three: requests wait and join mid-flight.
    prompts = [p.text for p in _spec_bench_prompts()] + ["def add(a, b):", "Say hi."]
    limits = [6 + 3 * i for i in range(len(prompts))]
    specs = [SpecConfig(k_policy="fixed", method="draft", k=4), SpecConfig(k_policy="cost", method="draft", k=4),
             SpecConfig(k_policy="fixed", method="ngram", k=3), PLAIN]
    alone = [pair.generate(text, SamplingParams(max_tokens=n), chat=True)[0].token_ids
             for text, n in zip(prompts, limits, strict=True)]
    assert len(set(map(len, alone))) > 1 and all(alone)
    # Given costs (memory-bound: speculation pays at any batch size) instead of a profile, which takes
    # minutes in fp32; the policy still chooses k per step from each row's acceptance.
    costs = CostModel(CostCurve({1: 0.1, 64: 0.1}), CostCurve({1: 0.01, 64: 0.01}))
    for slots in (8, 3):
        be = pair.with_config(max_batch=slots, costs=costs)
        handles = [be.submit(text, SamplingParams(max_tokens=n), specs[i % len(specs)], chat=True)
                   for i, (text, n) in enumerate(zip(prompts, limits, strict=True))]
        be.run_until_done()
        assert [h.result().token_ids for h in handles] == alone, f"{slots} slots"
        assert be.kv_used_tokens == 0 and be.free_slots == slots
        assert be.stats.summary()["mean_rows"] > 1 and any(k > 0 for k in be.stats.policy_k)


def test_real_pair_tokenizers_agree_and_mismatch_is_refused(pair: Engine) -> None:
    assert pair.target.args.vocab_size == pair.draft.args.vocab_size == 151936
    assert len(pair.tokenizer) <= 151936
    _require_installed(SMOL)
    with pytest.raises(VerispecError, match="differ"):
        Engine.from_pretrained(TARGET, draft=SMOL, dtype="float32", max_len=64, progress=False)


def test_generate_json_reports_the_default_formats_of_the_real_models(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --weights the Q4_K_M target runs int4; with --draft auto its partner drafts in int4-all."""
    _require_installed(TARGET, DRAFT)
    base = ["generate", "--model", TARGET, "--prompt", "def add(a, b):", "--max-tokens", "2", "--max-len", "256",
            "--json"]
    assert main(base) == 0
    c = json.loads(capsys.readouterr().out)["config"]
    assert (c["model"], c["weights"], c["draft"], c["draft_weights"], c["method"]) == (TARGET, "int4", None, None,
                                                                                     "none")
    assert main([*base, "--draft", "auto"]) == 0
    c = json.loads(capsys.readouterr().out)["config"]
    assert (c["draft"], c["weights"], c["draft_weights"]) == (DRAFT, "int4", "int4-all")
    assert (c["method"], c["k_policy"], c["draft_vocab"]) == (DEFAULT_SPEC.method, DEFAULT_SPEC.k_policy,
                                                              DEFAULT_SPEC.draft_vocab)
    assert c["kernels"] in ("verispec", "stock", "mixed") and c["dtype"] in ("bfloat16", "float32")
