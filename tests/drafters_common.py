"""Helpers shared by the drafter tests: tiny engines, in-memory datastores, the exact-sampling check."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import chisquare
from tiny import make_tiny
from tiny_tokenizer import make_tiny_tokenizer

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.drafters.base import Drafter, Proposal
from verispec.drafters.datastore import SEPARATOR, Datastore, build_datastore
from verispec.drafters.suffix_array import suffix_array
from verispec.models.llama import Transformer
from verispec.models.loader import build_model, open_source
from verispec.sampling import probs_from_logits

EOS = 1  # make_tiny's eos_token_id
MAX_LEN = 256
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
# Prompts with repeats, so the n-gram drafter finds matches from the first step on.
PROMPTS = [[3, 5, 7, 9, 3, 5, 7], [10, 20, 30, 40, 50, 60, 10, 20, 30], [2]]


@torch.inference_mode()
def greedy_next(target: Transformer, ids: list[int]) -> int:
    """The target's argmax after ``ids``, from a fresh cache (what a test drafter proposes or avoids)."""
    logits = target(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), target.new_cache(1, len(ids)),
                    last_only=True)
    return int(logits[0, -1].argmax())


def build_tiny(folder: Path, **kwargs) -> Transformer:
    """A tiny model saved under ``folder`` (see :func:`make_tiny`) and loaded with verispec's loader."""
    make_tiny(folder, **kwargs)
    return build_model(open_source(folder), torch.float32, progress=False)


def build_tok_model(folder: Path) -> Path:
    """A tiny 2-layer Llama target (96 tokens) saved with a word-level tokenizer; returns ``folder``.

    Llama, because transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer, whose own
    pre-tokenizer drops most of these words.
    """
    build_tiny(folder, arch="llama", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=0)
    make_tiny_tokenizer(folder, vocab=96)
    return folder


def build_no_template_model(folder: Path) -> Path:
    """:func:`build_tok_model` whose tokenizer has no chat template; returns ``folder``."""
    build_tok_model(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def build_echo_store(root: Path, tokenizer: Any, prompts: list[list[int]], outputs: list[list[int]]) -> Path:
    """A datastore of prompts followed by the target's greedy outputs (as text), plus unrelated filler."""
    lines = [" ".join(tokenizer.convert_ids_to_tokens(p + out)) for p, out in zip(prompts, outputs, strict=True)]
    lines += ["the cat is on the dog", "def x ( ) : return 1"]
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines) + "\n")
    build_datastore([root / "corpus.jsonl"], tokenizer, root / "ds", progress=False)
    return root / "ds"


def make_engine(target: Transformer, draft: Transformer | None = None, max_len: int = MAX_LEN) -> Engine:
    """An engine over already built models, without a tokenizer (prompts are token ids)."""
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=max_len, progress=False)
    return Engine(cfg, target, None, {EOS}, draft=draft)


def memory_store(docs: list[list[int]]) -> Datastore:
    """A datastore held in memory (same layout as on disk: documents each followed by a separator)."""
    parts = [np.asarray(d + [SEPARATOR], dtype=np.int32) for d in docs]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return Datastore(Path("<memory>"), tokens, suffix_array(tokens), {"n_tokens": len(tokens)})


def plain_outputs(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, params)]


# -- exact sampling: the first two tokens against the target's own distribution ---------------

@torch.inference_mode()
def exact_first_two(target: Transformer, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(x1, x2 | prompt) under ``params`` for every pair, flattened to ``[V * V]``."""
    vocab = target.args.vocab_size
    cands = torch.tensor([prompt + [x] for x in range(vocab)])
    pos = torch.arange(cands.shape[1]).expand(vocab, -1)
    cache = target.new_cache(vocab, cands.shape[1])
    logits = target(cands, pos, cache)
    p1 = probs_from_logits(logits[0, len(prompt) - 1], params)
    p2 = probs_from_logits(logits[:, -1], params)
    return (p1[:, None] * p2).flatten().double().numpy()


def sampled_first_two(engine: Engine, prompt: list[int], params: SamplingParams, spec: SpecConfig, n: int,
                      drafter: Drafter | None = None) -> np.ndarray:
    """Counts of (x1, x2) over ``n`` seeded speculative generations (3 tokens, so the first step drafts 2)."""
    vocab = engine.target.args.vocab_size
    counts = np.zeros(vocab * vocab)
    for seed in range(n):
        out = engine.generate(prompt, replace(params, seed=seed, max_tokens=3, ignore_eos=True), spec,
                              drafter=drafter)[0].token_ids
        counts[out[0] * vocab + out[1]] += 1
    return counts


def chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value of ``counts`` against ``probs``; cells expected below ``min_expected`` are pooled."""
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert counts[expected == 0].sum() == 0, "sampled an outcome of probability zero"
    return float(chisquare(obs, exp).pvalue)


class FailingDrafter(Drafter):
    """Proposes nothing for ``after`` steps, then raises: in ``propose`` if the step drafts, else in
    ``commit``, which every step calls. A drafter fault in the middle of a request."""

    name = "failing"

    def __init__(self, after: int) -> None:
        self.after, self.steps = after, 0

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        if self.steps >= self.after:
            raise RuntimeError("injected drafter fault")
        return Proposal([])

    def commit(self, n_valid: int) -> None:
        self.steps += 1
        if self.steps > self.after:
            raise RuntimeError("injected drafter fault")
