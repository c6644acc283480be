"""What an engine is built from: its models loaded and checked as a pair, its tokenization, its cache sizes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from verispec import hub
from verispec.config import K_MAX, PLAIN, EngineConfig, SpecConfig, resolve_dtype
from verispec.constraints import Constraint, GrammarTokenizer, RowLogits, processes
from verispec.engine import kernel_choice
from verispec.engine.draft_runner import MAX_LOCKSTEP_FEED
from verispec.engine.kernel_choice import activations
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.linear import matmul_kernels
from verispec.models.llama import Transformer
from verispec.models.loader import build_model, load_tokenizer, open_source, resolve_weights
from verispec.sampling import SamplingParams

Prompt = str | list[int] | list[dict[str, str]]
Prediction = str | list[int]  # predicted output: text, or its token ids

# Cache positions past max_len: a row padded to the step's widest k + 1 (k <= K_MAX) writes up to K_MAX
# positions past its own end, the lockstep draft catch-up a few more, and a compiled forward pads
# the scored tokens up to its bucket (at most 32).
SLACK = K_MAX + 1 + MAX_LOCKSTEP_FEED + 4


def per_prompt(prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None,
               spec: SpecConfig | list[SpecConfig] | None, prediction: Prediction | list[Prediction | None] | None,
               constraint: Constraint | list[Constraint | None] | None = None,
               ) -> list[tuple[Prompt, SamplingParams, SpecConfig, Prediction | None, Constraint | None]]:
    """One prompt or a list of them, each with its params, spec, prediction and constraint (each given once for
    all, or one per prompt; ``None``: defaults, plain decoding, no prediction, no constraint)."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int | dict)):
        prompts = [prompts]
    n = len(prompts)
    params_l = params if isinstance(params, list) else [params or SamplingParams()] * n
    spec_l = spec if isinstance(spec, list) else [spec or PLAIN] * n
    one_prediction = prediction is None or isinstance(prediction, str) or all(isinstance(t, int) for t in prediction)
    pred_l = [prediction] * n if one_prediction else list(prediction)
    cons_l = constraint if isinstance(constraint, list) else [constraint] * n
    if len(params_l) != n or len(spec_l) != n or len(pred_l) != n or len(cons_l) != n:
        raise VerispecError("give one params, spec, prediction and constraint for all prompts, or one per prompt")
    return list(zip(prompts, params_l, spec_l, pred_l, cons_l, strict=True))


@dataclass
class Models:
    """A loaded target, its tokenizer and end-of-sequence ids, and optionally a draft model and its tokenizer."""

    config: EngineConfig  # draft and weight formats resolved
    target: Transformer
    tokenizer: Any | None
    eos_ids: set[int]
    draft: Transformer | None = None
    draft_tokenizer: Any | None = None


def load_models(config: EngineConfig) -> Models:
    """Load ``config.model`` and its draft (``"auto"``: the registry's partner when installed, else none,
    said in one logged line), resolving weight formats (``"auto"`` by :func:`resolve_weights`)."""
    draft, why = hub.resolve_draft(config.model, config.draft)
    if why:
        logger.warning(why)
    src = open_source(config.model)
    tokenizer = load_tokenizer(src)
    dsrc = open_source(draft) if draft is not None else None
    config = replace(config, draft=draft, weights=resolve_weights(src, config.weights, tp=config.tp),
                     draft_weights=config.draft_weights if dsrc is None else
                     resolve_weights(dsrc, config.draft_weights, draft=True))
    draft_tok = load_tokenizer(dsrc) if dsrc is not None else None
    if dsrc is not None:  # refuse a mismatched pair before spending time on weights
        check_tokenizers_match(tokenizer, draft_tok, src.args.vocab_size, dsrc.args.vocab_size)
    dtype = resolve_dtype(config.dtype, config.target_device)
    target = build_model(src, dtype, config.weights, config.progress, kernels=config.kernels)
    target = target.to(config.target_device)
    if config.tp > 1:  # rank 0 of a torchrun launch: shard, and mirror every target forward on the other ranks
        from verispec.parallel.tp import lead

        target = lead(target, config.tp)
    draft_model = None
    if dsrc is not None:
        ddtype = resolve_dtype(config.draft_dtype or config.dtype, config.draft_device)
        draft_model = build_model(dsrc, ddtype, config.draft_weights, config.progress,
                                  kernels=config.kernels).to(config.draft_device)
    for model, name, is_target in ((target, config.model, True), (draft_model, draft, False)):
        if model is not None and config.tp == 1:
            model.activation_reason = kernel_choice.choose(model, str(name), config.kernels, is_target).reason
    logger.info("loaded %s (%s, %s)%s", src.path.name, dtype, config.weights,
                f" with draft {draft} ({config.draft_weights})" if draft else "")
    return Models(config, target, tokenizer, set(src.eos_token_ids), draft_model, draft_tok)


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


@dataclass(frozen=True)
class Sizing:
    """How many tokens a request may hold (``max_len``), in how many slots, within what KV budget."""

    max_len: int
    slots: int
    budget: int

    @property
    def cache_len(self) -> int:
        return self.max_len + SLACK

    @classmethod
    def of(cls, config: EngineConfig, target: Transformer, draft: Transformer | None) -> Sizing:
        """Slots as ``config`` asks, fewer where ``memory_limit`` holds fewer; refuses a context no slot can hold."""
        for model in (target, draft):
            if model is not None and config.max_len > model.args.max_position_embeddings:
                raise VerispecError(f"max_len {config.max_len} exceeds the model's context length "
                                    f"{model.args.max_position_embeddings}")
        rope_len = min(m.rope_cos.shape[0] for m in (target, draft) if m is not None)
        max_len = min(config.max_len, rope_len - SLACK)
        if max_len < 2:
            raise VerispecError(f"the model's {rope_len} positions leave no room for a context")
        per_token = sum(_kv_bytes_per_token(m) for m in (target, draft) if m is not None)
        slots = config.max_batch
        if config.memory_limit is not None:
            slots = min(slots, config.memory_limit // ((max_len + SLACK) * per_token))
            if slots < 1:
                raise VerispecError(f"memory_limit {config.memory_limit} B holds no slot of {max_len} tokens "
                                    f"({(max_len + SLACK) * per_token} B each); lower max_len or raise the limit")
        budget = slots * max_len if config.kv_budget_tokens is None else min(config.kv_budget_tokens, slots * max_len)
        return cls(max_len, slots, budget)


def _kv_bytes_per_token(model: Transformer) -> int:
    a = model.args
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * torch.finfo(model.dtype).bits // 8


@dataclass
class Codec:
    """Text to token ids and back for an engine: prompts, predicted outputs, outputs."""

    tokenizer: Any | None
    vocab_size: int
    max_len: int
    eos_ids: frozenset[int] = frozenset()
    _grammar: GrammarTokenizer | None = field(default=None, init=False, repr=False)

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The tokenizer as constraints see it, built on first use (a few seconds for a 150k vocabulary)."""
        if self.tokenizer is None:
            raise VerispecError("a constraint needs a tokenizer")
        if self._grammar is None:
            self._grammar = GrammarTokenizer(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
        return self._grammar

    def processor(self, params: SamplingParams, prompt_len: int, constraint: Constraint | None,
                  device: torch.device | str = "cpu") -> RowLogits | None:
        """A request's logits processing (penalties, logit bias, its constraint), or None where it changes nothing."""
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise VerispecError(f"logit_bias names a token id outside the vocabulary (0..{self.vocab_size - 1})")
        if constraint is not None and not isinstance(constraint, Constraint):
            raise VerispecError(f"constraint must be a Constraint, not {type(constraint).__name__}")
        if constraint is None and not processes(params):
            return None
        matcher = None if constraint is None else self.grammar_tokenizer().matcher(constraint)
        return RowLogits(params, prompt_len, self.vocab_size, matcher, device)

    def encode(self, prompt: Prompt, chat: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or chat messages (``chat=True`` for a string)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = self._checked_ids(prompt, "token ids")
        elif self.tokenizer is None:
            raise VerispecError("this model has no tokenizer; pass token ids")
        elif isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if not self.tokenizer.chat_template:
                raise VerispecError("this model's tokenizer has no chat template")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     **({"tools": tools} if tools else {}))
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
        if len(ids) >= self.max_len:
            raise VerispecError(f"the prompt has {len(ids)} tokens but the context holds {self.max_len} "
                                "(one position must be left to generate)")
        return ids

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_prediction(self, prediction: Prediction | None) -> list[int] | None:
        """Token ids of a predicted output (text is tokenized without special tokens); None for none or empty."""
        if prediction is None:
            return None
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise VerispecError("this model has no tokenizer; pass the prediction as token ids")
            ids = list(self.tokenizer.encode(prediction, add_special_tokens=False))
        elif isinstance(prediction, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prediction):
            ids = self._checked_ids(prediction, "prediction token ids")
        else:
            raise VerispecError("a prediction is a string or a list of token ids")
        if len(ids) > self.max_len:
            raise VerispecError(f"the prediction has {len(ids)} tokens but the context holds {self.max_len}")
        return ids or None

    def _checked_ids(self, ids: list[int], what: str) -> list[int]:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise VerispecError(f"{what} must be in [0, {self.vocab_size})")
        return list(ids)


def describe(config: EngineConfig, target: Transformer, draft: Transformer | None, spec: SpecConfig) -> dict[str, Any]:
    """The configuration a request with ``spec`` runs on these models, every value resolved.

    Models and their weight formats as loaded (``draft`` and ``draft_weights`` None without a
    draft model), the target's compute dtype, the speculation settings (``confidence`` is the
    threshold in force, 0 when off; ``draft_vocab`` / ``draft_window`` None when off) and
    ``kernels``: which matmuls the projections run, ``"verispec"`` (:mod:`verispec.kernels`),
    ``"stock"`` (PyTorch's) or ``"mixed"``; ``activations``: what each model's int4/int8 layers multiply,
    ``"bf16"``, ``"q8"`` (8-bit) or None, and ``activations_reason`` why (:mod:`verispec.engine.kernel_choice`).
    """
    has_draft = draft is not None
    return {"model": config.model, "draft": config.draft if has_draft else None,
            "weights": config.weights, "draft_weights": config.draft_weights if has_draft else None,
            "dtype": str(target.dtype).removeprefix("torch."), "method": spec.method,
            "k_policy": spec.k_policy, "k": spec.k, "confidence": spec.min_confidence,
            "draft_vocab": spec.draft_vocab, "draft_window": spec.draft_window,
            "kernels": matmul_kernels(target, draft),
            "activations": {"target": activations(target), "draft": activations(draft) if has_draft else None},
            "activations_reason": {"target": getattr(target, "activation_reason", ""),
                                   "draft": getattr(draft, "activation_reason", "") if has_draft else None}}
