"""A smaller model of the same tokenizer drafts tokens one at a time from its own KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from verispec.config import check_draft_window
from verispec.drafters.base import Drafter, Proposal, draft_token
from verispec.drafters.vocab import DraftVocab, SubsetHead, check_draft_vocab
from verispec.drafters.window import DraftWindow
from verispec.models.llama import Transformer
from verispec.sampling import SamplingParams


class ModelDrafter(Drafter):
    """Drafts with ``model``; greedy for greedy requests, else sampled under the same settings.

    ``draft_vocab`` (a multiple of 16) scores only the first ``draft_vocab`` ids, plus
    ``special_ids`` and the request's prompt ids, with a reduced head (:mod:`verispec.drafters.vocab`):
    a cheaper draft token, still lossless. None, or a value not below the model's vocabulary, keeps
    the full head. ``window`` reads only the first few and the last ``window`` tokens of a longer
    prompt (:mod:`verispec.drafters.window`): a cheaper first draft on long prompts, still lossless.
    """

    name = "draft"

    def __init__(self, model: Transformer, max_len: int, vocab_size: int | None = None,
                 min_confidence: float = 0.0, draft_vocab: int | None = None,
                 special_ids: Iterable[int] = (), window: int | None = None) -> None:
        self.model = model
        check_draft_window(window)
        self.window = window
        self.reads = DraftWindow()  # which tokens of this request's sequence the draft reads (set by begin)
        # Stop drafting once the draft's top probability falls below this: a likely rejection.
        self.min_confidence = min_confidence
        self.cache = model.new_cache(1, max_len)
        # Draft and target embeddings may differ in padding rows; q must live on the target's vocabulary.
        self.vocab_size = vocab_size or model.args.vocab_size
        # A request's generator lives on the target's device; drafting elsewhere samples from a
        # generator of its own on the draft's device, seeded once per request from the request's.
        self._gen_of: torch.Generator | None = None
        self._gen: torch.Generator | None = None
        check_draft_vocab(draft_vocab)
        self.subset = (DraftVocab(model, draft_vocab, special_ids)
                       if draft_vocab is not None and draft_vocab < model.args.vocab_size else None)
        self.head: SubsetHead | None = None  # this request's reduced head (its prompt's ids among the extras)

    def begin(self, prompt: list[int]) -> None:
        self.cache.reset(0)
        self.reads = DraftWindow.for_prompt(len(prompt), self.window)
        if self.subset is not None:
            self.head = self.subset.head(prompt)

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        seq = self.reads.view(seq)
        start = min(self.cache.lengths[0], len(seq) - 1)
        # Catch up on what the draft has not seen (the target's last token, maybe more), then draft.
        feed = seq[start:]
        k = min(k, self.cache.max_len - len(seq))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        device = self.model.device
        if not params.greedy:
            generator = self._local_generator(generator, device)
        if self.subset is not None and self.head is None:  # proposing without begin: special tokens only
            self.head = self.subset.head()
        # Only name the head when there is one: a compiled forward (engine.compiled) takes no head argument.
        head = {} if self.head is None else {"head": self.head}
        for _ in range(k):
            pos = torch.arange(start, start + len(feed), device=device).unsqueeze(0)
            logits = self.model(torch.tensor([feed], device=device), pos, self.cache, kv_len=start + len(feed),
                                last_only=True, **head)[0, -1]
            start += len(feed)
            self.cache.lengths[0] = start
            if logits.shape[-1] != self.vocab_size:
                logits = _fit_vocab(logits, self.vocab_size)
            tok, q = draft_token(logits, params, generator, self.min_confidence if tokens else 0.0)
            if tok is None:
                break
            if q is not None:
                probs.append(q)
            tokens.append(tok)
            feed = [tok]
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def _local_generator(self, generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
        if generator is None or generator.device == device:
            return generator
        if self._gen_of is not generator:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            self._gen_of, self._gen = generator, torch.Generator(device=device).manual_seed(seed)
        return self._gen

    def commit(self, n_valid: int) -> None:
        self.cache.lengths[0] = min(self.cache.lengths[0], self.reads.draft_len(n_valid))

    def catch_up_tokens(self, seq: list[int]) -> int:
        return max(0, len(self.reads.view(seq)) - 1 - self.cache.lengths[0])  # the last token is every step's own work


def _fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    if logits.shape[-1] > size:
        return logits[:size]
    return torch.nn.functional.pad(logits, (0, size - logits.shape[-1]), value=float("-inf"))
