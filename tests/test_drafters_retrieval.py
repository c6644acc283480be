"""The retrieval datastore drafter: suffix array, lookups, on-disk format, errors, and lossless decoding."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from drafters_common import (
    GREEDY,
    PROMPTS,
    build_echo_store,
    build_tiny,
    build_tok_model,
    chi_square_p,
    exact_first_two,
    make_engine,
    memory_store,
    plain_outputs,
    sampled_first_two,
)
from tiny_tokenizer import make_tiny_tokenizer

from verispec import Engine, SamplingParams, SpecConfig, VerispecError
from verispec.cli import _spec_from, build_parser, main
from verispec.drafters.datastore import Datastore, tokenizer_fingerprint
from verispec.drafters.retrieval import RetrievalDrafter, build_datastore
from verispec.drafters.suffix_array import find_range, longest_match, suffix_array

# -- suffix array and search against brute force ----------------------------------------------


def brute_sa(tokens: np.ndarray) -> list[int]:
    ids = tokens.tolist()
    return sorted(range(len(ids)), key=lambda i: ids[i:])


@pytest.mark.parametrize("n,alphabet,seed", [(0, 3, 0), (1, 3, 0), (2, 1, 0), (40, 1, 0), (300, 2, 1),
                                             (500, 5, 2), (800, 50, 3)])
def test_suffix_array_matches_brute_force(n, alphabet, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(-1, alphabet, n).astype(np.int32)  # -1: document separators
    sa = suffix_array(tokens)
    assert sa.dtype == np.int32
    assert sa.tolist() == brute_sa(tokens)


def test_suffix_array_of_long_repeats():
    # A repeated block forces many doubling rounds.
    block = np.random.default_rng(4).integers(0, 4, 64)
    tokens = np.concatenate([block] * 6 + [[1, 2]]).astype(np.int32)
    assert suffix_array(tokens).tolist() == brute_sa(tokens)


def occurrences(tokens: list[int], pattern: list[int]) -> list[int]:
    m = len(pattern)
    return [i for i in range(len(tokens) - m + 1) if tokens[i:i + m] == pattern]


def test_find_range_and_longest_match_match_brute_force():
    rng = np.random.default_rng(5)
    tokens = rng.integers(-1, 4, 600).astype(np.int32)
    sa = suffix_array(tokens)
    ids = tokens.tolist()
    for _ in range(200):
        pattern = rng.integers(0, 4, int(rng.integers(1, 7))).tolist()
        lo, hi = find_range(tokens, sa, pattern)
        assert sorted(sa[lo:hi].tolist()) == occurrences(ids, pattern)
    for _ in range(100):
        context = rng.integers(0, 4, 20).tolist()
        m, lo, hi = longest_match(tokens, sa, context, max_len=12, min_len=2)
        want = max((n for n in range(2, 13) if occurrences(ids, context[-n:])), default=0)
        assert m == want
        if m:
            assert sorted(sa[lo:hi].tolist()) == occurrences(ids, context[-m:])


def brute_proposal(docs: list[list[int]], context: list[int], k: int, max_match: int = 16,
                   min_match: int = 2) -> list[int]:
    """The longest matching suffix, then the most frequent continuation token by token (ties: smallest id)."""
    flat = [t for d in docs for t in d + [-1]]
    for m in range(min(max_match, len(context)), min_match - 1, -1):
        starts = occurrences(flat, context[-m:])
        if starts:
            break
    else:
        return []
    conts = []
    for s in starts:
        c = []
        for t in flat[s + m:s + m + k]:
            if t < 0:
                break
            c.append(t)
        conts.append(c)
    out: list[int] = []
    for j in range(k):
        counts = Counter(c[j] for c in conts if len(c) > j and c[:j] == out)
        if not counts:
            break
        top = max(counts.values())
        out.append(min(t for t, n in counts.items() if n == top))
    return out


def test_proposals_equal_the_brute_force_most_frequent_continuation():
    rng = np.random.default_rng(6)
    docs = [rng.integers(0, 5, int(rng.integers(5, 60))).tolist() for _ in range(30)]
    drafter = RetrievalDrafter(memory_store(docs), max_candidates=10**9)
    proposed = 0
    for _ in range(300):
        context = rng.integers(0, 5, int(rng.integers(1, 25))).tolist()
        k = int(rng.integers(1, 9))
        p = drafter.propose(context, k, GREEDY, None)
        assert p.probs is None
        assert p.tokens == brute_proposal(docs, context, k)
        proposed += bool(p.tokens)
    assert proposed > 100


def test_proposal_prefers_the_majority_and_stops_at_document_ends():
    docs = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 9]] * 2 + [[7, 1, 2]]
    d = RetrievalDrafter(memory_store(docs))
    assert d.propose([8, 1, 2], 5, GREEDY, None).tokens == [3, 4, 5]  # ends with the documents
    assert d.last_match == 2
    assert d.propose([7, 1, 2, 3, 9], 4, GREEDY, None).tokens == []  # "3 9" ends every document it is in
    assert d.propose([0, 0], 4, GREEDY, None).tokens == [] and d.last_match == 0


def test_sampled_candidates_keep_the_dominant_continuation():
    docs = [[4, 5, 6, 7]] * 900 + [[4, 5, 8]] * 100
    d = RetrievalDrafter(memory_store(docs), max_candidates=16)
    assert d.propose([4, 5], 3, GREEDY, None).tokens == [6, 7]


# -- the on-disk datastore --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok_model(tmp_path_factory) -> Path:
    return build_tok_model(tmp_path_factory.mktemp("retrieval_model"))


@pytest.fixture(scope="module")
def tokenizer(tok_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_model))


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("other_tok"), vocab=100)


def write_corpus(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("def x ( ) : return x + 1\nprint ( x )\n")
    records = [{"text": "hello world , hello cat"}, {"prompt": "write code"}, {"turns": ["what is it", "why"]},
               {"prompt": "translate", "turns": ["the dog"]}, {"id": 7}]
    (folder / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return [folder / "a.txt", folder / "b.jsonl"]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tokenizer) -> Path:
    root = tmp_path_factory.mktemp("store")
    files = write_corpus(root / "corpus")
    build_datastore(files, tokenizer, root / "ds", progress=False)
    return root / "ds"


def test_build_and_open_round_trip(store_dir, tokenizer):
    texts = ["def x ( ) : return x + 1\nprint ( x )\n", "hello world , hello cat", "write code", "what is it\nwhy",
             "translate\nthe dog"]
    want = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False) + [-1]]
    store = Datastore.open(store_dir, tokenizer)
    assert isinstance(store.tokens, np.memmap) and isinstance(store.sa, np.memmap)
    assert store.tokens.tolist() == want
    assert store.sa.tolist() == brute_sa(np.asarray(want))
    meta = store.meta
    assert meta["n_tokens"] == len(want) and meta["n_documents"] == len(texts)
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert meta["vocab_size"] == 96 and meta["version"] == 1 and meta["build_s"] >= 0
    d = RetrievalDrafter(store)
    context = tokenizer.encode("cat hello world", add_special_tokens=False)
    assert d.propose(context, 3, GREEDY, None).tokens == tokenizer.encode(", hello cat", add_special_tokens=False)
    assert d.last_match == 2


def test_folders_are_searched_for_corpus_files(tmp_path, tokenizer):
    write_corpus(tmp_path / "c" / "sub")
    (tmp_path / "c" / "ignored.bin").write_bytes(b"\x00\xff")
    s = build_datastore([tmp_path / "c"], tokenizer, tmp_path / "ds", progress=False)
    assert s.n_documents == 5 and s.bytes_on_disk > 0


def test_open_refuses_a_missing_or_broken_store(tmp_path, store_dir, tokenizer):
    import shutil

    with pytest.raises(VerispecError, match="no datastore"):
        Datastore.open(tmp_path / "nowhere")
    with pytest.raises(VerispecError, match="meta.json is missing"):
        Datastore.open(tmp_path)

    def broken(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(store_dir, d)
        return d

    d = broken("bad_meta")
    (d / "meta.json").write_text("{not json")
    with pytest.raises(VerispecError, match="corrupt meta.json"):
        Datastore.open(d)
    d = broken("old_version")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(VerispecError, match="version 99"):
        Datastore.open(d)
    d = broken("no_suffix")
    (d / "suffix.npy").unlink()
    with pytest.raises(VerispecError, match="suffix.npy is missing"):
        Datastore.open(d)
    d = broken("truncated")
    raw = (d / "tokens.npy").read_bytes()
    (d / "tokens.npy").write_bytes(raw[: len(raw) - 8])
    with pytest.raises(VerispecError, match="corrupt tokens.npy"):
        Datastore.open(d)
    d = broken("garbage")
    (d / "suffix.npy").write_bytes(b"garbage")
    with pytest.raises(VerispecError, match="corrupt suffix.npy"):
        Datastore.open(d)
    d = broken("size")
    (d / "meta.json").write_text(json.dumps({**meta, "n_tokens": meta["n_tokens"] + 1}))
    with pytest.raises(VerispecError, match="sizes disagree"):
        Datastore.open(d)


def test_open_refuses_another_tokenizer(store_dir, other_tokenizer):
    with pytest.raises(VerispecError, match="another tokenizer"):
        Datastore.open(store_dir, other_tokenizer)
    # Without a tokenizer only the vocabulary size can be checked.
    Datastore.open(store_dir, None, vocab_size=96)
    with pytest.raises(VerispecError, match="vocabulary of 96"):
        Datastore.open(store_dir, None, vocab_size=50)


def test_build_errors(tmp_path, tokenizer):
    with pytest.raises(VerispecError, match="does not exist"):
        build_datastore([tmp_path / "missing.txt"], tokenizer, tmp_path / "ds", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(VerispecError, match="bad.jsonl:2: invalid JSON"):
        build_datastore([tmp_path / "bad.jsonl"], tokenizer, tmp_path / "ds", progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(VerispecError, match="no text"):
        build_datastore([tmp_path / "empty.txt"], tokenizer, tmp_path / "ds", progress=False)


# -- in the engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tok_model) -> Engine:
    return Engine.from_pretrained(str(tok_model), dtype="float32", max_len=256, progress=False)


@pytest.fixture(scope="module")
def plain(engine):
    return plain_outputs(engine, PROMPTS)


@pytest.fixture(scope="module")
def echo_store(tmp_path_factory, plain, tokenizer) -> Path:
    """The target's own greedy outputs (plus filler) as a datastore: drafts often hit."""
    return build_echo_store(tmp_path_factory.mktemp("echo"), tokenizer, PROMPTS, plain)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_retrieval_greedy_matches_plain(engine, plain, echo_store, k):
    results = engine.generate(PROMPTS, GREEDY, SpecConfig(k_policy="fixed", method="retrieval", k=k,
                                                          datastore=str(echo_store)))
    assert [r.token_ids for r in results] == plain
    drafted = sum(r.metrics.drafted for r in results)
    accepted = sum(r.metrics.accepted for r in results)
    assert 0 < accepted <= drafted


def test_retrieval_needs_a_matching_datastore(engine, tmp_path, store_dir, other_tokenizer):
    with pytest.raises(VerispecError, match="needs a datastore"):
        engine.generate([3, 4], GREEDY, SpecConfig(k_policy="fixed", method="retrieval", k=3))
    with pytest.raises(VerispecError, match="no datastore"):
        engine.generate([3, 4], GREEDY, SpecConfig(k_policy="fixed", method="retrieval", k=3,
                                                   datastore=str(tmp_path / "x")))
    other = tmp_path / "other"
    (tmp_path / "c.txt").write_text("hello world")
    build_datastore([tmp_path / "c.txt"], other_tokenizer, other, progress=False)
    with pytest.raises(VerispecError, match="another tokenizer"):
        engine.generate([3, 4], GREEDY, SpecConfig(k_policy="fixed", method="retrieval", k=3, datastore=str(other)))


def test_retrieval_sampling_is_exact(tmp_path):
    """Deterministic drafts (q one-hot) keep sampled output distributed exactly as the target's."""
    target = build_tiny(tmp_path / "t", vocab=12, layers=1, dim=32, heads=2, kv_heads=1, seed=0, scale=4.0)
    engine = make_engine(target)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5]
    # A store of the target's own samples: proposals are sometimes accepted, sometimes not.
    docs = [prompt + engine.generate(prompt, SamplingParams(max_tokens=4, seed=1000 + i, temperature=1.0))[0].token_ids
            for i in range(40)]
    drafter = RetrievalDrafter(memory_store(docs))
    spec = SpecConfig(k_policy="fixed", method="retrieval", k=3)
    counts = sampled_first_two(engine, prompt, params, spec, 1200, drafter=drafter)
    assert chi_square_p(counts, exact_first_two(target, prompt, params)) > 1e-3


def test_cli_builds_a_datastore_and_generates_with_it(tok_model, tmp_path, capsys):
    files = write_corpus(tmp_path / "corpus")
    out = tmp_path / "ds"
    assert main(["datastore", "build", *map(str, files), "-o", str(out), "--model", str(tok_model)]) == 0
    summary = capsys.readouterr().out
    assert "tokens from 5 documents" in summary and "MiB on disk" in summary
    args = ["generate", "--model", str(tok_model), "--dtype", "float32", "--max-len", "64", "--prompt", "hello world",
            "--max-tokens", "6", "--method", "retrieval", "-k", "3"]
    spec = _spec_from(build_parser().parse_args([*args, "--datastore", str(out), "--layers", "1"]))
    assert (spec.method, spec.k, spec.datastore, spec.layers) == ("retrieval", 3, str(out), 1)
    assert main([*args, "--datastore", str(tmp_path / "nowhere")]) == 2
    assert "no datastore" in capsys.readouterr().err
