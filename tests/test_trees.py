"""Token trees: one forward scores every node, verification keeps one root path, and the output stays exact.

- The forward: each node's logits equal those of its root path scored as a chain, bit for bit on the
  fused kernels (fp32 and bf16), to rounding on the Python path; the kernel refuses malformed masks.
- The verifiers: greedy follows the target's argmax down the tree; the multi-candidate sampling
  rule reproduces p exactly (chi-square, with a biased rule as the negative control that must fail).
- The engine: greedy trees whose accepted path is never the first child (so the cache is compacted
  every step) give plain decoding's tokens, alone and batched next to chain rows; suffix trees too;
  sampled trees are distributed as the target (chi-square on the first two tokens, negative control).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafters_common import greedy_next
from test_sampling_exact import ALPHA, exact_joint, gof_pvalue, last_logits

import verispec.engine.step
from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec import kernels as fast_kernels
from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.retrieval import continuation_tree
from verispec.errors import VerispecError
from verispec.models.loader import build_model, open_source
from verispec.sampling import sample
from verispec.verify import verify_greedy, verify_tree_sampling

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = [[3, 5, 7, 2, 9, 11], [1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42]]


def masks(parents: list[int]) -> list[int]:
    """Ancestor bit masks of [root, *nodes] for a tree given by its nodes' parents."""
    out = [1]
    for i, p in enumerate(parents):
        out.append(out[p + 1] | (1 << (i + 1)))
    return out


def root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_and_paths(model, fused: bool):
    """Logits of a 7-node tree (next to a chain row) and, per node, of its root path as a chain step."""
    prompt = [3, 5, 7, 2, 9, 11]
    tokens, parents = [10, 20, 30, 40, 50, 60, 70], [-1, -1, 0, 1, 1, 3, 2]
    n, m = len(prompt) - 1, len(tokens) + 1
    saved = model.fused_ops
    model.fused_ops = fused
    try:
        with torch.inference_mode():
            # Two rows: the tree, and a chain row (every earlier bit) at another length next to it.
            cache = model.new_cache(2, 40)
            model(torch.tensor([prompt[:-1]]), torch.arange(n)[None], cache, rows=slice(0, 1))
            model(torch.tensor([prompt[1:-1]]), torch.arange(n - 1)[None], cache, rows=slice(1, 2))
            prefilled = [(k.clone(), v.clone()) for k, v in zip(cache.k, cache.v, strict=True)]
            tree = torch.tensor([masks(parents), [(1 << (t + 1)) - 1 for t in range(m)]])
            pos = torch.stack([torch.arange(n, n + m), torch.arange(n - 1, n - 1 + m)])
            out = model(torch.tensor([[prompt[-1], *tokens]] * 2), pos, cache, tree=tree)
            # Each root path as a chain step of the same shape (padded with its last token, as the engine
            # pads): the projections then see the same rows, and only attention differs.
            chains = []
            for node in range(-1, len(tokens)):
                path = [prompt[-1]] + [tokens[i] for i in root_path(parents, node)]
                for (k, v), (k0, v0) in zip(zip(cache.k, cache.v, strict=True), prefilled, strict=True):
                    k.copy_(k0)
                    v.copy_(v0)
                padded = path + [path[-1]] * (m - len(path))
                step = model(torch.tensor([padded, [prompt[-1], *tokens]]), pos, cache)
                chains.append(step[0, len(path) - 1])
            for k, v in zip(cache.k, cache.v, strict=True):
                k[1:].zero_()
                v[1:].zero_()
            chain_row = model(torch.tensor([prompt[1:] + tokens]), torch.arange(len(prompt) - 1 + len(tokens))[None],
                              model.new_cache(1, 40))[0, -m:]
    finally:
        model.fused_ops = saved
    return out, chains, chain_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_tree_nodes_equal_their_root_paths_bit_for_bit(qwen2_tiny, llama_tiny, dtype):
    if dtype not in fast_kernels.small_ops_dtypes():
        pytest.skip(f"this CPU does not run verispec's fused kernels in {dtype}")
    for tiny in (qwen2_tiny, llama_tiny):  # GQA 4:2 with q/k/v biases; 4:1
        model = build_model(open_source(tiny.folder), dtype, progress=False)
        assert model.fused_ops
        out, chains, _ = tree_and_paths(model, fused=True)
        for node, ref in enumerate(chains):
            assert torch.equal(out[0, node], ref), f"node {node - 1} differs from its root path run as a chain"


def test_python_path_tree_nodes_match_their_root_paths(qwen2_tiny):
    out, chains, chain_row = tree_and_paths(qwen2_tiny.model, fused=False)
    for node, ref in enumerate(chains):
        torch.testing.assert_close(out[0, node], ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], chain_row, rtol=1e-4, atol=1e-4)


def test_attend_refuses_malformed_trees():
    if not fast_kernels.small_ops_dtypes():
        pytest.skip("this CPU does not run verispec's fused kernels")
    b, m, h, kv, d = 1, 3, 2, 1, 16
    qkv = torch.randn(b, m, (h + 2 * kv) * d)
    cos, sin = torch.ones(b, m, d), torch.zeros(b, m, d)
    k, v = torch.zeros(b, kv, 8, d), torch.zeros(b, kv, 8, d)
    pos = torch.tensor([[2, 3, 4]])
    fast_kernels.attend(qkv, cos, sin, pos, k, v, 5, h, kv, torch.tensor([[1, 3, 5]]))  # a root with two children
    for bad in ([1, 1, 5], [1, 3, 13], [3, 3, 5]):  # without itself; a later node; a bit above itself
        with pytest.raises(RuntimeError, match="ancestors"):
            fast_kernels.attend(qkv, cos, sin, pos, k, v, 5, h, kv, torch.tensor([bad]))
    with pytest.raises(RuntimeError, match="consecutive"):
        fast_kernels.attend(qkv, cos, sin, torch.tensor([[2, 3, 5]]), k, v, 6, h, kv, torch.tensor([[1, 3, 5]]))


# -- the verification rules ------------------------------------------------------------------------

def test_verify_greedy_follows_the_argmax_down_the_tree():
    logits = torch.full((6, 8), -1.0)
    # Rows: root, then nodes 0..4. The target wants 4 after the root, 6 after node 1, 2 after node 3.
    for row, t in enumerate([4, 0, 6, 5, 2, 7]):
        logits[row, t] = 1.0
    tokens, parents = [3, 4, 1, 6, 5], [-1, -1, 0, 1, 1]
    assert verify_greedy(tokens, logits, parents) == ([1, 3], 2)
    assert verify_greedy([3, 5], logits[:3], [-1, -1]) == ([], 4)  # no child matches: the target's token
    assert verify_greedy([4, 1], logits[:3]) == ([0], 0)  # a chain: 4 kept, then the target wants 0
    with pytest.raises(ValueError, match="parent"):
        verify_greedy(tokens, logits, [-1, 1, 0, 1, 1])


def test_tree_sampling_rule_reproduces_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.35, 0.25, 0.25, 0.15, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    tokens, parents = [1, 0, 4, 3], [-1, -1, -1, 1]  # three candidates at the root (one impossible), one below
    firsts = np.zeros(5, dtype=np.int64)
    for _ in range(4000):
        path, extra = verify_tree_sampling(tokens, parents, p.repeat(3, 1)[:5], g)
        first = tokens[path[0]] if path else extra
        firsts[first] += 1
        assert 4 not in [tokens[i] for i in path]
    assert firsts[4] == 0
    expected = p[0, :4].numpy() * 4000
    chi2 = float((((firsts[:4] - expected) ** 2) / expected).sum())
    assert chi2 < 16.3, (firsts, expected)  # chi-square, 3 degrees of freedom, p = 1e-3


# -- the engine -----------------------------------------------------------------------------------

class Oracle(Drafter):
    """Greedy trees whose right path is always the second child: [wrong, right] at every depth."""

    name = "tree-oracle"

    def __init__(self, target) -> None:
        self.target = target
        self.calls = 0

    def propose(self, seq, k, params, generator) -> Proposal:
        self.calls += 1
        tokens: list[int] = []
        parents: list[int] = []
        right, parent = list(seq), -1
        while len(tokens) + 2 <= k:
            t = greedy_next(self.target, right)
            tokens += [(t + 1) % self.target.args.vocab_size, t]
            parents += [parent, parent]
            parent = len(tokens) - 1
            right.append(t)
        return Proposal(tokens, parents=parents) if tokens else Proposal([])


def make_engine(tiny, max_batch: int = 1, draft=None) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=96, progress=False, max_batch=max_batch)
    return Engine(cfg, tiny.model, None, {1}, draft=None if draft is None else draft.model)


@pytest.mark.parametrize("k", [2, 5, 8])
def test_greedy_trees_equal_plain_decoding_with_compaction(qwen2_tiny, k):
    engine = make_engine(qwen2_tiny)
    plain = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    drafter = Oracle(qwen2_tiny.model)
    results = engine.generate(PROMPTS, GREEDY, SpecConfig(method="ngram", k_policy="fixed", k=k), drafter=drafter)
    assert [r.token_ids for r in results] == plain
    assert drafter.calls > 0
    for r in results:  # every tree's right path is kept whole: a tree counts as drafting its depth
        assert r.metrics.accepted == r.metrics.drafted > 0
        assert r.metrics.steps < len(r.token_ids)


def test_batched_trees_next_to_chains_equal_alone(qwen2_tiny, qwen2_noisy_draft_tiny):
    alone = make_engine(qwen2_tiny, draft=qwen2_noisy_draft_tiny)
    plain = [r.token_ids for r in alone.generate(PROMPTS, GREEDY)]
    batched = make_engine(qwen2_tiny, max_batch=3, draft=qwen2_noisy_draft_tiny)
    oracle = Oracle(qwen2_tiny.model)
    handles = [batched.submit(PROMPTS[0], GREEDY, SpecConfig(method="ngram", k_policy="fixed", k=6), drafter=oracle),
               batched.submit(PROMPTS[1], GREEDY, SpecConfig(method="draft", k_policy="fixed", k=3)),
               batched.submit(PROMPTS[2], GREEDY, SpecConfig(method="ngram", k_policy="fixed", k=4))]
    while batched.has_work:
        batched.step()
    assert [h.result().token_ids for h in handles] == plain
    assert batched.stats.mean_rows > 1


@pytest.mark.parametrize("lookup", ["suffix", "hybrid"])
def test_suffix_trees_equal_plain(qwen2_tiny, qwen2_noisy_draft_tiny, lookup):
    engine = make_engine(qwen2_tiny, draft=qwen2_noisy_draft_tiny)
    # Repeats with different continuations: the suffix index disagrees with itself, so drafts branch.
    prompts = [[5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7, 3, 5, 6, 7], [9, 8, 9, 7, 9, 8, 9, 6, 9, 8]]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    method = {"suffix": dict(method="suffix"), "hybrid": dict(method="hybrid", lookup="suffix")}[lookup]
    spec = SpecConfig(k_policy="fixed", k=6, suffix_width=3, suffix_min_prob=0.0, **method)
    drafter = engine.drafter(spec)
    seen_tree = []
    propose = type(drafter).propose

    def spy(self, seq, k, p, g):
        proposal = propose(self, seq, k, p, g)
        seen_tree.append(proposal.parents is not None)
        return proposal

    drafter.propose = spy.__get__(drafter)
    assert [r.token_ids for r in engine.generate(prompts, params, spec, drafter=drafter)] == plain
    assert any(seen_tree)


def test_continuation_tree_grows_best_first():
    conts = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]])
    assert continuation_tree(conts, 3) == ([1, 2, 3], [-1, 0, 1])  # width 1: the greedy most frequent path
    # Width 2: 1 (3/4), 2 (1/2), 5 (1/4) and 7 (1/4) in order of probability; 3 and 4 (1/4 each) after 5 and 7.
    assert continuation_tree(conts, 4, width=2) == ([1, 2, 7, 5], [-1, 0, -1, 0])
    assert continuation_tree(conts, 6, width=2)[0] == [1, 2, 7, 5, 3, 4]
    assert continuation_tree(conts, 8, min_prob=0.3, width=2) == ([1, 2], [-1, 0])


def test_tree_width_is_validated_and_needs_the_eager_forward(qwen2_tiny):
    for bad in (0, 9, 1.5, True):
        with pytest.raises(VerispecError, match="suffix_width"):
            SpecConfig(method="suffix", suffix_width=bad)
    engine = make_engine(qwen2_tiny)
    ctx = engine.draft_context
    from dataclasses import replace

    from verispec.drafters import make_drafter

    with pytest.raises(VerispecError, match="token trees"):
        make_drafter(SpecConfig(method="suffix", suffix_width=2), replace(ctx, trees=False))


# -- sampling through the engine ------------------------------------------------------------------

class FixedTree(Drafter):
    """The target's two likeliest first tokens; below the first, its two likeliest; below the second, one."""

    name = "fixed-tree"

    def __init__(self, target) -> None:
        self.target = target

    @torch.inference_mode()
    def propose(self, seq, k, params, generator) -> Proposal:
        first = last_logits(self.target, [seq])[0].topk(2).indices.tolist()
        a = last_logits(self.target, [seq + [first[0]]])[0].topk(2).indices.tolist()
        b = last_logits(self.target, [seq + [first[1]]])[0].topk(1).indices.tolist()
        return Proposal([first[0], first[1], *a, *b], parents=[-1, -1, 0, 0, 1])


def biased_tree_rule(draft, parents, target_probs, generator):
    """A wrong rule: the candidates' test is right, but after all are rejected it draws from the whole p."""
    kids = {}
    for i, parent in enumerate(parents):
        kids.setdefault(parent, []).append(i)
    path, node = [], -1
    while True:
        p = target_probs[node + 1]
        for c in kids.get(node, ()):
            if float(torch.rand(1, generator=generator)) < float(p[draft[c]]):
                path.append(c)
                node = c
                break
        else:
            return path, sample(p, generator)


def draw_tree(engine, target, prompt, n, seed0=0):
    vocab = target.args.vocab_size
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    spec = SpecConfig(method="ngram", k_policy="fixed", k=5)
    drafter = FixedTree(target)
    accepted = drafted = 0
    for i in range(n):
        params = SamplingParams(max_tokens=6, ignore_eos=True, seed=seed0 + i, temperature=1.0)
        r = engine.generate(prompt, params, spec, drafter=drafter)[0]
        counts[r.token_ids[0], r.token_ids[1]] += 1
        accepted += r.metrics.accepted
        drafted += r.metrics.drafted
    return counts, accepted, drafted


def test_sampled_trees_match_the_target(small_vocab_target):
    target = small_vocab_target.model
    engine = make_engine(small_vocab_target)
    prompt = [3, 5, 7, 2]
    joint = exact_joint(target, prompt, SamplingParams(temperature=1.0))
    counts, accepted, drafted = draw_tree(engine, target, prompt, 3000)
    assert 0 < accepted < drafted
    p = gof_pvalue(counts, joint)
    assert p > ALPHA, f"tree-sampled tokens deviate from the target distribution (p = {p:.2e})"


def test_negative_control_biased_tree_rule_is_caught(small_vocab_target, monkeypatch):
    monkeypatch.setattr(verispec.engine.step, "verify_tree_sampling", biased_tree_rule)
    target = small_vocab_target.model
    engine = make_engine(small_vocab_target)
    prompt = [3, 5, 7, 2]
    joint = exact_joint(target, prompt, SamplingParams(temperature=1.0))
    counts, _, _ = draw_tree(engine, target, prompt, 3000)
    p = gof_pvalue(counts, joint)
    assert p < ALPHA, f"the goodness-of-fit test missed a biased tree rule (p = {p:.2e})"
