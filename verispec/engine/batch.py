"""Continuous batching: many requests share one target forward per step, each speculating on its own.

:class:`BatchEngine` wraps an :class:`~verispec.engine.engine.Engine` (its models, tokenizer and
EOS ids) and owns batch-sized KV caches: one row ("slot") per running request. Each
:meth:`BatchEngine.step` admits queued requests into free slots (FIFO, within the KV budget; see
:mod:`verispec.engine.scheduler`), prefills newly admitted prompts in bounded chunks, then runs one
batched speculative step (:mod:`verispec.engine.batch_step`) for every row that is ready. Finished
and cancelled requests free their slot at once; their KV stays in the slot's rows, and a later
request sharing a prefix with it is placed there and prefills only the rest
(:mod:`verispec.engine.prefix`). ``start()`` runs steps on a background thread; without it, waiting
on a handle drives the steps itself.

A request whose work raises fails alone: its handle gets the error, its slot is freed, and the
step goes on without it (see :meth:`BatchEngine.step`); the other requests, and what the engine
learned about costs and acceptance, are untouched.

Outputs equal the one-request engine's: same step, same stop conditions
(:mod:`verispec.engine.stopping`), a generator per request. With the ``cost`` k policy the k of a
step depends on the batch (see :mod:`verispec.engine.batch_policy`); greedy outputs stay identical
and sampled ones exactly distributed, but which seeded sample a request gets then depends on load.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.config import PLAIN, SpecConfig
from verispec.drafters import make_drafter
from verispec.drafters.base import DraftContext, Drafter
from verispec.drafters.vocab import special_token_ids
from verispec.engine.batch_draft import MAX_LOCKSTEP_FEED, BatchDraftModel
from verispec.engine.batch_policy import BatchCostModel, BatchPolicy, RowPlan, profile_costs
from verispec.engine.batch_step import BatchStats, Row, StepReport, batched_step
from verispec.engine.engine import Engine, GenerationResult, Prompt
from verispec.engine.metrics import Metrics
from verispec.engine.policy import PROFILE_K, Acceptance, AcceptanceSpread, KPolicy, make_policy
from verispec.engine.prefix import SlotPrefixes, held_tokens
from verispec.engine.scheduler import Scheduler
from verispec.engine.stopping import StepTokens, append_tokens, final_text, k_cap
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.sampling import SamplingParams

# Cache positions past max_len: a row padded to the batch's widest k + 1 (k <= 64) writes up to
# 64 positions past its own end, and the lockstep draft catch-up a few more.
SLACK = 64 + 1 + MAX_LOCKSTEP_FEED + 4

OnTokens = Callable[[list[int]], bool | None]


class RequestHandle:
    """A submitted request: stream its tokens, wait for its result, or cancel it.

    Iterate (``for chunk in handle`` or ``async for chunk in handle``) for the token lists each
    step adds; :meth:`result` blocks until it is done. Without a background runner
    (:meth:`BatchEngine.start`), waiting drives the engine's steps from the waiting thread.
    """

    def __init__(self, engine: BatchEngine, request_id: int, prompt: list[int]) -> None:
        self._engine, self.id, self.prompt_token_ids = engine, request_id, prompt
        self._cond = threading.Condition()
        self._chunks: deque[list[int]] = deque()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    @property
    def finish_reason(self) -> str | None:
        return self._result.finish_reason if self._result is not None else None

    def cancel(self) -> bool:
        """Stop the request now (finish reason ``"cancelled"``); False if it had already finished."""
        return self._engine.cancel(self)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The finished request's result (blocks; drives the engine's steps when it has no runner)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            if not self._engine.running:
                self._engine.step()
                continue
            with self._cond:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
                self._cond.wait(left if left is not None else 0.5)
        return self._outcome()

    async def aresult(self) -> GenerationResult:
        """:meth:`result` for asyncio code: never blocks the event loop."""
        while not self.done:
            await self._changed()
        return self._outcome()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            with self._cond:
                if self._chunks:
                    chunk = self._chunks.popleft()
                elif self.done:
                    self._outcome()  # raises the engine's error, if any
                    return
                else:
                    chunk = None
                    if self._engine.running:
                        self._cond.wait(0.5)
                        continue
            if chunk is None:
                self._engine.step()
            else:
                yield chunk

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> list[int]:
        while True:
            with self._cond:
                if self._chunks:
                    return self._chunks.popleft()
                if self.done:
                    self._outcome()
                    raise StopAsyncIteration
            await self._changed()

    async def _changed(self) -> None:
        # Wait for the engine thread to push something, or run one step off the event loop.
        if not self._engine.running:
            await asyncio.to_thread(self._engine.step)
            return
        event = asyncio.Event()
        with self._cond:
            if self._chunks or self.done:
                return
            self._waker = (asyncio.get_running_loop(), event)
        await event.wait()

    def _outcome(self) -> GenerationResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- called by the engine ------------------------------------------------------------

    def _push(self, tokens: list[int]) -> None:
        with self._cond:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self._chunks.append(tokens)
            self._wake()

    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        with self._cond:
            self.finished_at = time.perf_counter()
            self._result, self._error = result, error
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        if self._waker is not None:
            loop, event = self._waker
            self._waker = None
            loop.call_soon_threadsafe(event.set)


@dataclass(eq=False)
class _Request:
    """Engine-side state of one request."""

    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    spec: SpecConfig
    on_tokens: OnTokens | None
    metrics: Metrics
    row: Row | None = None
    out: list[int] = field(default_factory=list)
    prefilled: bool = False
    kpolicy: KPolicy | None = None  # a per-request k policy (fixed, heuristic, confidence)
    acceptance: Acceptance | None = None  # set for rows the batch policy governs (k_policy "cost")
    done: bool = False
    drafter: Drafter | None = None  # the caller's own drafter (instead of the one spec.method names)


class _DrafterPool:
    """Drafters for per-row methods (n-gram, retrieval, hybrid), one per concurrently running request.

    Drafters keep per-sequence state, so two rows never share one; finished requests return
    theirs for reuse (``begin`` resets it), so a drafter is built at most once per slot.
    """

    def __init__(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.free: dict[str, list[Drafter]] = {}

    def acquire(self, spec: SpecConfig) -> Drafter:
        pool = self.free.setdefault(spec.drafter_key, [])
        return pool.pop() if pool else make_drafter(spec, self.ctx)

    def release(self, spec: SpecConfig, drafter: Drafter) -> None:
        self.free.setdefault(spec.drafter_key, []).append(drafter)


class BatchEngine:
    """Serves many requests at once with continuous batching and batched speculative decoding.

    ``max_batch`` slots share one target forward per step; each slot holds ``max_len`` tokens
    (default: the engine's, less a little slack for padding). ``memory_limit`` (bytes of KV cache,
    target and draft together) lowers the slot count so the static caches fit; ``kv_budget_tokens``
    caps the tokens reserved by running requests (default: slots x max_len). ``prefill_chunk``
    bounds the prompt tokens prefilled per step, so a long prompt delays running rows by at most
    one chunk. ``costs`` gives the concurrency-aware policy a cost model (default: profiled on
    first use, see :meth:`profile`). ``prefix_reuse`` keeps a finished request's KV (target and
    draft model) in its slot and places a new request in the free slot sharing its longest prefix,
    which it then does not prefill (:mod:`verispec.engine.prefix`); False resets every slot when
    its request leaves and hands out the lowest free slot. The cost policy's curves are
    profiled on first use for k up to :data:`~verispec.engine.policy.PROFILE_K` (see :meth:`profile`;
    a server profiles before it serves, for its largest k).
    """

    def __init__(self, engine: Engine, max_batch: int = 8, max_len: int | None = None,
                 memory_limit: int | None = None, kv_budget_tokens: int | None = None, prefill_chunk: int = 512,
                 costs: BatchCostModel | None = None, prefix_reuse: bool = True) -> None:
        if engine.config.compile:
            raise VerispecError("BatchEngine runs eager forwards (compiled graphs are specialised to one row); "
                                "build the engine with compile=False")
        if max_batch < 1 or prefill_chunk < 1:
            raise VerispecError("max_batch and prefill_chunk must be at least 1")
        self.engine, self.target, self.draft = engine, engine.target, engine.draft
        rope_len = self.target.rope_cos.shape[0]
        if self.draft is not None:
            rope_len = min(rope_len, self.draft.rope_cos.shape[0])
        self.max_len = min(max_len or engine.config.max_len, rope_len - SLACK)
        if self.max_len < 2:
            raise VerispecError(f"the model's {rope_len} positions leave no room for a batch context")
        cache_len = self.max_len + SLACK
        per_token = _kv_bytes_per_token(self.target) + (_kv_bytes_per_token(self.draft) if self.draft else 0)
        slots = max_batch
        if memory_limit is not None:
            slots = min(max_batch, memory_limit // (cache_len * per_token))
            if slots < 1:
                raise VerispecError(f"memory_limit {memory_limit} B holds no slot of {self.max_len} tokens "
                                    f"({cache_len * per_token} B each); lower max_len or raise the limit")
        budget = slots * self.max_len if kv_budget_tokens is None else min(kv_budget_tokens, slots * self.max_len)
        self._prefix_reuse = prefix_reuse
        self._prefixes = SlotPrefixes(slots)  # per free slot: the tokens its target row holds
        self.scheduler: Scheduler[_Request] = Scheduler(slots, budget, self.max_len,
                                                        self._choose_slot if prefix_reuse else None)
        self.cache = self.target.new_cache(slots, cache_len)
        self.draft_model = (BatchDraftModel(self.draft, slots, cache_len, self.target.args.vocab_size,
                                            special_token_ids(engine.tokenizer, engine.eos_ids))
                            if self.draft is not None else None)
        self.prefill_chunk = prefill_chunk
        self.costs = costs
        self.policy: BatchPolicy | None = None
        self.stats = BatchStats()
        self._drafters = _DrafterPool(engine.draft_context)
        self._seen_acceptance: dict[str, Acceptance] = {}  # per drafter, over all requests: new rows' prior
        self._seen_spread: dict[str, AcceptanceSpread] = {}  # per drafter: how requests' acceptance differs
        self._running: dict[int, _Request] = {}  # slot -> request, in admission order
        self._by_handle: dict[RequestHandle, _Request] = {}  # every request not finished yet
        self._ids = itertools.count()
        self._lock = threading.RLock()  # one step at a time; submit/cancel from any thread
        self._callers = 0  # threads other than the runner waiting for the lock (see _exclusive)
        self._callers_lock = threading.Lock()
        self._work = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: BaseException | None = None
        logger.info("batch engine: %d slots of %d tokens, KV budget %d tokens (%.1f MiB of caches)", slots,
                    self.max_len, budget, (self.cache.nbytes() + (self.draft_model.cache.nbytes()
                                                                  if self.draft_model else 0)) / 2**20)

    @classmethod
    def from_pretrained(cls, model: str, draft: str | None = None, max_batch: int = 8,
                        memory_limit: int | None = None, kv_budget_tokens: int | None = None,
                        prefill_chunk: int = 512, prefix_reuse: bool = True, **engine_kwargs: Any) -> BatchEngine:
        """Load an :class:`Engine` (``engine_kwargs``: :class:`EngineConfig` fields) and batch it."""
        engine = Engine.from_pretrained(model, draft, **engine_kwargs)
        return cls(engine, max_batch=max_batch, memory_limit=memory_limit, kv_budget_tokens=kv_budget_tokens,
                   prefill_chunk=prefill_chunk, prefix_reuse=prefix_reuse)

    # -- state ----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.scheduler.slots

    @property
    def prefix_reuse(self) -> bool:
        """Whether finished requests' KV stays for later requests sharing a prefix (set at construction)."""
        return self._prefix_reuse

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
    def running(self) -> bool:
        """True while the background runner is stepping."""
        return self._thread is not None and self._thread.is_alive()

    # -- requests -------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, spec: SpecConfig | None = None,
               chat: bool = False, on_tokens: OnTokens | None = None, drafter: Drafter | None = None) -> RequestHandle:
        """Queue one request; returns its handle at once.

        ``on_tokens(tokens)`` is called (on the stepping thread) with the tokens each step adds (a
        :class:`~verispec.engine.stopping.StepTokens`: ``tokens.drafted`` of them accepted drafts);
        returning False cancels the request. ``drafter`` plugs in a custom :class:`Drafter` for this
        request instead of the one ``spec.method`` names (``spec`` must speculate; its k and k policy
        apply). Raises :class:`VerispecError` at once for a request that can never run: a prompt +
        max_tokens beyond the context or KV budget, stop strings without a tokenizer, a method the
        batch cannot serve.
        """
        params = params or SamplingParams()
        spec = spec or PLAIN
        if params.stop and self.engine.tokenizer is None:
            raise VerispecError("stop strings need a tokenizer")
        ids = self.engine.encode(prompt, chat)
        self.scheduler.check(len(ids) + params.max_tokens)
        if drafter is not None and not spec.enabled:
            raise VerispecError("a custom drafter needs a spec that speculates (method other than 'none')")
        if drafter is None:
            self._check_spec(spec)
        with self._exclusive():
            if self._failed is not None:
                raise VerispecError(f"the batch engine stopped after an error: {self._failed!r}")
            handle = RequestHandle(self, next(self._ids), ids)
            req = _Request(handle, ids, params, spec, on_tokens, Metrics(requests=1, prompt_tokens=len(ids)),
                           drafter=drafter)
            self.scheduler.submit(req, len(ids) + params.max_tokens)
            self._by_handle[handle] = req
        self._work.set()
        return handle

    def cancel(self, handle: RequestHandle) -> bool:
        """Cancel ``handle``'s request: its slot and KV tokens are free when this returns."""
        with self._exclusive():
            req = self._by_handle.get(handle)
            if req is None or req.done:
                return False
            if req.row is None:
                self.scheduler.remove_waiting(req)
            self._finish(req, "cancelled")
            return True

    def generate_batch(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                       spec: SpecConfig | list[SpecConfig] | None = None,
                       chat: bool = False) -> list[GenerationResult]:
        """Submit every prompt, run until all finish and return their results in order.

        ``params`` and ``spec`` are one for all or one per prompt. Every request is checked
        before any is queued, so one bad prompt costs nothing.
        """
        n = len(prompts)
        params_l = params if isinstance(params, list) else [params or SamplingParams()] * n
        spec_l = spec if isinstance(spec, list) else [spec or PLAIN] * n
        if len(params_l) != n or len(spec_l) != n:
            raise VerispecError("give one params and one spec for all prompts, or one per prompt")
        encoded = [self.engine.encode(p, chat) for p in prompts]
        for ids, sp, s in zip(encoded, params_l, spec_l, strict=True):
            if sp.stop and self.engine.tokenizer is None:
                raise VerispecError("stop strings need a tokenizer")
            self.scheduler.check(len(ids) + sp.max_tokens)
            self._check_spec(s)
        handles = [self.submit(ids, sp, s) for ids, sp, s in zip(encoded, params_l, spec_l, strict=True)]
        return [h.result() for h in handles]

    # -- running --------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit, prefill a chunk, and run one batched step for the ready rows; True while work remains.

        Faults are isolated per request: one whose admission, prefill, drafter or token callback
        raises fails alone (its handle raises the error; its slot and KV tokens are freed), and a
        step whose shared forward raises is retried row by row, so only the rows that fail alone
        fail. The surviving rows keep every cache consistent (the target's cache row holds
        ``seq[:-1]``; what a failed step wrote past a row's length is never read), and the cost
        model, the policy and the acceptance estimates stay as they were. Only an exception that
        no request explains (a fault in the scheduling itself) fails the running requests, and a
        BaseException such as KeyboardInterrupt stops the engine: every request gets it, new ones
        are refused, and it propagates.
        """
        with self._lock, torch.inference_mode():
            if self._failed is not None:
                raise VerispecError(f"the batch engine stopped after an error: {self._failed!r}")
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
                logger.exception("a batch step failed outside any one request; failing the running requests")
                for req in list(self._running.values()):
                    self._fail_request(req, e)
            except BaseException as e:
                self._fail(e)
                raise
            return self.has_work

    @property
    def failed(self) -> BaseException | None:
        """The BaseException that stopped the engine (None while it runs)."""
        return self._failed

    def run_until_done(self) -> None:
        """Step until no request is running or waiting (without a background runner)."""
        while self.step():
            pass

    def start(self) -> None:
        """Run steps on a background thread until :meth:`stop`."""
        with self._lock:
            if self.running:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="verispec-batch", daemon=True)
            self._thread.start()

    def stop(self, cancel: bool = False) -> None:
        """Stop the background runner (after its current step); ``cancel`` also cancels every request."""
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if cancel:
            with self._exclusive():
                for req in list(self._by_handle.values()):
                    self.cancel(req.handle)

    def profile(self, k_max: int = PROFILE_K, context: int = 64) -> BatchCostModel:
        """Measure the cost curves the concurrency-aware policy uses, for k up to ``k_max`` and every batch size.

        Done on first use of the policy otherwise (at the default ``k_max``). Rows asking for a
        larger k are priced by extending the curves (:class:`CostCurve`), never by profiling again.
        """
        with self._exclusive():
            # The longer context, for what each position more costs, within what a slot can hold.
            long_context = min(8 * context, self.max_len - k_max - 1)
            self.costs = profile_costs(self.target, self.draft, self.slots, k_max, context, long_context=long_context)
            self.policy = BatchPolicy(self.costs)
            c = self.costs
            logger.info("batch costs at %d-token context: target %s, draft %s; per token and further position: "
                        "target %.2g s, draft %.2g s", c.per_position.context, _fmt(c.target.points),
                        _fmt(c.draft.points) if c.draft else "-", c.per_position.target_s, c.per_position.draft_s)
            return self.costs

    def _loop(self) -> None:
        while not self._stopping:
            while self._callers:  # let a submit or cancel in before the next step (see _exclusive)
                time.sleep(1e-4)
            self._work.clear()
            try:
                busy = self.step()
            except BaseException:  # already delivered to every handle by step()
                return
            if not busy:
                self._work.wait(0.5)

    # -- internals ------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The engine's lock for a caller other than the runner, taken ahead of the runner's next step.

        Python's locks are not fair: a runner that releases the lock and takes it again for its
        next step can keep a submitter or canceller waiting for many steps (a cancel issued right
        after submit found the request already finished at its 50-token limit). Waiting callers
        are counted, and the runner lets them in before it steps again.
        """
        with self._callers_lock:
            self._callers += 1
        try:
            self._lock.acquire()
        finally:
            with self._callers_lock:
                self._callers -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _check_spec(self, spec: SpecConfig) -> None:
        if not spec.enabled:
            return
        if spec.method == "draft":
            if self.draft is None:
                raise VerispecError("method 'draft' needs a draft model (--draft)")
            return
        if spec.method == "layerskip" or (spec.method == "hybrid" and self.draft is None and spec.layers is not None):
            # Layer-skip drafts on the target's own one-row cache.
            raise VerispecError("layer-skip drafting is not available in batched mode; use draft, ngram, "
                                "retrieval or hybrid")
        with self._exclusive():  # builds (and so validates) one drafter for this spec up front
            self._drafters.release(spec, self._drafters.acquire(spec))

    def _choose_slot(self, req: _Request, free: list[int]) -> int:
        """The scheduler's pick among the free slots: where the request's prompt is cached longest."""
        return self._prefixes.choose(req.prompt, free)

    def _start(self, req: _Request, slot: int) -> None:
        req.handle.admitted_at = time.perf_counter()
        # The row keeps what the slot's previous request left that this prompt starts with; _prefill
        # goes on from there. Without a record (reuse off, a fresh slot) that is nothing.
        reused = self.cache.lengths[slot] = self._prefixes.claim(slot, req.prompt)
        req.metrics.prefix_reused_tokens = reused
        self.stats.prefix_hits += int(reused > 0)
        self.stats.prefix_reused_tokens += reused
        spec = req.spec
        # On the target's device, as in Engine: verification samples there.
        generator = None if req.params.greedy else req.params.generator(self.target.device)
        row = Row(slot, list(req.prompt), req.params, generator, req.metrics)
        if spec.enabled:
            if spec.method == "draft" and req.drafter is None:
                row.model_draft = True
                row.min_confidence = spec.min_confidence
                assert self.draft_model is not None
                self.stats.prefix_draft_reused_tokens += self.draft_model.begin(slot, req.prompt, spec.draft_vocab,
                                                                                spec.draft_window)
            else:
                row.drafter = req.drafter or self._drafters.acquire(spec)
                row.drafter.begin(req.prompt)
            if spec.k_policy == "cost":
                # Start from what this drafter achieved on earlier requests, not a blind prior.
                seen = self._seen_acceptance.setdefault(spec.drafter_key, Acceptance(decay=0.98))
                req.acceptance = Acceptance(prior_a=seen.rate)
            else:
                req.kpolicy = make_policy(spec, None)
        req.row = row
        self._running[slot] = req

    def _prefill(self) -> None:
        # All but the last prompt token; the first step scores that one with the first drafts.
        budget = self.prefill_chunk
        t0 = time.perf_counter()
        failed: list[tuple[_Request, Exception]] = []
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

    def _decode(self, ready: list[_Request]) -> None:
        rows: list[Row] = []
        plans: list[RowPlan] = []
        stepping: list[_Request] = []
        for req in ready:
            row = req.row
            room = self.max_len - len(row.seq)  # positions left; a step uses k + 1 of them
            if room < 1:
                self._finish(req, "length")
                continue
            cap = k_cap(req.spec.k, req.params, len(req.out), room) if row.speculates else 0
            if req.acceptance is not None:
                catch_up = self.draft_model.catch_up_needed(row.slot, row.seq) \
                    if row.model_draft and self.draft_model is not None else 0
                horizon = self.engine.answer_lengths.expected_remaining(
                    len(req.out), min(req.params.max_tokens - len(req.out), room))
                spread = self._seen_spread.setdefault(req.spec.drafter_key, AcceptanceSpread()).sd
                plans.append(RowPlan(cap, req.acceptance.rate, model_draft=row.model_draft, catch_up=catch_up,
                                     horizon=horizon, spread=spread, context=len(row.seq),
                                     request=req.handle.id))
            else:
                row.k = req.kpolicy.choose(cap) if req.kpolicy is not None and row.speculates else 0
                plans.append(RowPlan(cap, None, row.k, model_draft=row.model_draft, context=len(row.seq)))
            rows.append(row)
            stepping.append(req)
        if not rows:
            return
        policy_k = None
        if any(p.acceptance is not None for p in plans):
            span = max(r.slot for r in rows) - min(r.slot for r in rows) + 1
            # Rows admitted but still prefilling, and waiting ones a free slot will take, join soon.
            joining = sum(not r.prefilled for r in self._running.values()) + min(self.num_waiting, self.free_slots)
            policy_k = self._policy(stepping).choose(plans, span, joining)
            for req, plan in zip(stepping, plans, strict=True):
                if plan.acceptance is not None:
                    req.row.k = min(policy_k, plan.cap)
        report = self._run_step(rows)
        self.stats.record(report, policy_k)
        if self.costs is not None and not report.retried:
            self.costs.observe_target(report.scored_tokens, report.score_s, report.context)
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

    def _advance(self, req: _Request, report: StepReport, i: int, now: float) -> None:
        """Fold row ``i``'s step into its request: policy and acceptance updates, new tokens, stop conditions."""
        row = req.row
        if req.kpolicy is not None:
            req.kpolicy.update(row.k, report.drafted[i], report.accepted[i], report.propose_s, report.score_s)
        if req.acceptance is not None:
            req.acceptance.update(report.drafted[i], report.accepted[i])
            self._seen_acceptance[req.spec.drafter_key].update(report.drafted[i], report.accepted[i])
        if not req.out:
            req.metrics.ttft_s = now - req.handle.submitted_at
        n_before = len(req.out)
        finish = append_tokens(report.new_tokens[i], row.seq, req.out, req.params, self.engine.eos_ids,
                               self.engine.decode)
        chunk = StepTokens.of(report.new_tokens[i], req.out, n_before)
        if chunk:
            req.handle._push(chunk)
        if req.on_tokens is not None and req.on_tokens(chunk) is False and finish is None:
            finish = "cancelled"
        if finish is not None and not req.done:
            self._finish(req, finish)

    def _policy(self, stepping: list[_Request]) -> BatchPolicy:
        if self.policy is None:
            if self.costs is None:
                # Sized by the engine, never by a request: a k = 64 request once profiled 65 widths
                # here while every running request waited (a server profiles before it serves).
                self.profile()
            else:
                self.policy = BatchPolicy(self.costs)
        assert self.policy is not None
        return self.policy

    def _run_step(self, rows: list[Row]) -> StepReport:
        """One batched step of ``rows``; a row that fails it is in ``report.failed``, the others advance.

        A row whose own drafter raises is left out of the step by :func:`batched_step`. If the step
        raises anyway (the lockstep draft model, the shared target forward, verification), it is
        undone, each row's caches, drafter and generator as they were before, and every row runs it
        alone: the rows that raise alone are the ones that fail. The combined report is marked
        ``retried`` (its timings are no single forward's, so the cost model does not learn from it).
        """
        saved = [self._row_state(r) for r in rows]
        try:
            return batched_step(self.target, self.cache, rows, self.draft_model)
        except Exception as e:  # noqa: BLE001 (isolated below)
            logger.warning("a batched step of %d rows failed (%r); retrying its rows one by one", len(rows), e)
        for row, state in zip(rows, saved, strict=True):
            self._restore_row(row, state)
        report = StepReport(len(rows), 0, 0, 0, 0.0, 0.0, 0.0, retried=True)
        for i, (row, state) in enumerate(zip(rows, saved, strict=True)):
            try:
                alone = batched_step(self.target, self.cache, [row], self.draft_model)
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

        The target's cache row is back at ``len(seq) - 1``; the draft model and a per-row drafter
        are told that only ``seq`` is final (they lower their lengths and catch up next time), and the
        generator is back where it was, so a retried sampled row draws what it would have drawn.
        """
        length, generator_state = state
        self.cache.lengths[row.slot] = length
        if row.model_draft and self.draft_model is not None:
            self.draft_model.commit(row.slot, len(row.seq))
        if row.drafter is not None:
            try:
                row.drafter.commit(len(row.seq))
            except Exception:  # noqa: BLE001 (a broken drafter fails its row when it runs alone)
                pass
        if generator_state is not None:
            row.generator.set_state(generator_state)

    def _fail_request(self, req: _Request, error: BaseException, slot: int | None = None) -> None:
        """Fail one request with ``error``: its handle raises it, its slot and KV tokens are free at once.

        ``slot``: the slot it was being admitted to when it failed. Nothing else changes: the other
        requests, the cost model, the policy and the acceptance estimates stay as they were.
        """
        if req.done:
            return
        logger.error("request %d failed (%r); the other requests go on", req.handle.id, error, exc_info=error)
        if req.row is None and slot is not None:  # failed while being admitted: the scheduler holds its slot
            self._running.pop(slot, None)
            self.scheduler.release(slot)
            self.cache.reset(slot)
            if self.draft_model is not None:
                self.draft_model.begin(slot)
        self._finish(req, "error", error)

    def _finish(self, req: _Request, reason: str, error: BaseException | None = None) -> None:
        req.done = True
        self._by_handle.pop(req.handle, None)
        if reason != "cancelled" and error is None:
            self.engine.answer_lengths.add(len(req.out), cut=reason == "length")
        if req.acceptance is not None and error is None:
            self._seen_spread.setdefault(req.spec.drafter_key, AcceptanceSpread()).add(req.acceptance)
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
                self.cache.reset(slot)
            if self.draft_model is not None and (req.row.model_draft or error is not None):
                self.draft_model.release(slot, req.row.seq if self.prefix_reuse and error is None else None)
            # A drafter goes back to the pool unless it was the caller's own, or its request failed (it may
            # be what failed).
            if req.row.drafter is not None and req.drafter is None and error is None:
                self._drafters.release(req.spec, req.row.drafter)
        m = req.metrics
        m.generated_tokens = len(req.out)
        m.total_s = time.perf_counter() - req.handle.submitted_at
        self.stats.requests.merge(m)
        if error is not None:
            req.handle._finish(None, error)
            return
        text = final_text(self.engine.decode(req.out), req.params.stop)
        req.handle._finish(GenerationResult(req.prompt, req.out, text, reason, m))

    def _fail(self, error: BaseException) -> None:
        # A failed step leaves the caches in an unknown state: fail every request, refuse new ones.
        self._failed = error
        logger.error("batch step failed: %r", error)
        for req in list(self._by_handle.values()):
            req.done = True
            req.handle._finish(None, error)
        self._by_handle.clear()


def _kv_bytes_per_token(model: Any) -> int:
    a = model.args
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * torch.finfo(model.dtype).bits // 8


def _fmt(points: dict[int, float]) -> str:
    return ", ".join(f"{t}:{s * 1e3:.1f}ms" for t, s in sorted(points.items()))
