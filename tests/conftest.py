"""Shared fixtures: tiny random models saved as Hugging Face folders, built once per session.

Nothing here touches the real models; every folder lives under pytest's tmp_path_factory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import make_tiny

from verispec.models.llama import Transformer
from verispec.models.loader import build_model, open_source

# Tiny models run hundreds of small ops per generation; one intra-op thread avoids oversubscribing
# the (shared, 2-core) CPU and makes the suite several times faster and its timing far steadier.
torch.set_num_threads(1)

# The default vocabulary of the "big" tiny models; the draft must share it.
VOCAB = 96
# Small-vocabulary models for exact-distribution tests (every joint outcome can be enumerated).
SMALL_VOCAB = 12


@dataclass
class Tiny:
    """A tiny model: its folder, the transformers reference and our decoder built from the folder."""

    folder: Path
    hf: Any
    model: Transformer

    @property
    def path(self) -> str:
        return str(self.folder)


def _tiny(factory: pytest.TempPathFactory, name: str, **kwargs: Any) -> Tiny:
    folder = factory.mktemp(name)
    hf = make_tiny(folder, **kwargs)
    model = build_model(open_source(folder), torch.float32, progress=False)
    return Tiny(folder, hf, model)


@pytest.fixture(scope="session")
def qwen2_tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """Qwen2 target: q/k/v biases, untied lm_head, GQA 4:2."""
    return _tiny(tmp_path_factory, "qwen2", arch="qwen2", vocab=VOCAB, layers=2, dim=64, heads=4, kv_heads=2,
                 seed=0, tie=False)


@pytest.fixture(scope="session")
def llama_tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """Llama target: no biases, tied embeddings, GQA 4:1."""
    return _tiny(tmp_path_factory, "llama", arch="llama", vocab=VOCAB, layers=2, dim=64, heads=4, kv_heads=1,
                 seed=1, tie=True)


@pytest.fixture(scope="session")
def qwen2_draft_tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """An unrelated Qwen2 draft (different seed and depth) with the target's vocabulary."""
    return _tiny(tmp_path_factory, "qwen2_draft", arch="qwen2", vocab=VOCAB, layers=1, dim=32, heads=2, kv_heads=1,
                 seed=2, tie=False)


def _noisy_copy(factory: pytest.TempPathFactory, name: str, ref: Tiny, noise: float, noise_seed: int,
                **kwargs: Any) -> Tiny:
    """``ref``'s weights plus Gaussian noise (``noise`` times each tensor's std), saved as a new folder.

    ``kwargs`` must repeat ``ref``'s :func:`make_tiny` shape arguments.
    """
    folder = factory.mktemp(name)
    hf = make_tiny(folder, **kwargs)
    gen = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for (_, p), (_, r) in zip(hf.named_parameters(), ref.hf.named_parameters(), strict=True):
            p.copy_(r + noise * r.std() * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(folder)
    return Tiny(folder, hf, build_model(open_source(folder), torch.float32, progress=False))


@pytest.fixture(scope="session")
def qwen2_noisy_draft_tiny(tmp_path_factory: pytest.TempPathFactory, qwen2_tiny: Tiny) -> Tiny:
    """The qwen2 target's weights plus noise: agrees with the target often but not always."""
    return _noisy_copy(tmp_path_factory, "qwen2_noisy", qwen2_tiny, 0.04, 123, arch="qwen2", vocab=VOCAB,
                       layers=2, dim=64, heads=4, kv_heads=2, seed=0, tie=False)


@pytest.fixture(scope="session")
def small_vocab_target(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """A 12-token Qwen2 target with scaled weights, so its distributions are decisive but not one-hot."""
    return _tiny(tmp_path_factory, "small_target", arch="qwen2", vocab=SMALL_VOCAB, layers=1, dim=32, heads=2,
                 kv_heads=1, seed=0, scale=4.0)


@pytest.fixture(scope="session")
def small_vocab_draft(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """A different-seed 12-token draft for :func:`small_vocab_target`."""
    return _tiny(tmp_path_factory, "small_draft", arch="qwen2", vocab=SMALL_VOCAB, layers=1, dim=32, heads=2,
                 kv_heads=1, seed=7, scale=4.0)


@pytest.fixture(scope="session")
def other_vocab_draft(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """A draft whose vocabulary size differs from the targets' (and which has no tokenizer)."""
    return _tiny(tmp_path_factory, "other_vocab", arch="qwen2", vocab=VOCAB + 8, layers=1, dim=32, heads=2,
                 kv_heads=1, seed=3)


@pytest.fixture(scope="session")
def small_vocab_close_draft(tmp_path_factory: pytest.TempPathFactory, small_vocab_target: Tiny) -> Tiny:
    """The small target plus noise: q differs from p (TV ~0.3) yet drafts are often accepted."""
    return _noisy_copy(tmp_path_factory, "small_close", small_vocab_target, 0.15, 5, arch="qwen2",
                       vocab=SMALL_VOCAB, layers=1, dim=32, heads=2, kv_heads=1, seed=0, scale=4.0)


@pytest.fixture(scope="session")
def chat_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A Llama target and a noisy copy of it as draft (high but imperfect acceptance), both folders with the tiny
    word-level tokenizer and chat template (``tests/tiny_tokenizer.py``): what ``verispec bench`` runs on."""
    from tiny_tokenizer import make_tiny_tokenizer

    target_dir, draft_dir = tmp_path_factory.mktemp("bench_target"), tmp_path_factory.mktemp("bench_draft")
    kwargs: dict[str, Any] = dict(arch="llama", vocab=VOCAB, layers=2, dim=64, heads=4, kv_heads=2, seed=11,
                                  scale=3.0)
    target = make_tiny(target_dir, **kwargs)
    draft = make_tiny(draft_dir, **kwargs)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p, r in zip(draft.parameters(), target.parameters(), strict=True):
            p.copy_(r + 0.05 * r.std() * torch.randn(p.shape, generator=gen))
    draft.save_pretrained(draft_dir)
    for folder in (target_dir, draft_dir):
        make_tiny_tokenizer(folder, VOCAB)
    return str(target_dir), str(draft_dir)


@pytest.fixture(scope="module")
def noisy_pair_engine(qwen2_tiny: Tiny, qwen2_noisy_draft_tiny: Tiny) -> Any:
    """An engine (token ids, no tokenizer) over the qwen2 target and its noisy draft; one per test module,
    since tests wrap its drafters."""
    from drafters_common import make_engine

    return make_engine(qwen2_tiny.model, qwen2_noisy_draft_tiny.model)
