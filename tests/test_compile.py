"""The compiled step (torch.compile, static bucketed shapes) gives the eager step's tokens."""

from __future__ import annotations

import logging

import torch

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.engine import compiled
from verispec.models.loader import build_model, open_source

PROMPT = [3, 17, 5, 29, 11, 42, 8]


def _engine(target_path: str, draft_path: str, compile: bool) -> Engine:
    # Fresh model objects: compiling swaps a model's forward in place.
    target = build_model(open_source(target_path), torch.float32, progress=False)
    draft = build_model(open_source(draft_path), torch.float32, progress=False)
    cfg = EngineConfig(model=target_path, dtype="float32", max_len=128, progress=False, compile=compile, compile_k=2)
    return Engine(cfg, target, None, {1}, draft=draft)


def test_compiled_and_eager_give_identical_greedy_tokens(qwen2_tiny, qwen2_draft_tiny):
    eager = _engine(qwen2_tiny.path, qwen2_draft_tiny.path, compile=False)
    comp = _engine(qwen2_tiny.path, qwen2_draft_tiny.path, compile=True)
    assert isinstance(comp.target.forward, compiled.CompiledForward)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for spec in (None, SpecConfig(k_policy="fixed", method="draft", k=2), SpecConfig(k_policy="fixed",
                                                                                     method="ngram", k=3)):
        want = eager.generate(PROMPT, params, spec)[0].token_ids
        got = comp.generate(PROMPT, params, spec)[0].token_ids
        assert got == want, spec
    assert not comp.target.forward.failed


def test_compile_failure_falls_back_to_eager_with_one_warning(qwen2_tiny, qwen2_draft_tiny, monkeypatch, caplog):
    def broken(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    eager = _engine(qwen2_tiny.path, qwen2_draft_tiny.path, compile=False)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        comp = _engine(qwen2_tiny.path, qwen2_draft_tiny.path, compile=True)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        assert comp.generate(PROMPT, params)[0].token_ids == eager.generate(PROMPT, params)[0].token_ids
    assert comp.target.forward.failed
    warnings = [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 2  # once for the target, once for the draft: never per step
