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

from verispec.config import PLAIN, EngineConfig, SpecConfig
from verispec.constraints import Constraint
from verispec.drafters import CustomDrafter, DrafterPool, make_drafter, own_drafter
from verispec.drafters.base import DraftContext, Drafter
from verispec.drafters.vocab import special_token_ids
from verispec.engine import loading
from verispec.engine.compiled import compile_model
from verispec.engine.costs import PROFILE_K, CostModel, profile_costs
from verispec.engine.draft_runner import DraftRunner
from verispec.engine.faults import step_isolated
from verispec.engine.loading import Codec, Prediction, Prompt, Sizing, check_tokenizers_match, load_models, per_prompt
from verispec.engine.metrics import EngineStats, Metrics
from verispec.engine.planning import plan_step
from verispec.engine.policy import CostPolicy
from verispec.engine.request import GenerationResult, OnTokens, Request, RequestHandle, request_policy
from verispec.engine.scheduler import Scheduler
from verispec.engine.slots import Slots
from verispec.engine.step import StepReport, speculative_step
from verispec.engine.stopping import StepTokens, append_tokens, final_text
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.llama import Transformer
from verispec.sampling import SamplingParams

__all__ = ["CustomDrafter", "Engine", "GenerationResult", "Prediction", "Prompt", "RequestHandle",
           "check_tokenizers_match"]


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
        self.target, self.tokenizer, self.draft, self.draft_tokenizer = target, tokenizer, draft, draft_tokenizer
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        if draft is not None:
            check_tokenizers_match(tokenizer, draft_tokenizer, target.args.vocab_size, draft.args.vocab_size)
        size = Sizing.of(config, target, draft)
        self.max_len = size.max_len
        self.codec = Codec(tokenizer, target.args.vocab_size, self.max_len, frozenset(self.eos_ids))
        self.cache = target.new_cache(size.slots, size.cache_len)
        if config.compile:  # static shapes: every step covers all slots, scored tokens padded to buckets
            compile_model(target, size.cache_len, warmup=tuple(range(1, config.compile_k + 2)), batch=size.slots)
            if draft is not None:
                compile_model(draft, size.cache_len, warmup=(1, 2), batch=size.slots)
        self.draft_runner = (DraftRunner(draft, size.slots, size.cache_len, target.args.vocab_size,
                                         special_token_ids(tokenizer, self.eos_ids), full_span=config.compile,
                                         prefix_reuse=config.prefix_reuse)
                             if draft is not None else None)
        self.costs = costs
        self.policy: CostPolicy | None = None if costs is None else CostPolicy(costs)
        self.stats = EngineStats()
        self._shared: dict[Hashable, Any] = {}  # what this engine's drafters share (DraftContext.shared)
        self._drafters = DrafterPool(self.draft_context)
        self.rows = Slots(target, self.cache, self.draft_runner, self._drafters, self.stats, config.prefix_reuse,
                          config.batch_prefill)
        self.scheduler: Scheduler[Request] = Scheduler(size.slots, size.budget, self.max_len,
                                                       self.rows.choose if config.prefix_reuse else None)
        self._running: dict[int, Request] = {}  # slot -> request, in admission order
        self._by_handle: dict[RequestHandle, Request] = {}  # every request not finished yet
        self._ids = itertools.count()
        self._failed: BaseException | None = None
        logger.info("engine: %d slot%s of %d tokens, KV budget %d tokens (%.1f MiB of caches)", size.slots,
                    "s" if size.slots > 1 else "", self.max_len, size.budget,
                    (self.cache.nbytes() + (self.draft_runner.cache.nbytes() if self.draft_runner else 0)) / 2**20)

    @classmethod
    def from_pretrained(cls, model: str, draft: str | None = None, **kwargs: Any) -> Engine:
        """Load ``model`` (registry name, GGUF file or Hugging Face folder) and optionally a ``draft``.

        ``draft="auto"`` is the registry's draft partner of ``model`` when it is installed; without
        one the engine loads no draft model and says so in one logged line. Keyword arguments are
        :class:`EngineConfig` fields (dtype, max_len, weights, ...); the engine's ``config`` holds the
        resolved draft and weight formats (``"auto"`` resolved by :func:`~verispec.models.loader.resolve_weights`).
        """
        m = load_models(EngineConfig(model=model, draft=draft, **kwargs))
        return cls(m.config, m.target, m.tokenizer, m.eos_ids, m.draft, m.draft_tokenizer)

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
        """The configuration a request with ``spec`` (None: plain) runs (:func:`~verispec.engine.loading.describe`)."""
        return loading.describe(self.config, self.target, self.draft, spec or PLAIN)

    def encode(self, prompt: Prompt, chat: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: a string, ids, or chat messages (rendered with OpenAI ``tools``, if given)."""
        return self.codec.encode(prompt, chat, tools)

    def decode(self, ids: list[int]) -> str | None:
        return self.codec.decode(ids)

    def encode_prediction(self, prediction: Prediction | None) -> list[int] | None:
        """Token ids of a predicted output (text is tokenized without special tokens); None for none or empty."""
        return self.codec.encode_prediction(prediction)

    # -- state ----------------------------------------------------------------------------

    slots = property(lambda self: self.scheduler.slots)
    free_slots = property(lambda self: self.scheduler.free_slots)
    kv_budget_tokens = property(lambda self: self.scheduler.budget)
    kv_used_tokens = property(lambda self: self.scheduler.used_tokens,
                              doc="KV tokens reserved by running requests (prompt + max_tokens each).")
    num_running = property(lambda self: len(self._running))
    num_waiting = property(lambda self: len(self.scheduler.waiting))
    has_work = property(lambda self: bool(self._running or self.scheduler.waiting))
    prefix_reuse = property(lambda self: self.config.prefix_reuse, doc="Whether finished requests' KV stays for "
                            "later requests sharing a prefix (``config.prefix_reuse``).")
    failed = property(lambda self: self._failed, doc="The BaseException that last stopped a step (None if none has).")

    @property
    def draft_context(self) -> DraftContext:
        """What per-row drafters for this engine are built from (its models, cache and tokenizer)."""
        return DraftContext(self.target, self.cache, self.draft, self.tokenizer, self.config.compile, self._shared,
                            trees=not self.config.compile and self.config.tp == 1, lockstep=self.draft_runner)

    def drafter(self, spec: SpecConfig) -> Drafter | None:
        """A new per-row drafter for ``spec`` (None for plain decoding); raises a :class:`VerispecError` if it
        cannot be built."""
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
               chat: bool = False, on_tokens: OnTokens | None = None, drafter: CustomDrafter | None = None,
               prediction: Prediction | None = None, constraint: Constraint | None = None) -> RequestHandle:
        """Queue one request; returns its handle at once (:meth:`step` runs it).

        ``on_tokens(tokens)`` is called with the tokens each step adds (a
        :class:`~verispec.engine.stopping.StepTokens`: ``tokens.drafted`` of them accepted drafts);
        returning False cancels the request. ``drafter`` plugs in a custom :class:`Drafter` (or a
        callable that builds one) instead of the one ``spec.method`` names (``spec`` must speculate;
        its k and k policy apply). ``prediction`` is the output the caller expects (OpenAI's predicted
        outputs: text or token ids): runs of it that the answer repeats are drafted whatever ``spec``
        says, plain decoding included (:mod:`verispec.drafters.prediction`); the output stays the
        target's. ``constraint`` is a grammar the output follows (:class:`~verispec.constraints.Constraint`;
        the request ends when it is complete); it, the params' penalties and logit bias change the
        target's distribution, and speculation keeps the output that distribution's.
        Raises :class:`VerispecError` at once for a request that can never run: a prompt +
        max_tokens beyond the context or KV budget, a prediction longer than the context, stop strings
        or a constraint without a tokenizer, a method this engine cannot serve.
        """
        params = params or SamplingParams()
        spec = spec or PLAIN
        ids = self.encode(prompt, chat)
        predicted = self.encode_prediction(prediction)
        self._check_request(ids, params, spec, drafter)
        processor = self.codec.processor(params, len(ids), constraint, self.target.device)
        handle = RequestHandle(self, next(self._ids), ids)
        req = Request(ids, params, spec, handle, on_tokens, Metrics(requests=1, prompt_tokens=len(ids)),
                      own_drafter=drafter and own_drafter(drafter), prediction=predicted, processor=processor,
                      kpolicy=request_policy(spec) if spec.enabled else None)
        self.scheduler.submit(req, self._reserve(ids, params))
        self._by_handle[handle] = req
        return handle

    def _reserve(self, ids: list[int], params: SamplingParams) -> int:
        # A request never holds more than its slot: one whose max_tokens runs past the context ends
        # there (finish reason "length"), as a lone request always has.
        return min(len(ids) + params.max_tokens, self.max_len)

    def _check_request(self, ids: list[int], params: SamplingParams, spec: SpecConfig,
                       drafter: CustomDrafter | None) -> None:
        if params.stop and self.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer")
        self.scheduler.check(self._reserve(ids, params))
        if drafter is not None and not spec.enabled:
            raise VerispecError("a custom drafter needs a spec that speculates (method other than 'none')")
        if drafter is not None and not isinstance(drafter, Drafter) and not callable(drafter):
            raise VerispecError(f"drafter must be a Drafter or a callable building one, not {type(drafter).__name__}")
        if drafter is None:
            self.check_spec(spec)

    def cancel(self, handle: RequestHandle) -> bool:
        """Cancel ``handle``'s request: its slot and KV tokens are free when this returns."""
        req = self._by_handle.get(handle)
        if req is None or req.done:
            return False
        if req.slot is None:
            self.scheduler.remove_waiting(req)
        self._finish(req, "cancelled")
        return True

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecConfig | list[SpecConfig] | None = None, chat: bool = False,
                 drafter: CustomDrafter | None = None,
                 on_tokens: Callable[[int, list[int]], bool | None] | None = None,
                 prediction: Prediction | list[Prediction | None] | None = None,
                 constraint: Constraint | list[Constraint | None] | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts; returns one result per prompt, in order.

        ``params`` and ``spec`` are one for all or one per prompt; ``spec=None`` decodes plainly.
        Up to ``max_batch`` prompts run at once. ``drafter`` plugs in a custom drafter instead of
        the one ``spec.method`` names (``spec.k`` still applies): a callable that builds a
        :class:`Drafter` gives every prompt its own and they run batched, as built-in drafters do;
        one :class:`Drafter` keeps one sequence's state, so its prompts run one after another.
        Every prompt is encoded and checked before any work starts, so one bad prompt costs nothing.

        ``on_tokens(i, tokens)`` is called after every step with the tokens prompt ``i`` just
        gained (streaming); returning False cancels that request (finish reason "cancelled").
        ``tokens`` is a :class:`~verispec.engine.stopping.StepTokens`: a list whose ``drafted``
        attribute counts its leading tokens that were accepted drafts. ``prediction`` is one predicted
        output for every prompt (text or token ids) or a list of one per prompt (None for none);
        ``constraint`` likewise (see :meth:`submit`).
        """
        jobs = [(self.encode(prompt, chat), p, s, self.encode_prediction(pr), on_tokens and partial(on_tokens, i), c)
                for i, (prompt, p, s, pr, c) in enumerate(per_prompt(prompts, params, spec, prediction, constraint))]
        for ids, p, s, _, _, _ in jobs:
            self._check_request(ids, p, s, drafter)
        if isinstance(drafter, Drafter):
            return [self.submit(ids, p, s, on_tokens=cb, drafter=drafter, prediction=pr, constraint=c).result()
                    for ids, p, s, pr, cb, c in jobs]
        own = [None if drafter is None else own_drafter(drafter) for _ in jobs]  # built before any is queued
        handles = [self.submit(ids, p, s, on_tokens=cb, drafter=d, prediction=pr, constraint=c)
                   for (ids, p, s, pr, cb, c), d in zip(jobs, own, strict=True)]
        return [h.result() for h in handles]

    # -- running --------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit, prefill a chunk, and run one speculative step for the ready rows; True while work remains.

        Faults are isolated per request: one whose admission, prefill, drafter or token callback
        raises fails alone (its handle raises the error; its slot and KV tokens are freed), and a
        step whose shared forward raises is retried row by row (:mod:`verispec.engine.faults`); the
        cost model and policy stay as they were. An exception no request explains fails the running
        requests; a BaseException such as KeyboardInterrupt fails every request, resets the engine
        (:meth:`reset`: it serves new requests) and propagates.
        """
        with torch.inference_mode():
            try:
                for adm in self.scheduler.admit():
                    try:
                        self.rows.start(adm.item, adm.slot)
                        self._running[adm.slot] = adm.item
                    except Exception as e:  # noqa: BLE001 (this request's drafter or sampling set-up)
                        self._fail_request(adm.item, e, slot=adm.slot)
                waiting = [r for r in self._running.values() if not r.prefilled]
                sharing = list(self._running.values()) if self.config.prefix_reuse else []
                for req, e in self.rows.prefill(waiting, self.config.prefill_chunk, sharing):
                    self._fail_request(req, e)
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
            self.rows.clear(slot)

    def profile(self, k_max: int = PROFILE_K, context: int = 64, reps: int = 5) -> CostModel:
        """Measure the cost curves the cost policy uses, for k up to ``k_max`` and every batch size.

        Done on first use of the policy otherwise (at the default ``k_max``). Rows asking for a
        larger k are priced by extending the curves (:class:`~verispec.engine.costs.CostCurve`),
        never by profiling again. A server profiles before it serves.
        """
        self.costs = profile_costs(self.target, self.draft, self.slots, k_max, context, reps)
        self.policy = CostPolicy(self.costs)
        logger.info(self.costs.describe())
        return self.costs

    # -- internals ------------------------------------------------------------------------

    def _decode(self, ready: list[Request]) -> None:
        stepping = []
        for req in ready:
            grammar_end = req.processor.finish_reason(req.seq) if req.processor is not None else None
            if len(req.seq) >= self.max_len:  # no position left for a step
                self._finish(req, "length")
            elif grammar_end is not None:  # a complete grammar allows only the end, which plain decoding emits next
                self._finish(req, grammar_end)
            else:
                stepping.append(req)
        if not stepping:
            return
        policy_k = plan_step(stepping, self.max_len, self._policy, self.slots if self.config.compile else None)
        report = step_isolated(partial(speculative_step, self.target, self.cache, draft_model=self.draft_runner,
                                       full_span=self.config.compile), stepping, self.cache)
        self.stats.record(report, policy_k)
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
        if req.kpolicy is not None:
            req.kpolicy.update(report.drafted[i], report.accepted[i])
        if req.governed:
            req.acceptance.update(report.drafted[i], report.accepted[i])
        elif req.lookup is not None:
            req.lookup.update(report.drafted[i], report.accepted[i])
        if not req.n_out:  # engine time, from admission: queueing is the handle's (submitted_at)
            req.metrics.ttft_s = now - req.handle.admitted_at
        n_before = len(req.seq)
        finish = append_tokens(report.new_tokens[i], req.seq, len(req.prompt), req.params, self.eos_ids, self.decode)
        chunk = StepTokens.of(report.new_tokens[i], req.seq, n_before)
        if i in report.logprobs:
            chunk.logprobs = report.logprobs[i][: len(chunk)]
            req.logprobs += chunk.logprobs
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

    def _fail_request(self, req: Request, error: BaseException, slot: int | None = None) -> None:
        """Fail one request with ``error``: its handle raises it, its slot and KV tokens are free at once.

        ``slot``: the slot it was being admitted to when it failed. Nothing else changes: the other
        requests, the cost model and the policy stay as they were.
        """
        if req.done:
            return
        logger.error("request %d failed (%r); the other requests go on", req.handle.id, error, exc_info=error)
        if req.slot is None and slot is not None:  # failed while being admitted: the scheduler holds its slot
            self._running.pop(slot, None)
            self.scheduler.release(slot)
            self.rows.clear(slot)
        self._finish(req, "error", error)

    def _finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        req.done = True
        self._by_handle.pop(req.handle, None)
        if req.slot is not None:
            del self._running[req.slot]
            self.scheduler.release(req.slot)
            self.rows.release(req, error)
        m = req.metrics
        m.generated_tokens = req.n_out
        m.total_s = time.perf_counter() - (req.handle.admitted_at or req.handle.submitted_at)
        if req.predictor is not None:
            m.accepted_prediction_tokens, m.rejected_prediction_tokens = req.predictor.accepted, req.predictor.rejected
        if req.processor is not None:
            m.constrain_s = req.processor.seconds
        self.stats.requests.merge(m)
        if error is not None:
            req.handle._finish(None, error)
            return
        out = req.out
        req.handle._finish(GenerationResult(req.prompt, out, final_text(self.decode(out), req.params.stop), reason, m,
                                            req.logprobs if req.params.logprobs is not None else None))

    def _fail(self, error: BaseException) -> None:
        # A BaseException mid-step leaves the caches in an unknown state: fail every request, start clean.
        self._failed = error
        logger.warning("a step stopped (%r); its requests end with it", error)
        for req in list(self._by_handle.values()):
            req.done = True
            req.handle._finish(None, error)
        self.reset()
