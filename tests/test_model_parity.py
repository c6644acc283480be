"""Logit parity of verispec's decoder with the transformers implementation on the same random weights.

Covers prefill, cached single-token decoding, multi-token forwards on top of a cache (the
verification shape), rollback by truncation and batches whose rows have different lengths.
"""

from __future__ import annotations

import pytest
import torch

from verispec.models.linear import Int8Linear
from verispec.models.loader import build_model, open_source

ATOL = 1e-4
ARCHS = ["qwen2_tiny", "llama_tiny"]


@pytest.fixture(params=ARCHS)
def tiny(request: pytest.FixtureRequest):
    return request.getfixturevalue(request.param)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """Full-sequence transformers logits ``[len(tokens), V]`` (no cache)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def tokens_for(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def forward(model, cache, tokens: list[int], start: int, row: int | None = None, **kw) -> torch.Tensor:
    """Run ``tokens`` at positions ``start..`` in one row of ``cache``; return logits ``[m, V]``."""
    pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
    rows = slice(None) if row is None else slice(row, row + 1)
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), pos, cache, rows=rows, **kw)
    return out[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_reference_logits_are_not_trivial(tiny):
    # Guard against a vacuous comparison: logits vary across positions and tokens.
    ref = hf_logits(tiny.hf, tokens_for(tiny.model.args.vocab_size, 8, 0))
    assert ref.std() > 1e-2
    assert max_diff(ref[0], ref[-1]) > 1e-2


def test_config_is_read_as_built(qwen2_tiny, llama_tiny):
    q, ll = qwen2_tiny.model.args, llama_tiny.model.args
    assert (q.arch, q.qkv_bias, q.tie_word_embeddings, q.n_heads, q.n_kv_heads) == ("qwen2", True, False, 4, 2)
    assert (ll.arch, ll.qkv_bias, ll.tie_word_embeddings, ll.n_heads, ll.n_kv_heads) == ("llama", False, True, 4, 1)
    # The qwen2 head really is untied, the llama head really is tied.
    assert not torch.equal(qwen2_tiny.hf.lm_head.weight, qwen2_tiny.hf.model.embed_tokens.weight)
    assert torch.equal(llama_tiny.hf.lm_head.weight, llama_tiny.hf.model.embed_tokens.weight)


def test_prefill(tiny):
    seq = tokens_for(tiny.model.args.vocab_size, 11, 1)
    cache = tiny.model.new_cache(1, 64)
    ours = forward(tiny.model, cache, seq, 0)
    assert max_diff(ours, hf_logits(tiny.hf, seq)) <= ATOL


def test_prefill_last_only(tiny):
    seq = tokens_for(tiny.model.args.vocab_size, 9, 2)
    cache = tiny.model.new_cache(1, 64)
    ours = forward(tiny.model, cache, seq, 0, last_only=True)
    assert ours.shape[0] == 1
    assert max_diff(ours[0], hf_logits(tiny.hf, seq)[-1]) <= ATOL


@pytest.mark.parametrize("explicit_kv_len", [False, True])
def test_decode_steps(tiny, explicit_kv_len):
    seq = tokens_for(tiny.model.args.vocab_size, 12, 3)
    ref = hf_logits(tiny.hf, seq)
    cache = tiny.model.new_cache(1, 64)
    forward(tiny.model, cache, seq[:6], 0)
    cache.lengths[0] = 6
    for p in range(6, len(seq)):
        kw = {"kv_len": p + 1} if explicit_kv_len else {}
        ours = forward(tiny.model, cache, [seq[p]], p, **kw)
        cache.lengths[0] = p + 1
        assert max_diff(ours[0], ref[p]) <= ATOL, f"position {p}"


def test_multi_token_forward_on_cache(tiny):
    seq = tokens_for(tiny.model.args.vocab_size, 14, 4)
    ref = hf_logits(tiny.hf, seq)
    cache = tiny.model.new_cache(1, 64)
    forward(tiny.model, cache, seq[:6], 0)
    ours = forward(tiny.model, cache, seq[6:10], 6, kv_len=10)  # m = 4, the verification shape
    assert max_diff(ours, ref[6:10]) <= ATOL
    # ... and decoding continues correctly from the K/V the m = 4 forward wrote.
    ours = forward(tiny.model, cache, seq[10:14], 10)
    assert max_diff(ours, ref[10:14]) <= ATOL


def test_long_context(tiny):
    # Far-out positions, where rotary tables and attention over many keys must still agree.
    seq = tokens_for(tiny.model.args.vocab_size, 300, 11)
    ref = hf_logits(tiny.hf, seq)
    cache = tiny.model.new_cache(1, 320)
    ours = forward(tiny.model, cache, seq[:290], 0)
    assert max_diff(ours, ref[:290]) <= ATOL
    ours = forward(tiny.model, cache, seq[290:295], 290)
    assert max_diff(ours, ref[290:295]) <= ATOL
    for p in range(295, 300):
        assert max_diff(forward(tiny.model, cache, [seq[p]], p)[0], ref[p]) <= ATOL, f"position {p}"


def test_attention_paths_agree_at_every_block_size(tiny):
    # Three attention paths: a few queries (matmul form), a long block from position 0 (SDPA's
    # causal mode) and a long block on top of a cache (SDPA with a mask, e.g. chunked prefill).
    seq = tokens_for(tiny.model.args.vocab_size, 160, 12)
    ref = hf_logits(tiny.hf, seq)
    cache = tiny.model.new_cache(1, 192)
    assert max_diff(forward(tiny.model, cache, seq[:100], 0), ref[:100]) <= ATOL
    assert max_diff(forward(tiny.model, cache, seq[100:150], 100), ref[100:150]) <= ATOL
    assert max_diff(forward(tiny.model, cache, seq[150:160], 150), ref[150:160]) <= ATOL


@pytest.mark.parametrize("new_len", [1, 3, 6])
def test_truncate_then_rewrite(tiny, new_len):
    vocab = tiny.model.args.vocab_size
    old = tokens_for(vocab, 12, 5)
    cache = tiny.model.new_cache(1, 64)
    forward(tiny.model, cache, old, 0)
    cache.lengths[0] = len(old)
    cache.truncate(0, 7)
    assert cache.lengths[0] == 7
    # New tokens that differ from the ones whose stale K/V remain past position 7.
    new = [(t + 1 + i) % vocab for i, t in enumerate(old[7:7 + new_len])]
    assert all(a != b for a, b in zip(new, old[7:], strict=False))
    rewritten = old[:7] + new
    ref = hf_logits(tiny.hf, rewritten)
    ours = forward(tiny.model, cache, new, 7)
    assert max_diff(ours, ref[7:]) <= ATOL
    # Single-token decoding after the rewrite: stale entries beyond the new length stay hidden.
    cache.lengths[0] = len(rewritten)
    more = tokens_for(vocab, 3, 6)
    ref = hf_logits(tiny.hf, rewritten + more)
    for i, t in enumerate(more):
        p = len(rewritten) + i
        ours = forward(tiny.model, cache, [t], p)
        assert max_diff(ours[0], ref[p]) <= ATOL, f"position {p}"


def test_truncate_rejects_growth(tiny):
    cache = tiny.model.new_cache(1, 16)
    cache.lengths[0] = 4
    with pytest.raises(ValueError):
        cache.truncate(0, 5)
    with pytest.raises(ValueError):
        cache.truncate(0, -1)


def test_batch_rows_of_different_lengths(tiny):
    vocab = tiny.model.args.vocab_size
    seqs = [tokens_for(vocab, 11, 7), tokens_for(vocab, 16, 8)]
    lens = [7, 12]
    cache = tiny.model.new_cache(2, 64)
    # Each row prefilled on its own. Row 0 first gets 5 junk tokens past its length, rolled back,
    # so its slots 7..11 hold stale K/V that only the per-row mask keeps out of a kv_len = 15 forward.
    junk = tokens_for(vocab, 5, 10)
    forward(tiny.model, cache, seqs[0][:lens[0]] + junk, 0, row=0)
    cache.lengths[0] = lens[0] + len(junk)
    cache.truncate(0, lens[0])
    forward(tiny.model, cache, seqs[1][:lens[1]], 0, row=1)
    cache.lengths[1] = lens[1]
    tokens = torch.tensor([s[n:n + 3] for s, n in zip(seqs, lens, strict=True)])
    positions = torch.tensor([[n, n + 1, n + 2] for n in lens])
    with torch.inference_mode():
        ours = tiny.model(tokens, positions, cache)
    for row in (0, 1):
        ref = hf_logits(tiny.hf, seqs[row][:lens[row] + 3])
        assert max_diff(ours[row], ref[lens[row]:]) <= ATOL, f"row {row}"
    # Then one more single token per row (m = 1, B = 2): still a per-row mask.
    tokens = torch.tensor([[s[n + 3]] for s, n in zip(seqs, lens, strict=True)])
    positions = torch.tensor([[n + 3] for n in lens])
    with torch.inference_mode():
        ours = tiny.model(tokens, positions, cache)
    for row in (0, 1):
        ref = hf_logits(tiny.hf, seqs[row][:lens[row] + 4])
        assert max_diff(ours[row, 0], ref[lens[row] + 3]) <= ATOL, f"row {row}"


def test_int8_weights_stay_close(tiny):
    model = build_model(open_source(tiny.folder), torch.float32, weight_format="int8", progress=False)
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    seq = tokens_for(tiny.model.args.vocab_size, 10, 9)
    ref = hf_logits(tiny.hf, seq)
    cache = model.new_cache(1, 64)
    ours = forward(model, cache, seq[:6], 0)
    cache.lengths[0] = 6
    ours = torch.cat([ours, forward(model, cache, seq[6:], 6)])
    rel = float((ours - ref).norm() / ref.norm())
    assert rel < 5e-2
    assert rel > 0  # it really is quantized
