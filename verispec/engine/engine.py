"""The engine: loads a target (and optionally a draft model) and generates, plain or speculative.

One engine for one request or many (after nano-vllm): ``max_batch`` slots, each a row of the
target's KV cache and of the draft model's (:class:`~verispec.engine.draft_runner.DraftRunner`).
:meth:`Engine.submit` queues a request; :meth:`Engine.step` schedules (admits queued requests
into free slots, FIFO within the KV budget, :mod:`verispec.engine.scheduler`), runs (prefills a
bounded chunk of new prompts, then one speculative step for every ready row,
:func:`~verispec.engine.step.speculative_step`) and postprocesses (stop conditions, streaming,
freeing slots). :meth:`Engine.generate` submits and steps until its requests are done; a single
request is a batch of one.

A finished request's KV stays in its slot, and a later request sharing a prefix with it is placed
there and prefills only the rest (:mod:`verispec.engine.prefix`). A request whose work raises
fails alone: its handle gets the error, its slot is freed, and the step goes on without it; the
other requests, and what the engine learned about costs, are untouched.

The engine starts no threads and is not thread-safe: one thread drives it (the server's worker,
or a caller waiting on a handle). With the ``cost`` k policy a step's k depends on the batch
(:mod:`verispec.engine.policy`): greedy outputs stay identical to plain decoding and sampled ones
exactly distributed, but which seeded sample a request gets then depends on load.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from verispec import hub
from verispec.config import K_MAX, PLAIN, EngineConfig, SpecConfig, resolve_dtype
from verispec.drafters import make_drafter
from verispec.drafters.base import DraftContext, Drafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.prediction import PredictionDrafter
from verispec.drafters.vocab import special_token_ids
from verispec.engine.compiled import compile_model
from verispec.engine.costs import PROFILE_K, CostModel, profile_costs
from verispec.engine.draft_runner import MAX_LOCKSTEP_FEED, DraftRunner
from verispec.engine.metrics import Metrics
from verispec.engine.policy import AnswerLengths, CostPolicy, RowPlan, request_policy
from verispec.engine.prefix import SlotPrefixes, held_tokens
from verispec.engine.request import GenerationResult, OnTokens, Request, RequestHandle
from verispec.engine.scheduler import Scheduler
from verispec.engine.step import EngineStats, Row, StepReport, speculative_step
from verispec.engine.stopping import StepTokens, append_tokens, final_text, k_cap
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.linear import matmul_kernels
from verispec.models.llama import Transformer
from verispec.models.loader import build_model, load_tokenizer, open_source, resolve_weights
from verispec.sampling import SamplingParams

Prompt = str | list[int] | list[dict[str, str]]
Prediction = str | list[int]  # predicted output: text, or its token ids

__all__ = ["Engine", "GenerationResult", "Prediction", "Prompt", "RequestHandle", "check_tokenizers_match"]

# Cache positions past max_len: a row padded to the step's widest k + 1 (k <= K_MAX) writes up to K_MAX
# positions past its own end, the lockstep draft catch-up a few more, and a compiled forward pads
# the scored tokens up to its bucket (at most 32).
SLACK = K_MAX + 1 + MAX_LOCKSTEP_FEED + 4


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


class _DrafterPool:
    """Per-row drafters (n-gram, retrieval, layer-skip, hybrid's lookups), one per running request.

    Drafters keep per-sequence state, so two rows never share one; finished requests return
    theirs for reuse (``begin`` resets it), so a drafter is built at most once per slot.
    """

    def __init__(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.free: dict[str, list[Drafter]] = {}

    def acquire(self, spec: SpecConfig) -> Drafter | None:
        pool = self.free.setdefault(spec.drafter_key, [])
        return pool.pop() if pool else make_drafter(spec, self.ctx)

    def release(self, spec: SpecConfig, drafter: Drafter) -> None:
        self.free.setdefault(spec.drafter_key, []).append(drafter)


class Engine:
    """Generates from a target model, optionally speculating with a drafter, for one request or many.

    Build with :meth:`from_pretrained` (keyword arguments are :class:`EngineConfig` fields,
    ``max_batch`` among them); call :meth:`generate`, or :meth:`submit` and :meth:`step`. ``costs``
    gives the cost policy a measured :class:`~verispec.engine.costs.CostModel` (default: profiled
    on first use, see :meth:`profile`).
    """

    def __init__(self, config: EngineConfig, target: Transformer, tokenizer: Any | None, eos_ids: set[int],
                 draft: Transformer | None = None, draft_tokenizer: Any | None = None,
                 costs: CostModel | None = None) -> None:
        self.config = config
        for model in (target, draft):
            if model is not None and config.max_len > model.args.max_position_embeddings:
                raise VerispecError(f"max_len {config.max_len} exceeds the model's context length "
                                    f"{model.args.max_position_embeddings}")
        self.target, self.tokenizer, self.draft, self.draft_tokenizer = target, tokenizer, draft, draft_tokenizer
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        if draft is not None:
            check_tokenizers_match(tokenizer, draft_tokenizer, target.args.vocab_size, draft.args.vocab_size)
        rope_len = min(m.rope_cos.shape[0] for m in (target, draft) if m is not None)
        self.max_len = min(config.max_len, rope_len - SLACK)
        if self.max_len < 2:
            raise VerispecError(f"the model's {rope_len} positions leave no room for a context")
        cache_len = self.max_len + SLACK
        per_token = _kv_bytes_per_token(target) + (_kv_bytes_per_token(draft) if draft is not None else 0)
        slots = config.max_batch
        if config.memory_limit is not None:
            slots = min(slots, config.memory_limit // (cache_len * per_token))
            if slots < 1:
                raise VerispecError(f"memory_limit {config.memory_limit} B holds no slot of {self.max_len} tokens "
                                    f"({cache_len * per_token} B each); lower max_len or raise the limit")
        budget = slots * self.max_len if config.kv_budget_tokens is None else \
            min(config.kv_budget_tokens, slots * self.max_len)
        self._prefixes = SlotPrefixes()  # per free slot: the tokens its target row holds
        self.scheduler: Scheduler[Request] = Scheduler(slots, budget, self.max_len,
                                                       self._choose_slot if config.prefix_reuse else None)
        self.cache = target.new_cache(slots, cache_len)
        if config.compile:  # static shapes: every step covers all slots, scored tokens padded to buckets
            compile_model(target, cache_len, warmup=tuple(range(1, config.compile_k + 2)), batch=slots)
            if draft is not None:
                compile_model(draft, cache_len, warmup=(1, 2), batch=slots)
        self.draft_runner = (DraftRunner(draft, slots, cache_len, target.args.vocab_size,
                                         special_token_ids(tokenizer, self.eos_ids), full_span=config.compile)
                             if draft is not None else None)
        self.costs = costs
        self.policy: CostPolicy | None = None if costs is None else CostPolicy(costs)
        self.stats = EngineStats()
        self.answer_lengths = AnswerLengths()  # how long answers run: the cost policy's horizon
        self._shared: dict[Hashable, Any] = {}  # what this engine's drafters share (DraftContext.shared)
        self._drafters = _DrafterPool(self.draft_context)
        self._running: dict[int, Request] = {}  # slot -> request, in admission order
        self._by_handle: dict[RequestHandle, Request] = {}  # every request not finished yet
        self._ids = itertools.count()
        self._failed: BaseException | None = None
        logger.info("engine: %d slot%s of %d tokens, KV budget %d tokens (%.1f MiB of caches)", slots,
                    "s" if slots > 1 else "", self.max_len, budget,
                    (self.cache.nbytes() + (self.draft_runner.cache.nbytes() if self.draft_runner else 0)) / 2**20)


    @classmethod
    def from_pretrained(cls, model: str, draft: str | None = None, **kwargs: Any) -> Engine:
        """Load ``model`` (registry name, GGUF file or Hugging Face folder) and optionally a ``draft``.

        ``draft="auto"`` is the registry's draft partner of ``model`` when it is installed; without
        one the engine loads no draft model and says so in one logged line. Keyword arguments are
        :class:`EngineConfig` fields (dtype, max_len, weights, ...); the engine's ``config`` holds the
        resolved draft and weight formats (``"auto"`` resolved by :func:`resolve_weights`).
        """
        config = EngineConfig(model=model, draft=draft, **kwargs)
        draft, why = hub.resolve_draft(model, draft)
        if why:
            logger.warning(why)
        src = open_source(model)
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
        logger.info("loaded %s (%s, %s)%s", src.path.name, dtype, config.weights,
                    f" with draft {draft} ({config.draft_weights})" if draft else "")
        return cls(config, target, tokenizer, src.eos_token_ids, draft_model, draft_tok)

    def with_config(self, costs: CostModel | None = None, **fields: Any) -> Engine:
        """A new engine over the same loaded models, with ``fields`` of its :class:`EngineConfig` changed
        (slots: ``max_batch``, ``memory_limit``, ``kv_budget_tokens``, ``prefill_chunk``, ``prefix_reuse``;
        ``max_len``). It has caches of its own, and ``costs`` or else this engine's cost model when that
        covers its slots (the profile measures batch sizes up to the slot count)."""
        config = replace(self.config, **fields)
        if costs is None and config.max_batch <= self.config.max_batch:
            costs = self.costs
        return Engine(config, self.target, self.tokenizer, self.eos_ids, self.draft, self.draft_tokenizer, costs)

    def describe(self, spec: SpecConfig | None = None) -> dict[str, Any]:
        """The configuration a request with ``spec`` (None: plain decoding) runs, every value resolved.

        Models and their weight formats as loaded (``draft`` and ``draft_weights`` None without a
        draft model), the target's compute dtype, the speculation settings (``confidence`` is the
        threshold in force, 0 when off; ``draft_vocab`` / ``draft_window`` None when off) and
        ``kernels``: which matmuls the projections run, ``"verispec"`` (:mod:`verispec.kernels`),
        ``"stock"`` (PyTorch's) or ``"mixed"``.
        """
        spec = spec or PLAIN
        has_draft = self.draft is not None
        return {"model": self.config.model, "draft": self.config.draft if has_draft else None,
                "weights": self.config.weights, "draft_weights": self.config.draft_weights if has_draft else None,
                "dtype": str(self.target.dtype).removeprefix("torch."), "method": spec.method,
                "k_policy": spec.k_policy, "k": spec.k, "confidence": spec.min_confidence,
                "draft_vocab": spec.draft_vocab, "draft_window": spec.draft_window,
                "kernels": matmul_kernels(self.target, self.draft)}

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
        vocab = self.target.args.vocab_size
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise VerispecError("this model has no tokenizer; pass the prediction as token ids")
            ids = list(self.tokenizer.encode(prediction, add_special_tokens=False))
        elif isinstance(prediction, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prediction):
            ids = list(prediction)
            if any(not 0 <= t < vocab for t in ids):
                raise VerispecError(f"prediction token ids must be in [0, {vocab})")
        else:
            raise VerispecError("a prediction is a string or a list of token ids")
        if len(ids) > self.max_len:
            raise VerispecError(f"the prediction has {len(ids)} tokens but the context holds {self.max_len}")
        return ids or None

    # -- state ----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.scheduler.slots

    @property
    def prefix_reuse(self) -> bool:
        """Whether finished requests' KV stays for later requests sharing a prefix (``config.prefix_reuse``)."""
        return self.config.prefix_reuse

    @property
    def free_slots(self) -> int:
        return self.scheduler.free_slots

    @property
    def kv_budget_tokens(self) -> int:
        return self.scheduler.budget

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens reserved by running requests (prompt + max_tokens each)."""
        return self.scheduler.used_tokens

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self.scheduler.waiting)

    @property
    def failed(self) -> BaseException | None:
        """The BaseException that last stopped a step (None if none has)."""
        return self._failed

    @property
    def draft_context(self) -> DraftContext:
        """What per-row drafters for this engine are built from (its models, cache and tokenizer)."""
        return DraftContext(self.target, self.cache, self.draft, self.tokenizer, self.config.compile, self._shared,
                            trees=not self.config.compile and self.config.tp == 1)

    def drafter(self, spec: SpecConfig) -> Drafter | None:
        """A new per-row drafter for ``spec`` (None for plain decoding and for method ``draft``, whose
        drafts come from the engine's draft runner); raises a :class:`VerispecError` if it cannot be built."""
        return make_drafter(spec, self._drafters.ctx) if spec.enabled else None

    def check_spec(self, spec: SpecConfig) -> None:
        """Raise a :class:`VerispecError` unless this engine can speculate as ``spec`` says (plain always can).

        Builds (and so validates) one drafter for ``spec`` up front.
        """
        if spec.enabled:
            drafter = self._drafters.acquire(spec)
            if drafter is not None:
                self._drafters.release(spec, drafter)

    # -- requests -------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, spec: SpecConfig | None = None,
               chat: bool = False, on_tokens: OnTokens | None = None, drafter: Drafter | None = None,
               prediction: Prediction | None = None) -> RequestHandle:
        """Queue one request; returns its handle at once (:meth:`step` runs it).

        ``on_tokens(tokens)`` is called with the tokens each step adds (a
        :class:`~verispec.engine.stopping.StepTokens`: ``tokens.drafted`` of them accepted drafts);
        returning False cancels the request. ``drafter`` plugs in a custom :class:`Drafter` for this
        request instead of the one ``spec.method`` names (``spec`` must speculate; its k and k policy
        apply). ``prediction`` is the output the caller expects (OpenAI's predicted outputs: text or token
        ids): runs of it that the answer repeats are drafted whatever ``spec`` says, plain decoding
        included (:mod:`verispec.drafters.prediction`); the output stays the target's. Raises
        :class:`VerispecError` at once for a request that can never run: a prompt + max_tokens beyond
        the context or KV budget, a prediction longer than the context, stop strings without a
        tokenizer, a method this engine cannot serve.
        """
        params = params or SamplingParams()
        spec = spec or PLAIN
        ids = self.encode(prompt, chat)
        predicted = self.encode_prediction(prediction)
        self._check_request(ids, params, spec, drafter)
        handle = RequestHandle(self, next(self._ids), ids)
        req = Request(handle, ids, params, spec, on_tokens, Metrics(requests=1, prompt_tokens=len(ids)),
                      drafter=drafter, kpolicy=request_policy(spec) if spec.enabled else None, prediction=predicted)
        self.scheduler.submit(req, self._reserve(ids, params))
        self._by_handle[handle] = req
        return handle

    def _reserve(self, ids: list[int], params: SamplingParams) -> int:
        # A request never holds more than its slot: one whose max_tokens runs past the context ends
        # there (finish reason "length"), as a lone request always has.
        return min(len(ids) + params.max_tokens, self.max_len)

    def _check_request(self, ids: list[int], params: SamplingParams, spec: SpecConfig,
                       drafter: Drafter | None) -> None:
        if params.stop and self.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer")
        self.scheduler.check(self._reserve(ids, params))
        if drafter is not None and not spec.enabled:
            raise VerispecError("a custom drafter needs a spec that speculates (method other than 'none')")
        if drafter is None:
            self.check_spec(spec)

    def cancel(self, handle: RequestHandle) -> bool:
        """Cancel ``handle``'s request: its slot and KV tokens are free when this returns."""
        req = self._by_handle.get(handle)
        if req is None or req.done:
            return False
        if req.row is None:
            self.scheduler.remove_waiting(req)
        self._finish(req, "cancelled")
        return True

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecConfig | list[SpecConfig] | None = None, chat: bool = False,
                 drafter: Drafter | None = None,
                 on_tokens: Callable[[int, list[int]], bool | None] | None = None,
                 prediction: Prediction | list[Prediction | None] | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts; returns one result per prompt, in order.

        ``params`` and ``spec`` are one for all or one per prompt; ``spec=None`` decodes plainly.
        Up to ``max_batch`` prompts run at once. ``drafter`` plugs in a custom :class:`Drafter`
        instead of the one ``spec.method`` names (``spec.k`` still applies); it keeps one
        sequence's state, so its prompts run one after another. Every prompt is encoded and
        checked before any work starts, so one bad prompt costs nothing.

        ``on_tokens(i, tokens)`` is called after every step with the tokens prompt ``i`` just
        gained (streaming); returning False cancels that request (finish reason "cancelled").
        ``tokens`` is a :class:`~verispec.engine.stopping.StepTokens`: a list whose ``drafted``
        attribute counts its leading tokens that were accepted drafts. ``prediction`` is one predicted
        output for every prompt (text or token ids) or a list of one per prompt (None for none).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int | dict)):
            prompts = [prompts]
        n = len(prompts)
        params_l = params if isinstance(params, list) else [params or SamplingParams()] * n
        spec_l = spec if isinstance(spec, list) else [spec or PLAIN] * n
        one_prediction = prediction is None or isinstance(prediction, str) or \
            all(isinstance(t, int) for t in prediction)
        pred_l = [prediction] * n if one_prediction else list(prediction)
        if len(params_l) != n or len(spec_l) != n or len(pred_l) != n:
            raise VerispecError("give one params, spec and prediction for all prompts, or one per prompt")
        encoded = [self.encode(p, chat) for p in prompts]
        pred_l = [self.encode_prediction(p) for p in pred_l]
        for ids, p, s in zip(encoded, params_l, spec_l, strict=True):
            self._check_request(ids, p, s, drafter)
        jobs = [(ids, p, s, pr, on_tokens and partial(on_tokens, i))
                for i, (ids, p, s, pr) in enumerate(zip(encoded, params_l, spec_l, pred_l, strict=True))]
        if drafter is not None:
            return [self.submit(ids, p, s, on_tokens=cb, drafter=drafter, prediction=pr).result()
                    for ids, p, s, pr, cb in jobs]
        handles = [self.submit(ids, p, s, on_tokens=cb, prediction=pr) for ids, p, s, pr, cb in jobs]
        return [h.result() for h in handles]

    # -- running --------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit, prefill a chunk, and run one speculative step for the ready rows; True while work remains.

        Faults are isolated per request: one whose admission, prefill, drafter or token callback
        raises fails alone (its handle raises the error; its slot and KV tokens are freed), and a
        step whose shared forward raises is retried row by row, so only the rows that fail alone
        fail. The surviving rows keep every cache consistent (a target cache row holds
        ``seq[:-1]``; what a failed step wrote past a row's length is never read), and the cost
        model and policy stay as they were. Only an exception that no request explains (a fault in
        the scheduling itself) fails the running requests, and a BaseException such as
        KeyboardInterrupt stops the step: every request gets it, the engine is :meth:`reset`
        (it serves new requests), and it propagates.
        """
        with torch.inference_mode():
            try:
                for adm in self.scheduler.admit():
                    try:
                        self._start(adm.item, adm.slot)
                    except Exception as e:  # noqa: BLE001 (this request's drafter or sampling set-up)
                        self._fail_request(adm.item, e, slot=adm.slot)
                self._prefill()
                ready = [r for r in self._running.values() if r.prefilled]
                if ready:
                    self._decode(ready)
            except Exception as e:  # noqa: BLE001 (no single request to blame: those running get the error)
                logger.exception("a step failed outside any one request; failing the running requests")
                for req in list(self._running.values()):
                    self._fail_request(req, e)
            except BaseException as e:
                self._fail(e)
                raise
            return self.has_work

    def run_until_done(self) -> None:
        """Step until no request is running or waiting."""
        while self.step():
            pass

    def reset(self) -> None:
        """Forget every request (without finishing their handles) and every cached prefix.

        The models, the cost model and the policy are kept. :meth:`step` does this after a
        BaseException, which leaves the caches in an unknown state.
        """
        for slot in list(self.scheduler.running):
            self.scheduler.release(slot)
        self.scheduler.waiting.clear()
        self._running.clear()
        self._by_handle.clear()
        for slot in range(self.slots):
            self._prefixes.forget(slot)
            self.cache.reset(slot)
            if self.draft_runner is not None:
                self.draft_runner.release(slot)

    def profile(self, k_max: int = PROFILE_K, context: int = 64, reps: int = 5) -> CostModel:
        """Measure the cost curves the cost policy uses, for k up to ``k_max`` and every batch size.

        Done on first use of the policy otherwise (at the default ``k_max``). Rows asking for a
        larger k are priced by extending the curves (:class:`~verispec.engine.costs.CostCurve`),
        never by profiling again. A server profiles before it serves.
        """
        # The longer context, for what each position more costs, within what a slot can hold.
        long_context = min(8 * context, self.max_len - k_max - 1)
        self.costs = profile_costs(self.target, self.draft, self.slots, k_max, context, reps, long_context)
        self.policy = CostPolicy(self.costs)
        c = self.costs
        target = "; ".join(f"{b} rows {_fmt(curve.points)}" for b, curve in sorted(c.target.curves.items()))
        logger.info("costs at %d-token context: target %s, draft %s; per token and further position: "
                    "target %.2g s, draft %.2g s", c.per_position.context, target,
                    _fmt(c.draft.points) if c.draft else "-", c.per_position.target_s, c.per_position.draft_s)
        return self.costs

    # -- internals ------------------------------------------------------------------------

    def _choose_slot(self, req: Request, free: list[int]) -> int:
        """The scheduler's pick among the free slots: where the request's prompt is cached longest."""
        return self._prefixes.choose(req.prompt, free)

    def _start(self, req: Request, slot: int) -> None:
        req.handle.admitted_at = time.perf_counter()
        # The row keeps what the slot's previous request left that this prompt starts with; _prefill
        # goes on from there. Without a record (reuse off, a fresh slot) that is nothing.
        reused = self.cache.lengths[slot] = self._prefixes.claim(slot, req.prompt)
        req.metrics.prefix_reused_tokens = reused
        self.stats.prefix_hits += int(reused > 0)
        self.stats.prefix_reused_tokens += reused
        spec = req.spec
        # On the target's device: verification samples there (the draft runner keeps its own if elsewhere).
        generator = None if req.params.greedy else req.params.generator(self.target.device)
        row = Row(slot, list(req.prompt), req.params, generator, req.metrics)
        if spec.enabled:
            row.drafter = req.drafter or self._drafters.acquire(spec)
            row.model_draft = req.drafter is None and spec.method in ("draft", "hybrid") and \
                self.draft_runner is not None
            row.min_confidence = spec.min_confidence
        if req.prediction is not None:  # the prediction drafts where it matches, the method's drafter elsewhere
            req.predictor = row.drafter = PredictionDrafter(req.prediction, row.drafter, spec.k)
        if row.drafter is not None:
            row.drafter.use_row(slot)
            row.drafter.begin(req.prompt)
        if row.model_draft:
            assert self.draft_runner is not None
            self.stats.prefix_draft_reused_tokens += self.draft_runner.begin(slot, req.prompt, spec.draft_vocab,
                                                                             spec.draft_window)
        req.row = row
        self._running[slot] = req

    def _prefill(self) -> None:
        # All but the last prompt token; the first step scores that one with the first drafts.
        budget = self.config.prefill_chunk
        t0 = time.perf_counter()
        failed: list[tuple[Request, Exception]] = []
        for req in self._running.values():
            if req.prefilled:
                continue
            if budget <= 0:
                break
            slot, target_len = req.row.slot, len(req.prompt) - 1
            done = self.cache.lengths[slot]
            n = min(target_len - done, budget)
            if n > 0:
                t1 = time.perf_counter()
                pos = torch.arange(done, done + n, device=self.target.device).unsqueeze(0)
                try:
                    self.target(torch.tensor([req.prompt[done:done + n]], device=self.target.device), pos,
                                self.cache, rows=slice(slot, slot + 1), last_only=True)
                except Exception as e:  # noqa: BLE001 (this prompt's forward; its length stays where it was)
                    failed.append((req, e))
                    continue
                self.cache.lengths[slot] = done + n
                budget -= n
                req.metrics.stage_s["prefill"] += time.perf_counter() - t1
                self.stats.prefill_tokens += n
            req.prefilled = self.cache.lengths[slot] == target_len
        for req, e in failed:
            self._fail_request(req, e)
        self.stats.prefill_s += time.perf_counter() - t0

    def _plan(self, req: Request) -> RowPlan | None:
        """Set up row ``req``'s step (its draft source) and say what the policy knows of it; None: it is done."""
        row = req.row
        room = self.max_len - len(row.seq)  # positions left; a step uses k + 1 of them
        if room < 1:
            self._finish(req, "length")
            return None
        cap = k_cap(req.spec.k, req.params, len(req.out), room) if row.speculates else 0
        # A prediction is offered the widest k the cost policy prices (a request's own k policy keeps its k).
        offer = k_cap(K_MAX, req.params, len(req.out), room) if req.predictor and req.kpolicy is None else cap
        req.governed = False
        if not offer:  # nothing to draft (a plain request, or no room): nothing for a policy to decide
            return RowPlan(0, context=len(row.seq))
        # A trusted lookup (hybrid, a prediction) costs no draft time and is valued at the acceptance the
        # request's lookups of its kind reach; the cost policy drafts as much of it as pays (``optional``), a
        # request's own k policy all of it.
        # Without one a hybrid row drafts with the draft model.
        free = row.drafter.free_tokens(row.seq, offer, req.params, row.generator) if row.drafter is not None else 0
        lookup_only = row.drafter is not None and row.drafter.lookups_only and not row.model_draft
        row.use_model = row.model_draft and not free
        source = req.prediction_acceptance if req.predictor and req.predictor.offering else req.lookup_acceptance
        req.lookup = source if free else None
        if free or lookup_only:
            return RowPlan(max(cap, free), fixed_k=free, optional=req.kpolicy is None, fixed_rate=source.rate,
                           context=len(row.seq))
        if req.kpolicy is not None:
            return RowPlan(cap, fixed_k=req.kpolicy.choose(cap), model_draft=row.use_model, context=len(row.seq))
        req.governed = True
        catch_up = self.draft_runner.catch_up_needed(row.slot, row.seq) if row.use_model else 0
        horizon = self.answer_lengths.expected_remaining(len(req.out), min(req.params.max_tokens - len(req.out), room))
        own_s = 0.0
        if row.drafter is not None and not row.use_model and row.drafter.forward_fraction:
            own_s = row.drafter.forward_fraction * self._policy().costs.target_s(1, len(row.seq))
        return RowPlan(cap, req.acceptance.rate, model_draft=row.use_model, draft_token_s=own_s, catch_up=catch_up,
                       horizon=horizon, context=len(row.seq), probes=req.probes)

    def _decode(self, ready: list[Request]) -> None:
        plans: list[RowPlan] = []
        stepping: list[Request] = []
        for req in ready:
            plan = self._plan(req)
            if plan is not None:
                plans.append(plan)
                stepping.append(req)
        if not stepping:
            return
        rows = [req.row for req in stepping]
        policy_k = None
        if any(req.governed or plan.optional for req, plan in zip(stepping, plans, strict=True)):
            span = self.slots if self.config.compile else \
                max(r.slot for r in rows) - min(r.slot for r in rows) + 1
            ks = self._policy().choose(plans, span)
            policy_k = max((k for k, req in zip(ks, stepping, strict=True) if req.governed), default=None)
        else:
            ks = [p.fixed_k for p in plans]
        for row, k, plan in zip(rows, ks, plans, strict=True):
            row.k = min(k, plan.cap)
        report = self._run_step(rows)
        self.stats.record(report, policy_k)
        if self.costs is not None and not report.retried:
            self.costs.observe_target(report.scored_tokens, report.score_s, report.context, report.span)
            self.costs.observe_catch_up(report.catch_ups, report.catch_up_tokens, report.catch_up_s)
            if self.costs.draft is not None and report.draft_forwards:
                per_forward = (report.propose_s - report.catch_up_s) / report.draft_forwards
                self.costs.observe_draft(report.span, per_forward, report.context)
        now = time.perf_counter()
        for i, req in enumerate(stepping):
            if req.done:  # cancelled by an earlier request's callback during this loop
                continue
            if i in report.failed:
                self._fail_request(req, report.failed[i])
                continue
            try:
                self._advance(req, report, i, now)
            except Exception as e:  # noqa: BLE001 (its stop check or token callback: this request alone)
                self._fail_request(req, e)

    def _advance(self, req: Request, report: StepReport, i: int, now: float) -> None:
        """Fold row ``i``'s step into its request: what its k policy learns, new tokens, stop conditions."""
        row = req.row
        if req.kpolicy is not None:
            req.kpolicy.update(report.drafted[i], report.accepted[i])
        if req.governed:
            req.acceptance.update(report.drafted[i], report.accepted[i])
        elif req.lookup is not None:
            req.lookup.update(report.drafted[i], report.accepted[i])
        if row.use_model and row.k and isinstance(row.drafter, HybridDrafter):
            row.drafter.counts["draft"] += 1
        if not req.out:  # engine time, from admission: queueing is the handle's (submitted_at)
            req.metrics.ttft_s = now - req.handle.admitted_at
        n_before = len(req.out)
        finish = append_tokens(report.new_tokens[i], row.seq, req.out, req.params, self.eos_ids, self.decode)
        chunk = StepTokens.of(report.new_tokens[i], req.out, n_before)
        if chunk:
            req.handle._push(chunk)
        if req.on_tokens is not None and req.on_tokens(chunk) is False and finish is None:
            finish = "cancelled"
        if finish is not None and not req.done:
            self._finish(req, finish)

    def _policy(self) -> CostPolicy:
        if self.policy is None:
            # Sized by the engine, never by a request: a request's k must not size a profile that every
            # running request waits for (a server profiles before it serves).
            self.profile()
        assert self.policy is not None
        return self.policy

    def _run_step(self, rows: list[Row]) -> StepReport:
        """One speculative step of ``rows``; a row that fails it is in ``report.failed``, the others advance.

        A row whose own drafter raises is left out of the step by :func:`speculative_step`. If the
        step raises anyway (the draft runner, the shared target forward, verification), it is
        undone, each row's caches, drafter and generator as they were before, and every row runs it
        alone: the rows that raise alone are the ones that fail. The combined report is marked
        ``retried`` (its timings are no single forward's, so the cost model does not learn from it).
        """
        full = self.config.compile
        saved = [self._row_state(r) for r in rows]
        try:
            return speculative_step(self.target, self.cache, rows, self.draft_runner, full)
        except Exception as e:  # noqa: BLE001 (isolated below)
            if len(rows) == 1:
                self._restore_row(rows[0], saved[0])
                return StepReport(1, 0, 0, 0, 0.0, 0.0, 0.0, new_tokens=[[]], drafted=[0], accepted=[0],
                                  failed={0: e}, retried=True)
            logger.warning("a step of %d rows failed (%r); retrying its rows one by one", len(rows), e)
        for row, state in zip(rows, saved, strict=True):
            self._restore_row(row, state)
        report = StepReport(len(rows), 0, 0, 0, 0.0, 0.0, 0.0, retried=True)
        for i, (row, state) in enumerate(zip(rows, saved, strict=True)):
            try:
                alone = speculative_step(self.target, self.cache, [row], self.draft_runner, full)
            except Exception as e:  # noqa: BLE001 (this row fails on its own: it is the culprit)
                self._restore_row(row, state)
                alone = StepReport(1, 0, 0, 0, 0.0, 0.0, 0.0, new_tokens=[[]], drafted=[0], accepted=[0],
                                   failed={0: e})
            report.new_tokens += alone.new_tokens
            report.drafted += alone.drafted
            report.accepted += alone.accepted
            if 0 in alone.failed:
                report.failed[i] = alone.failed[0]
            report.span, report.width = max(report.span, alone.span), max(report.width, alone.width)
            report.draft_forwards += alone.draft_forwards
            report.propose_s += alone.propose_s
            report.score_s += alone.score_s
            report.verify_s += alone.verify_s
            report.context = max(report.context, alone.context)
        return report

    def _row_state(self, row: Row) -> tuple[int, torch.Tensor | None]:
        """What a step may change in a row before it fails: the target cache length and the generator."""
        return self.cache.lengths[row.slot], None if row.generator is None else row.generator.get_state()

    def _restore_row(self, row: Row, state: tuple[int, torch.Tensor | None]) -> None:
        """Undo a step that raised: the row is back to ``seq`` with nothing drafted or accepted.

        The target's cache row is back at ``len(seq) - 1``; the draft runner and a per-row drafter
        are told that only ``seq`` is final (they lower their lengths and catch up next time), and the
        generator is back where it was, so a retried sampled row draws what it would have drawn.
        """
        length, generator_state = state
        self.cache.lengths[row.slot] = length
        if row.model_draft and self.draft_runner is not None:
            self.draft_runner.commit(row.slot, len(row.seq))
        if row.drafter is not None:
            try:
                row.drafter.commit(len(row.seq))
            except Exception:  # noqa: BLE001 (a broken drafter fails its row when it runs alone)
                pass
        if generator_state is not None:
            row.generator.set_state(generator_state)

    def _fail_request(self, req: Request, error: BaseException, slot: int | None = None) -> None:
        """Fail one request with ``error``: its handle raises it, its slot and KV tokens are free at once.

        ``slot``: the slot it was being admitted to when it failed. Nothing else changes: the other
        requests, the cost model and the policy stay as they were.
        """
        if req.done:
            return
        logger.error("request %d failed (%r); the other requests go on", req.handle.id, error, exc_info=error)
        if req.row is None and slot is not None:  # failed while being admitted: the scheduler holds its slot
            self._running.pop(slot, None)
            self.scheduler.release(slot)
            self._prefixes.forget(slot)
            self.cache.reset(slot)
            if self.draft_runner is not None:
                self.draft_runner.release(slot)
        self._finish(req, "error", error)

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        req.done = True
        self._by_handle.pop(req.handle, None)
        if reason != "cancelled" and error is None:
            self.answer_lengths.add(len(req.out), cut=reason == "length")
        if req.row is not None:
            slot = req.row.slot
            del self._running[slot]
            self.scheduler.release(slot)
            # A failed request's row may hold K/V of a step that never finished: its prefix is not kept.
            if self.prefix_reuse and error is None:
                held = held_tokens(req.row.seq, self.cache.lengths[slot])
                self._prefixes.record(slot, held)
                self.cache.lengths[slot] = len(held)
            else:
                self._prefixes.forget(slot)
                self.cache.reset(slot)
            if self.draft_runner is not None and (req.row.model_draft or error is not None):
                self.draft_runner.release(slot, req.row.seq if self.prefix_reuse and error is None else None)
            # A drafter goes back to the pool unless it was the caller's own, or its request (or its end hook)
            # failed: it may be what failed.
            drafter = req.row.drafter
            if req.predictor is not None:
                m = req.metrics
                m.accepted_prediction_tokens, m.rejected_prediction_tokens = req.predictor.accepted, \
                    req.predictor.rejected
            if drafter is not None and error is None:
                try:
                    drafter.end(req.row.seq)
                except Exception:  # noqa: BLE001 (the answer is complete; only this drafter is suspect)
                    logger.warning("drafter %s failed to end request %d", drafter.name, req.handle.id, exc_info=True)
                    drafter = None
            if req.predictor is not None:  # a prediction's drafter is its request's alone
                drafter = req.predictor.inner if drafter is not None else None
            if drafter is not None and req.drafter is None and error is None:
                self._drafters.release(req.spec, drafter)
        m = req.metrics
        m.generated_tokens = len(req.out)
        m.total_s = time.perf_counter() - (req.handle.admitted_at or req.handle.submitted_at)
        self.stats.requests.merge(m)
        if error is not None:
            req.handle._finish(None, error)
            return
        text = final_text(self.decode(req.out), req.params.stop)
        req.handle._finish(GenerationResult(req.prompt, req.out, text, reason, m))

    def _fail(self, error: BaseException) -> None:
        # A BaseException mid-step leaves the caches in an unknown state: fail every request, start clean.
        self._failed = error
        logger.warning("a step stopped (%r); its requests end with it", error)
        for req in list(self._by_handle.values()):
            req.done = True
            req.handle._finish(None, error)
        self.reset()


def _kv_bytes_per_token(model: Any) -> int:
    a = model.args
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * torch.finfo(model.dtype).bits // 8


def _fmt(points: dict[int, float]) -> str:
    return ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in sorted(points.items()))
