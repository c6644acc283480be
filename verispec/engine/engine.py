"""The engine: loads a target (and optionally a draft model) and generates, plain or speculative."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.config import PLAIN, EngineConfig, SpecConfig, resolve_dtype
from verispec.drafters.base import Drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine.metrics import Metrics
from verispec.engine.step import speculative_step
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.llama import Transformer
from verispec.models.loader import build_model, load_tokenizer, open_source
from verispec.sampling import SamplingParams

Prompt = str | list[int] | list[dict[str, str]]


@dataclass
class GenerationResult:
    """One request's output: text (when a tokenizer is present), token ids and what it measured."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    metrics: Metrics = field(repr=False)


def check_tokenizers_match(target_tok: Any, draft_tok: Any, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose tokens mean something else than the target's.

    Embedding tables may differ in padding (e.g. 151936 rows for 151665 real tokens), so
    the tokenizers themselves are compared: same vocabulary and same special tokens.
    """
    if target_tok is None or draft_tok is None:
        if target_vocab != draft_vocab:
            raise VerispecError(f"draft and target vocabularies differ in size ({draft_vocab} vs {target_vocab})"
                                " and there is no tokenizer to compare")
        return
    vt, vd = target_tok.get_vocab(), draft_tok.get_vocab()
    if vt != vd:
        diff = sorted(set(vt.items()) ^ set(vd.items()), key=lambda kv: kv[1])
        raise VerispecError(f"draft and target tokenizers differ ({len(diff)} mismatched entries, e.g. "
                            f"{diff[0]!r}); pick a draft model from the target's family")
    if set(target_tok.all_special_tokens) != set(draft_tok.all_special_tokens) or \
            target_tok.eos_token != draft_tok.eos_token:
        raise VerispecError("draft and target tokenizers have different special tokens")
    if len(vt) > min(target_vocab, draft_vocab):
        raise VerispecError(f"tokenizer has {len(vt)} tokens but a model embeds only {min(target_vocab, draft_vocab)}")


class Engine:
    """Generates from a target model, optionally speculating with a drafter.

    Build with :meth:`from_pretrained`; call :meth:`generate`.
    """

    def __init__(self, config: EngineConfig, target: Transformer, tokenizer: Any | None, eos_ids: set[int],
                 draft: Transformer | None = None, draft_tokenizer: Any | None = None) -> None:
        self.config = config
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        if draft is not None:
            check_tokenizers_match(tokenizer, draft_tokenizer, target.args.vocab_size, draft.args.vocab_size)
        self.cache = target.new_cache(1, config.max_len)
        self._drafters: dict[str, Drafter] = {}

    @classmethod
    def from_pretrained(cls, model: str, draft: str | None = None, **kwargs: Any) -> Engine:
        """Load ``model`` (registry name, GGUF file or Hugging Face folder) and optionally a ``draft``.

        Keyword arguments are :class:`EngineConfig` fields (dtype, max_len, weights, ...).
        """
        config = EngineConfig(model=model, draft=draft, **kwargs)
        src = open_source(model)
        dtype = resolve_dtype(config.dtype, config.device)
        target = build_model(src, dtype, config.weights, config.progress).to(config.device)
        tokenizer = load_tokenizer(src)
        draft_model = draft_tok = None
        if draft is not None:
            dsrc = open_source(draft)
            ddtype = resolve_dtype(config.draft_dtype or config.dtype, config.device)
            draft_model = build_model(dsrc, ddtype, config.draft_weights, config.progress).to(config.device)
            draft_tok = load_tokenizer(dsrc)
        logger.info("loaded %s (%s)%s", src.path.name, dtype, f" with draft {draft}" if draft else "")
        return cls(config, target, tokenizer, src.eos_token_ids, draft_model, draft_tok)

    # -- drafters -------------------------------------------------------------------------

    def drafter(self, spec: SpecConfig) -> Drafter | None:
        """The drafter for ``spec`` (created once and reused across requests)."""
        if not spec.enabled:
            return None
        key = f"{spec.method}:{spec.ngram_min}:{spec.ngram_max}"
        if key not in self._drafters:
            if spec.method == "draft":
                if self.draft is None:
                    raise VerispecError("method 'draft' needs a draft model (--draft)")
                self._drafters[key] = ModelDrafter(self.draft, self.config.max_len, self.target.args.vocab_size)
            elif spec.method == "ngram":
                self._drafters[key] = NgramDrafter(spec.ngram_max, spec.ngram_min)
        return self._drafters[key]

    # -- tokenization ---------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or chat messages (``chat=True`` for a string)."""
        vocab = self.target.args.vocab_size
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < vocab for t in ids):
                raise VerispecError(f"token ids must be in [0, {vocab})")
        else:
            if self.tokenizer is None:
                raise VerispecError("this model has no tokenizer; pass token ids")
            if isinstance(prompt, list) or chat:
                messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                if not self.tokenizer.chat_template:
                    raise VerispecError("this model's tokenizer has no chat template")
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                ids = list(ids)
            elif isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            else:
                raise VerispecError("a prompt is a string, a list of token ids or a list of chat messages")
        if not ids:
            bos = self.tokenizer.bos_token_id if self.tokenizer is not None else None
            if bos is None:
                raise VerispecError("the prompt is empty and this model has no BOS token to start from")
            ids = [bos]
        if len(ids) >= self.config.max_len:
            raise VerispecError(f"the prompt has {len(ids)} tokens but the context holds {self.config.max_len} "
                                "(one position must be left to generate)")
        return ids

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None,
                 spec: SpecConfig | None = None, chat: bool = False,
                 drafter: Drafter | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts; returns one result per prompt.

        ``spec=None`` decodes plainly. ``drafter`` plugs in a custom :class:`Drafter` instead of
        the one ``spec.method`` names (``spec.k`` still applies). Every prompt is encoded and
        checked before any work starts, so one bad prompt costs nothing.
        """
        params = params or SamplingParams()
        spec = spec or PLAIN
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        if params.stop and self.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer")
        encoded = [self.encode(p, chat) for p in prompts]
        if drafter is None:
            drafter = self.drafter(spec)
        return [self._generate_one(ids, params, spec, drafter) for ids in encoded]

    @torch.inference_mode()
    def _generate_one(self, prompt: list[int], params: SamplingParams, spec: SpecConfig,
                      drafter: Drafter | None) -> GenerationResult:
        m = Metrics(requests=1, prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        generator = None if params.greedy else params.generator()
        seq = list(prompt)
        # Prefill all but the last prompt token: the first step scores it with the first draft.
        self.cache.reset(0)
        if len(prompt) > 1:
            with m.timed("prefill"):
                pos = torch.arange(len(prompt) - 1).unsqueeze(0)
                self.target(torch.tensor([prompt[:-1]]), pos, self.cache, last_only=True)
                self.cache.lengths[0] = len(prompt) - 1
        if drafter is not None:
            drafter.begin(prompt)
        out: list[int] = []
        finish = None
        while finish is None:
            room = self.config.max_len - len(seq)  # positions left; a step uses k + 1 of them
            if room < 1:
                finish = "length"
                break
            k = max(0, min(spec.k, params.max_tokens - len(out) - 1, room - 1))
            new = speculative_step(self.target, self.cache, seq, drafter, k, params, generator, m)
            if not out:
                m.ttft_s = time.perf_counter() - t0
            for tok in new:
                if tok in self.eos_ids and not params.ignore_eos:
                    finish = "stop"
                    break
                seq.append(tok)
                out.append(tok)
                if params.stop and self._hit_stop(out, params.stop):
                    finish = "stop"
                    break
                if len(out) >= params.max_tokens:
                    finish = "length"
                    break
        m.generated_tokens = len(out)
        m.total_s = time.perf_counter() - t0
        text = self.decode(out)
        if text is not None and params.stop:
            cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        return GenerationResult(prompt, out, text, finish, m)

    def _hit_stop(self, out: list[int], stops: tuple[str, ...]) -> bool:
        # Only the tail can hold a stop string completed by the newest token.
        window = max(len(s) for s in stops) + 8
        text = self.decode(out[-window:]) or ""
        return any(s in text for s in stops)
