"""Grammar constraints, penalties and logit bias keep speculation exact; logprobs do not depend on drafts.

Greedy: every drafter's constrained (or penalized) output equals constrained plain decoding. Sampling: on
a 12-token target whose tokens are the letters of a word-level tokenizer, the joint distribution of the
first two tokens under a grammar where the second token's choices depend on the first (and under
penalties, which depend on the first token too) is enumerated by hand, and seeded speculative samples
are tested against it with chi-square. The negative control processes only the distribution plain
decoding would sample next (row 0 of each scored row) and leaves the draft positions raw: it must be caught.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_sampling_exact import ALPHA, gof_pvalue, last_logits
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig, VerispecError
from verispec.constraints import Constraint, ConstraintError, RowLogits

LETTERS = "abcdefghij"  # ids 2..11; 0 is <s>, 1 is </s> (EOS)
# The second letter's choices depend on the first: a -> b c d, b -> a e f, c -> any, d..j -> a g.
SECOND = {"a": "bcd", "b": "aef", "c": LETTERS, **{x: "ag" for x in "defghij"}}
GRAMMAR = "(a[bcd]|b[aef]|c[a-j]|[d-j][ag])[a-j]*"
N = 2500


def letters_tokenizer(folder) -> PreTrainedTokenizerFast:
    # Byte-level BPE without merges: each letter is a token, as llguidance expects of a byte-level tokenizer.
    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(["<s>", "</s>", *LETTERS])}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return fast


def tid(letter: str) -> int:
    return 2 + LETTERS.index(letter)


@pytest.fixture(scope="module")
def engine(small_vocab_target, small_vocab_close_draft, tmp_path_factory) -> Engine:
    tok = letters_tokenizer(tmp_path_factory.mktemp("letters"))
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=32, progress=False)
    return Engine(cfg, small_vocab_target.model, tok, {1}, draft=small_vocab_close_draft.model, draft_tokenizer=tok)


PROMPT = [3, 5, 7, 2]
NGRAM_PROMPT = [11, 9, 10, 11]


def exact_joint(model, prompt: list[int], temperature: float, grammar: bool, presence: float = 0.0,
                frequency: float = 0.0, bias: dict[int, float] | None = None) -> np.ndarray:
    """P(first = a, second = b), enumerated from the rules stated in the module docstring (not the engine's code)."""
    vocab = model.args.vocab_size
    allowed1 = torch.zeros(vocab, dtype=torch.bool)
    allowed1[[tid(x) for x in LETTERS]] = True
    l1 = last_logits(model, [prompt])[0].clone()
    l2 = last_logits(model, [prompt + [a] for a in range(vocab)]).clone()
    for t, b in (bias or {}).items():
        l1[t] += b
        l2[:, t] += b
    for a in range(vocab):  # the first output token has appeared once before the second
        l2[a, a] -= presence + frequency
    if grammar:
        l1[~allowed1] = float("-inf")
        for a in range(vocab):
            ok = torch.zeros(vocab, dtype=torch.bool)
            if a >= 2:
                ok[[tid(x) for x in SECOND[LETTERS[a - 2]]]] = True
            l2[a, ~ok] = float("-inf")
    p1 = torch.softmax(l1 / temperature, -1)
    p2 = torch.nan_to_num(torch.softmax(l2 / temperature, -1))  # rows of impossible first tokens
    joint = (p1[:, None] * p2).double().numpy()
    assert abs(joint.sum() - 1) < 1e-5
    return joint


def draw(engine: Engine, prompt: list[int], spec: SpecConfig, constraint: Constraint | None, n: int = N,
         **sampling) -> tuple[np.ndarray, int, int, int]:
    """(counts of the first two tokens, drafted, accepted, draws the engine refused or failed)."""
    vocab = engine.target.args.vocab_size
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    drafted = accepted = failed = 0
    for i in range(n):
        params = SamplingParams(max_tokens=spec.k + 1, seed=i, temperature=1.0, ignore_eos=True, **sampling)
        try:
            r = engine.generate(prompt, params, spec, constraint=constraint)[0]
        except RuntimeError:  # the negative control can emit a token its grammar refuses
            failed += 1
            continue
        assert len(r.token_ids) >= 2
        counts[r.token_ids[0], r.token_ids[1]] += 1
        drafted += r.metrics.drafted
        accepted += r.metrics.accepted
    return counts, drafted, accepted, failed


CASES = {
    "grammar-draft": (PROMPT, "draft", dict(grammar=True), {}),
    "grammar-ngram": (NGRAM_PROMPT, "ngram", dict(grammar=True), {}),
    "penalties-draft": (PROMPT, "draft", dict(grammar=False, presence=1.0, frequency=0.7, bias={4: 1.5}),
                        dict(presence_penalty=1.0, frequency_penalty=0.7, logit_bias={4: 1.5})),
    "grammar-penalties-draft": (PROMPT, "draft", dict(grammar=True, presence=0.8, frequency=1.2),
                                dict(presence_penalty=0.8, frequency_penalty=1.2)),
}


def _constraint(grammar: bool) -> Constraint | None:
    return Constraint.regex(GRAMMAR) if grammar else None


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_sampling_matches_the_processed_target(engine, small_vocab_target, case):
    prompt, method, rule, sampling = CASES[case]
    joint = exact_joint(small_vocab_target.model, prompt, 1.0, **rule)
    spec = SpecConfig(k_policy="fixed", method=method, k=2)
    counts, drafted, accepted, failed = draw(engine, prompt, spec, _constraint(rule["grammar"]), **sampling)
    assert failed == 0
    assert 0 < accepted < drafted, (accepted, drafted)  # both branches of the rejection rule ran
    p = gof_pvalue(counts, joint)
    assert p > ALPHA, f"constrained speculative samples deviate from the processed target (p = {p:.2e})"


def only_row_zero(monkeypatch) -> None:
    """A wrong engine: processes the distribution plain decoding samples next, not the draft positions."""
    original = RowLogits.apply

    def apply(self, logits, seq, paths):
        out = logits.float().clone()
        out[:1] = original(self, logits[:1], seq, paths[:1])
        return out

    monkeypatch.setattr(RowLogits, "apply", apply)


@pytest.mark.parametrize("case", ["grammar-draft", "penalties-draft"])
def test_negative_control_processing_only_the_final_distribution_is_caught(engine, small_vocab_target, monkeypatch,
                                                                            case):
    prompt, method, rule, sampling = CASES[case]
    only_row_zero(monkeypatch)
    joint = exact_joint(small_vocab_target.model, prompt, 1.0, **rule)
    spec = SpecConfig(k_policy="fixed", method=method, k=2)
    counts, drafted, accepted, failed = draw(engine, prompt, spec, _constraint(rule["grammar"]), n=1500, **sampling)
    assert accepted > 0
    # A sample the grammar refuses (the engine raises) or on an impossible outcome is a detection too.
    if failed == 0 and not ((joint == 0) & (counts > 0)).any():
        p = gof_pvalue(counts, joint)
        assert p < ALPHA, f"the goodness-of-fit test missed draft positions left unprocessed (p = {p:.2e})"


def test_grammar_is_followed_and_ends_the_output(engine):
    c = Constraint.regex("(ab|ba)c")
    for spec in (None, SpecConfig(k_policy="fixed", method="draft", k=3)):
        for seed in range(20):
            r = engine.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=seed), spec,
                                constraint=c)[0]
            assert r.text in ("abc", "bac") and r.finish_reason == "stop"


def test_a_grammar_that_allows_nothing_more_stops_with_a_dead_end_reason(engine):
    # "a" then a letter the vocabulary lacks: after "a" nothing is allowed and the grammar is not complete.
    r = engine.generate(PROMPT, SamplingParams(max_tokens=10), constraint=Constraint.regex("az"))[0]
    assert r.finish_reason == "constraint_dead_end" and r.token_ids == [tid("a")]


# -- greedy identity for every drafter, on a pair with a word-level tokenizer ------------------------------------

WORDS_REGEX = "((the|a|cat|dog|of|and|to|in|is|it|that|x|y|=|\\(|\\)|:|,|1|2|3)){4,40}"
METHODS = ["draft", "ngram", "layerskip", "hybrid", "suffix"]


@pytest.fixture(scope="module")
def chat_engine(chat_pair) -> Engine:
    target, draft = chat_pair
    engine = Engine.from_pretrained(target, draft=draft, dtype="float32", max_len=256, progress=False)
    # llguidance reads token bytes through the decoder's type; the tiny word-level tokenizer has none.
    engine.tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    return engine


@pytest.fixture(scope="module")
def store(chat_engine, tmp_path_factory) -> str:
    """A retrieval datastore of word sequences the regex allows, in the chat engine's vocabulary."""
    from verispec.drafters.retrieval import build_datastore

    root = tmp_path_factory.mktemp("constraint_store")
    (root / "corpus.txt").write_text("the cat is in the dog of x\nthe dog and the cat to y\nx = 1 , y = 2\n" * 4)
    build_datastore([root / "corpus.txt"], chat_engine.tokenizer, root / "ds", progress=False)
    return str(root / "ds")


@pytest.mark.parametrize("sampling", [dict(), dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={7: 2.0})],
                         ids=["grammar", "grammar+penalties"])
def test_greedy_constrained_speculation_equals_constrained_plain(chat_engine, store, sampling):
    c = Constraint.regex(WORDS_REGEX)
    prompts = ["write code about the cat", "translate the dog to x", "what is 1 + 2 ?"]
    params = SamplingParams(max_tokens=40, logprobs=3, **sampling)
    plain = chat_engine.generate(prompts, params, chat=True, constraint=c)
    unconstrained = chat_engine.generate(prompts, params, chat=True)
    assert [r.token_ids for r in plain] != [r.token_ids for r in unconstrained]  # the constraint matters here
    for method in [*METHODS, "retrieval"]:
        spec = SpecConfig(method=method, k=4, k_policy="fixed", datastore=store if method == "retrieval" else None)
        spec_out = chat_engine.generate(prompts, params, spec, chat=True, constraint=c)
        for a, b in zip(plain, spec_out, strict=True):
            assert b.token_ids == a.token_ids, method
            assert b.finish_reason == a.finish_reason
            assert [x.token for x in b.logprobs] == b.token_ids
            assert np.allclose([x.logprob for x in b.logprobs], [x.logprob for x in a.logprobs], atol=1e-4)
        assert sum(r.metrics.drafted for r in spec_out) > 0, method


def test_penalties_change_greedy_output_and_speculation_keeps_it(chat_engine):
    prompts = ["the cat the cat the cat the cat", "write code about the dog"]
    base = chat_engine.generate(prompts, SamplingParams(max_tokens=30), chat=True)
    params = SamplingParams(max_tokens=30, frequency_penalty=2.0, presence_penalty=1.0)
    plain = chat_engine.generate(prompts, params, chat=True)
    assert [r.token_ids for r in plain] != [r.token_ids for r in base]
    for method in METHODS:
        out = chat_engine.generate(prompts, params, SpecConfig(method=method, k=4, k_policy="fixed"), chat=True)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain], method


# -- validation ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "message"), [
    (lambda: Constraint.regex("a("), "invalid regex"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "is an object"),
    (lambda: Constraint.json_schema({"type": "string", "format": "bogus"}), "bogus"),
    (lambda: Constraint.lark("start: undefined_rule"), "invalid lark"),
    (lambda: Constraint("yaml", "x"), "unknown constraint kind"),
])
def test_bad_constraints_are_refused_when_built(make, message):
    with pytest.raises(ConstraintError, match=message):
        make()


def test_json_schema_constraint_accepts_its_json():
    c = Constraint.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]})
    assert json.loads(c.source)["required"] == ["a"]


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                    dict(logit_bias={5: 101}), dict(logit_bias={-1: 1}), dict(logit_bias={"x": 1}),
                                    dict(logprobs=21), dict(logprobs=-1)])
def test_bad_processing_params_are_refused(kwargs):
    with pytest.raises(VerispecError):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused_at_submit(engine):
    with pytest.raises(VerispecError, match="outside the vocabulary"):
        engine.submit(PROMPT, SamplingParams(logit_bias={12: 1.0}))
    with pytest.raises(VerispecError, match="Constraint"):
        engine.submit(PROMPT, constraint="(ab)")


# -- n choices: rows of one batch, each its own seed stream -------------------------------------------------------

def draw_pairs(engine: Engine, seeds: list[tuple[int, int]], spec: SpecConfig) -> np.ndarray:
    """Counts of (choice 0's first token, choice 1's first token) over batched pairs of requests."""
    vocab = engine.target.args.vocab_size
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for s0, s1 in seeds:
        params = [SamplingParams(max_tokens=spec.k + 1, temperature=1.0, ignore_eos=True, seed=s) for s in (s0, s1)]
        a, b = engine.generate([PROMPT, PROMPT], params, spec)
        counts[a.token_ids[0], b.token_ids[0]] += 1
    return counts


def test_n_choices_are_independent_draws_of_the_target(engine, small_vocab_target):
    # Choice i of a request has its own seed stream (the server's seed + i): two choices run as rows of one
    # batch are independent draws, so their first tokens are distributed as p x p. The negative control gives
    # both rows one seed, as a shared stream would: its pairs fall on the diagonal and the test must fail.
    p1 = torch.softmax(last_logits(small_vocab_target.model, [PROMPT])[0], -1).double().numpy()
    joint = np.outer(p1, p1)
    spec = SpecConfig(k_policy="fixed", method="draft", k=2)
    counts = draw_pairs(engine, [(2 * i, 2 * i + 1) for i in range(1500)], spec)
    assert gof_pvalue(counts, joint) > ALPHA
    shared = draw_pairs(engine, [(i, i) for i in range(600)], spec)
    assert np.trace(shared) == 600 and gof_pvalue(shared, joint) < ALPHA


def test_a_hybrid_row_trusts_only_lookups_its_grammar_accepts(chat_engine, monkeypatch):
    """A lookup is weighed on the tokens its grammar accepts: one refused at its first token is not trusted, and
    the step drafts with the draft model instead of decoding plainly."""
    import verispec.engine.step as step
    from verispec.drafters.base import Proposal
    from verispec.drafters.ngram import NgramDrafter

    refused = chat_engine.tokenizer.convert_tokens_to_ids("write")  # a word the regex does not allow

    def long_match_of_refused_words(self, seq, k, params, generator):
        self.last_match = 4
        return Proposal([refused] * k)

    trusted: list[tuple[int, int]] = []  # (tokens offered, tokens the grammar kept) per trusted-lookup step
    grammatical = step._grammatical

    def spy(p, r):
        out = grammatical(p, r)
        if r.lookup is not None:
            trusted.append((len(p.tokens), len(out.tokens)))
        return out

    c, params = Constraint.regex(WORDS_REGEX), SamplingParams(max_tokens=30)
    prompts = ["write code about the cat", "what is 1 + 2 ?"]
    plain = chat_engine.generate(prompts, params, chat=True, constraint=c)
    monkeypatch.setattr(NgramDrafter, "propose", long_match_of_refused_words)
    monkeypatch.setattr(step, "_grammatical", spy)
    out = chat_engine.generate(prompts, params, SpecConfig(method="hybrid", k=4, k_policy="fixed"), chat=True,
                               constraint=c)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert not trusted  # every lookup was refused, so none was trusted ...
    assert sum(r.metrics.drafted for r in out) > 0  # ... and the draft model drafted those steps
