"""Continuous batching with batched speculative decoding: every request gets exactly what it would alone.

Greedy outputs of the batch engine equal Engine.generate per request (plain, draft model, n-gram,
the concurrency-aware policy; batches of 1..8 with mixed prompt lengths and max_tokens); requests
arriving or cancelled mid-flight leave the others unchanged and give their slot and KV tokens back;
seeded sampling does not depend on batch companions; the policy turns speculation off when a
(synthetic) cost curve says verification is compute-bound.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from drafters_common import FailingDrafter, build_tok_model

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig, VerispecError
from verispec.drafters.base import Drafter, Proposal
from verispec.engine.costs import CostCurve, CostModel
from verispec.engine.scheduler import Scheduler

# make_tiny's eos_token_id, plus a token the tiny target emits often, so that some requests stop early.
EOS_IDS = {1, 26}
MAX_LEN = 128
# Different lengths (1 to 17 tokens), with repeats so the n-gram drafter finds matches.
PROMPTS = [[2], [3, 5, 7, 9, 3, 5, 7], [10, 20, 30, 40, 10, 20], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11],
           [40, 41], [50, 51, 52, 53, 54, 50, 51, 52, 53, 54, 50, 51, 52, 53, 54, 50, 51],
           [60, 61, 62, 63, 60], [70, 71, 72, 73, 74, 75, 76, 77, 70, 71, 72, 73]]
# Different max_tokens; half the requests may stop at an EOS id.
PARAMS = [SamplingParams(max_tokens=8 + 5 * i, ignore_eos=i % 2 == 1) for i in range(len(PROMPTS))]
SPECS = {
    "plain": SpecConfig(k_policy="fixed", method="none", k=0),
    "draft": SpecConfig(k_policy="fixed", method="draft", k=4),
    "ngram": SpecConfig(k_policy="fixed", method="ngram", k=3),
    "draft-cost": SpecConfig(method="draft", k=6, k_policy="cost"),
    "draft-confidence": SpecConfig(method="draft", k=6, k_policy="confidence", confidence=0.5),
    "draft-cost-confidence": SpecConfig(method="draft", k=6, k_policy="cost", confidence=0.5),
    "ngram-heuristic": SpecConfig(method="ngram", k=5, k_policy="heuristic"),
}


def make_engine(target, draft=None) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=MAX_LEN, progress=False)
    return Engine(cfg, target.model, None, EOS_IDS, draft=None if draft is None else draft.model)


@pytest.fixture(scope="module")
def engine(qwen2_tiny, qwen2_noisy_draft_tiny) -> Engine:
    """The target with a noisy copy as draft: drafts are accepted sometimes, rejected sometimes."""
    return make_engine(qwen2_tiny, qwen2_noisy_draft_tiny)


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[list[int]]]:
    """Each request decoded alone by Engine.generate, per method."""
    return {name: [engine.generate(p, pa, spec)[0].token_ids for p, pa in zip(PROMPTS, PARAMS, strict=True)]
            for name, spec in SPECS.items()}


def test_reference_is_not_degenerate(reference):
    plain = reference["plain"]
    assert all(len(set(ids)) >= 3 for ids in plain if len(ids) >= 8)
    assert any(len(ids) < pa.max_tokens for ids, pa in zip(plain, PARAMS, strict=True))  # some stop at EOS
    assert all(v == plain for v in reference.values())  # greedy speculation is lossless


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("batch", range(1, 9))
def test_greedy_batch_matches_engine(engine, reference, method, batch):
    be = engine.with_config(max_batch=batch)
    results = be.generate(PROMPTS[:batch], PARAMS[:batch], SPECS[method])
    assert [r.token_ids for r in results] == reference[method][:batch]
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert be.free_slots == batch and be.kv_used_tokens == 0 and be.num_running == 0
    if method != "plain":
        assert sum(r.metrics.drafted for r in results) > 0 or method.startswith("draft-cost")
    if method == "draft" and batch == 8:  # both verification branches ran inside the batch
        assert 0 < sum(r.metrics.accepted for r in results) < sum(r.metrics.drafted for r in results)


def test_queueing_and_mixed_specs_match_engine(engine, reference):
    # 8 requests through 3 slots, each with its own method: admission as slots free up.
    be = engine.with_config(max_batch=3)
    names = [list(SPECS)[i % len(SPECS)] for i in range(len(PROMPTS))]
    results = be.generate(PROMPTS, PARAMS, [SPECS[n] for n in names])
    assert [r.token_ids for r in results] == [reference[n][i] for i, n in enumerate(names)]
    assert max(be.stats.rows_steps) == 3
    assert be.free_slots == 3 and be.kv_used_tokens == 0


def test_rows_with_different_k_match_plain(engine, reference):
    # Rows with different fixed k pad to the widest one; the padding must not leak into any row.
    be = engine.with_config(max_batch=8)
    specs = [SpecConfig(k_policy="fixed", method="draft", k=k) for k in (1, 2, 3, 5, 8, 0, 4, 7)]
    results = be.generate(PROMPTS, PARAMS, specs)
    assert [r.token_ids for r in results] == reference["plain"]


def test_chunked_prefill_matches(engine, reference):
    be = engine.with_config(max_batch=4, prefill_chunk=3)
    results = be.generate(PROMPTS, PARAMS, SPECS["draft"])
    assert [r.token_ids for r in results] == reference["draft"]
    assert be.stats.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)


class CountingTarget:
    """The target, counting its prefill forwards (``last_only``) and their rows; a prefill forward whose tokens
    hold ``poison`` raises."""

    def __init__(self, target, poison: int | None = None) -> None:
        self.target, self.poison, self.prefills, self.raised = target, poison, [], 0

    def __call__(self, tokens, positions, cache, **kwargs):
        if kwargs.get("last_only"):
            self.prefills.append(tokens.shape[0])
            if self.poison is not None and bool((tokens == self.poison).any()):
                self.raised += 1
                raise RuntimeError("injected prefill fault")
        return self.target(tokens, positions, cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


@pytest.mark.parametrize("batch_prefill", [True, False])
def test_prompts_admitted_together_prefill_in_one_forward(engine, reference, batch_prefill):
    be = engine.with_config(max_batch=4, batch_prefill=batch_prefill)
    be.rows.target = counting = CountingTarget(be.rows.target)
    results = be.generate(PROMPTS[4:8], PARAMS[4:8], SPECS["draft"])
    assert [r.token_ids for r in results] == reference["draft"][4:8]
    # Adjacent slots, chunks of 1 to 16 tokens (one forward path): one forward of 4 rows, or one per row.
    assert counting.prefills == ([4] if batch_prefill else [1, 1, 1, 1])


def test_a_failing_batched_prefill_fails_only_the_prompt_that_causes_it(engine, reference):
    used = {t for i in range(3) for t in PROMPTS[i] + reference["draft"][i]}
    poison = next(t for t in range(2, engine.target.args.vocab_size) if t not in used)
    be = engine.with_config(max_batch=4)
    be.rows.target = counting = CountingTarget(be.rows.target, poison)
    handles = [be.submit(PROMPTS[i], PARAMS[i], SPECS["draft"]) for i in range(3)]
    bad = be.submit([5, poison, 6], SamplingParams(max_tokens=20, ignore_eos=True), SPECS["draft"])
    with pytest.raises(RuntimeError, match="injected prefill fault"):
        bad.result()
    assert counting.raised == 2  # the batched forward, then the prompt alone
    assert [h.result().token_ids for h in handles] == reference["draft"][:3]
    assert be.failed is None and be.num_running == 0 and be.kv_used_tokens == 0


def test_prefill_batches_join_adjacent_rows_on_one_forward_path():
    from types import SimpleNamespace

    from verispec.engine.slots import Chunk, prefill_batches

    def chunk(slot: int, start: int, n: int) -> Chunk:
        return Chunk(SimpleNamespace(slot=slot, prompt=list(range(start + n))), start, n)

    a, b, c, d = chunk(0, 0, 10), chunk(1, 0, 20), chunk(3, 0, 12), chunk(4, 0, 100)
    groups = prefill_batches([d, c, b, a], max_len=512)
    assert [[x.req.slot for x in g] for g in groups] == [[0, 1], [3], [4]]  # slot 2 not prefilling; 100 > SMALL_M
    assert [[x.req.slot for x in g] for g in prefill_batches([a, b], 512, batch=False)] == [[0], [1]]
    # On the kernels, a shared forward holds at most SHARED_TOKENS padded tokens.
    wide = [chunk(slot, 0, 60) for slot in range(9)]  # 60 tokens: below the large-M threshold on any CPU
    assert [len(g) for g in prefill_batches(wide, 4096)] == [8, 1]
    # A row padded to its group's widest chunk must stay inside its cache row.
    late = chunk(1, 500, 5)
    assert [[x.req.slot for x in g] for g in prefill_batches([chunk(0, 0, 20), late], 512)] == [[0], [1]]


def test_arrivals_and_cancellations_mid_flight(engine, reference):
    spec = SPECS["draft"]
    be = engine.with_config(max_batch=4)
    baseline = (be.free_slots, be.kv_used_tokens)
    a = be.submit(PROMPTS[7], PARAMS[7], spec)
    b = be.submit(PROMPTS[5], PARAMS[5], spec)
    for _ in range(3):
        be.step()
    c = be.submit(PROMPTS[3], PARAMS[3], spec)  # arrives mid-flight
    be.step()
    used = be.kv_used_tokens
    assert be.num_running == 3 and not b.done
    assert b.cancel() and b.done and b.finish_reason == "cancelled"
    # Freed at once: slot and reserved tokens.
    assert be.num_running == 2 and be.free_slots == 2
    assert be.kv_used_tokens == used - (len(PROMPTS[5]) + PARAMS[5].max_tokens)
    partial = b.result().token_ids
    assert 0 < len(partial) < len(reference["draft"][5]) and partial == reference["draft"][5][:len(partial)]
    d = be.submit(PROMPTS[1], PARAMS[1], spec)  # takes the freed slot
    be.step()
    assert not b.cancel()  # already finished
    be.run_until_done()
    assert a.result().token_ids == reference["draft"][7]
    assert c.result().token_ids == reference["draft"][3]
    assert d.result().token_ids == reference["draft"][1]
    assert (be.free_slots, be.kv_used_tokens, be.num_running) == baseline + (0,)


def test_cancel_waiting_and_from_callback(engine, reference):
    be = engine.with_config(max_batch=1)
    seen: list[list[int]] = []

    def stop_after_two(tokens: list[int]) -> bool:
        seen.append(tokens)
        return len(seen) < 2

    first = be.submit(PROMPTS[3], PARAMS[3], SPECS["ngram"], on_tokens=stop_after_two)
    waiting = be.submit(PROMPTS[2], PARAMS[2])
    last = be.submit(PROMPTS[4], PARAMS[4])
    assert be.num_waiting == 3  # admission happens in step()
    assert waiting.cancel() and be.num_waiting == 2
    assert waiting.result().token_ids == [] and waiting.finish_reason == "cancelled"
    be.run_until_done()
    assert first.finish_reason == "cancelled" and first.result().token_ids == sum(seen, [])
    assert last.result().token_ids == reference["plain"][4]
    assert be.free_slots == 1 and be.kv_used_tokens == 0


@pytest.mark.parametrize("spec", [SPECS["plain"], SPECS["draft"], SPECS["ngram"]], ids=["plain", "draft", "ngram"])
def test_seeded_sampling_ignores_companions(engine, spec):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = PROMPTS[3]
    alone = engine.generate(prompt, params, spec)[0].token_ids

    be = engine.with_config(max_batch=8)
    solo = be.generate([prompt], params, spec)[0].token_ids
    others = [replace(params, seed=s) for s in (1, 2, 3)] + [SamplingParams(max_tokens=30)] * 2
    crowd = be.generate(PROMPTS[:5] + [prompt], others + [params], spec)[-1].token_ids
    mixed = be.generate([PROMPTS[1], prompt, PROMPTS[7], PROMPTS[0]], [others[0], params, others[3], others[1]],
                              [SPECS["draft"], spec, SPECS["ngram"], SPECS["plain"]])[1].token_ids
    assert solo == crowd == mixed == alone


def test_seeded_sampling_with_arrivals(engine):
    spec = SPECS["draft"]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    be = engine.with_config(max_batch=4)
    h = be.submit(PROMPTS[1], params, spec)
    be.step()
    be.submit(PROMPTS[2], replace(params, seed=5), spec)
    be.step()
    be.submit(PROMPTS[4], SamplingParams(max_tokens=5), spec).cancel()
    be.run_until_done()
    assert h.result().token_ids == engine.generate(PROMPTS[1], params, spec)[0].token_ids


def test_oversize_request_fails_at_submit(engine):
    be = engine.with_config(max_batch=2)
    # max_tokens past the context: the request reserves its slot and ends there, as alone.
    long = be.submit(PROMPTS[7], SamplingParams(max_tokens=MAX_LEN, ignore_eos=True))
    assert long.result().finish_reason == "length"
    assert len(long.result().token_ids) == MAX_LEN - len(PROMPTS[7])
    with pytest.raises(VerispecError, match="prompt has"):
        be.submit([2 + i % 90 for i in range(MAX_LEN)], SamplingParams(max_tokens=1))
    small = engine.with_config(max_batch=2, kv_budget_tokens=40)
    with pytest.raises(VerispecError, match="KV budget holds 40"):
        small.submit(PROMPTS[7], SamplingParams(max_tokens=30))
    with pytest.raises(VerispecError):  # one bad prompt: nothing is queued
        be.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(), SamplingParams(stop=("x",))])
    assert be.num_waiting == 0 and be.kv_used_tokens == 0


def test_memory_limit_sets_slots(engine):
    one = engine.with_config(max_batch=8)
    per_slot = (one.cache.nbytes() + one.draft_runner.cache.nbytes()) // one.slots
    assert engine.with_config(max_batch=8, memory_limit=3 * per_slot + 1).slots == 3
    with pytest.raises(VerispecError, match="memory_limit"):
        engine.with_config(max_batch=8, memory_limit=per_slot // 2)


def test_kv_budget_admits_fifo(engine, reference):
    # Budget for about two requests at a time: the rest wait, in order, and still match.
    be = engine.with_config(max_batch=8, kv_budget_tokens=70)
    results = be.generate(PROMPTS[:6], PARAMS[:6], SPECS["ngram"])
    assert [r.token_ids for r in results] == reference["ngram"][:6]
    assert max(be.stats.rows_steps) <= 3


def test_scheduler_is_fifo_without_overtaking():
    s: Scheduler[str] = Scheduler(slots=3, budget=100, max_len=100)
    for name, tokens in (("a", 60), ("b", 60), ("c", 10)):
        s.submit(name, tokens)
    assert [a.item for a in s.admit()] == ["a"]  # c fits but must not overtake b
    s.release(0)
    assert [(a.item, a.slot) for a in s.admit()] == [("b", 0), ("c", 1)]
    assert s.used_tokens == 70 and s.free_slots == 1
    with pytest.raises(VerispecError):
        s.check(101)


# -- the concurrency-aware policy ------------------------------------------------------------

def test_policy_picks_k0_in_the_engine_when_compute_bound(engine, reference):
    spec = SPECS["draft-cost"]
    be = engine.with_config(max_batch=8, costs=CostModel(CostCurve({1: 1e-3, 100: 0.1})))
    results = be.generate(PROMPTS, PARAMS, spec)
    assert [r.token_ids for r in results] == reference["draft-cost"]
    assert set(be.stats.policy_k) == {0}
    assert all(set(r.metrics.k_chosen) == {0} for r in results)

    flat = CostModel(CostCurve({1: 1e-2, 1024: 1e-2}), CostCurve({1: 1e-4}))
    be = engine.with_config(max_batch=8, costs=flat)
    results = be.generate(PROMPTS, PARAMS, spec)
    assert [r.token_ids for r in results] == reference["draft-cost"]
    assert max(be.stats.policy_k) == spec.k  # memory-bound: speculate as far as allowed
    assert be.stats.summary()["policy_k"] == be.stats.policy_k



def test_lookup_rows_draft_only_where_their_width_pays(qwen2_tiny, reference):
    # Hybrid without a draft model: every drafting step is a free lookup, none is governed. The cost
    # policy still weighs each lookup's width: never on a linear curve, freely on a flat one.
    lookups = make_engine(qwen2_tiny)
    spec = SpecConfig(method="hybrid", k=4, k_policy="cost")
    linear = CostModel(CostCurve({1: 1e-3, 100: 0.1}))
    flat = CostModel(CostCurve({1: 1e-2, 1024: 1e-2}))
    for costs, widens in ((linear, False), (flat, True)):
        be = lookups.with_config(max_batch=8, costs=costs)
        results = be.generate(PROMPTS, PARAMS, spec)
        assert [r.token_ids for r in results] == reference["plain"]
        assert (max(be.stats.width_steps) > 1) == widens, be.stats.width_steps
        assert be.stats.policy_k == {}  # nothing governed: no policy k recorded

def test_profiled_costs_are_monotone(engine):
    be = engine.with_config(max_batch=4)
    costs = be.profile(k_max=3, context=32)
    # One curve per profiled row count, each over that many rows' scored tokens.
    assert set(costs.target.curves) == {1, 2, 4}
    assert set(costs.target.curves[4].points) == {4, 8, 12, 16}
    assert costs.draft is not None
    for rows in (1, 3, 4):
        values = [costs.target_s(t, rows=rows) for t in range(1, 40)]
        assert values == sorted(values) and values[0] > 0


# -- API: streaming, text and stop strings -----------------------------

def test_streaming_drives_the_steps(engine, reference):
    be = engine.with_config(max_batch=4)
    h = be.submit(PROMPTS[5], PARAMS[5], SPECS["draft"])
    others = [be.submit(p, pa, SPECS["ngram"]) for p, pa in zip(PROMPTS[:3], PARAMS[:3], strict=True)]
    chunks = list(h)  # the engine starts no thread: iterating steps it, every running request with it
    assert sum(chunks, []) == reference["draft"][5] and len(chunks) > 1
    assert [x.result().token_ids for x in others] == reference["ngram"][:3]
    assert be.free_slots == 4 and be.kv_used_tokens == 0 and not be.has_work


def test_text_and_stop_strings_match_engine(tmp_path):
    folder = build_tok_model(tmp_path / "tok")
    engine = Engine.from_pretrained(str(folder), dtype="float32", max_len=MAX_LEN, progress=False)
    prompts = ["write a story about the cat", "what is the dog ?", "hello world"]
    plain = engine.generate(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True), chat=True)[0]
    stop = plain.text.split()[4]  # a word the greedy output is known to contain
    params = SamplingParams(max_tokens=12, stop=(stop,))
    ref = engine.generate(prompts, params, SpecConfig(k_policy="fixed", method="ngram", k=3), chat=True)
    got = engine.with_config(max_batch=2).generate(prompts, params, SpecConfig(k_policy="fixed",
                                                                                      method="ngram", k=3),
                                                           chat=True)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == \
        [(r.token_ids, r.text, r.finish_reason) for r in ref]


class NgramCopy(Drafter):
    """An n-gram drafter that records the slot it drafts in and how many rows were running then."""

    name = "ngram-copy"

    def __init__(self, engine: Engine, log: list[tuple[int, int]]) -> None:
        from verispec.drafters.ngram import NgramDrafter

        self.inner, self.engine, self.log, self.slot = NgramDrafter(3, 1), engine, log, -1

    def use_row(self, slot: int) -> None:
        self.slot = slot

    def propose(self, seq: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        self.log.append((self.slot, self.engine.num_running))
        return self.inner.propose(seq, k, params, generator)


def test_a_drafter_factory_runs_its_prompts_batched(engine, reference):
    be = engine.with_config(max_batch=4)
    log: list[tuple[int, int]] = []
    built: list[NgramCopy] = []

    def factory() -> NgramCopy:
        built.append(NgramCopy(be, log))
        return built[-1]

    results = be.generate(PROMPTS[:4], PARAMS[:4], SPECS["ngram"], drafter=factory)
    assert [r.token_ids for r in results] == reference["ngram"][:4]
    assert len(built) == 4 and len({d.slot for d in built}) == 4  # one drafter per request, each in its own row
    assert max(running for _, running in log) == 4  # they drafted side by side
    # One Drafter instance keeps one sequence's state: its prompts run one at a time.
    log.clear()
    results = be.generate(PROMPTS[:4], PARAMS[:4], SPECS["ngram"], drafter=NgramCopy(be, log))
    assert [r.token_ids for r in results] == reference["ngram"][:4] and max(r for _, r in log) == 1


def test_a_bad_custom_drafter_is_refused_before_any_work(engine):
    be = engine.with_config(max_batch=2)
    with pytest.raises(VerispecError, match="drafter must be a Drafter or a callable"):
        be.generate(PROMPTS[:2], PARAMS[:2], SPECS["ngram"], drafter="ngram")
    with pytest.raises(VerispecError, match="built str, not a Drafter"):
        be.generate(PROMPTS[:2], PARAMS[:2], SPECS["ngram"], drafter=lambda: "ngram")
    assert be.num_running == 0 and be.num_waiting == 0 and be.kv_used_tokens == 0


# -- faults stay with the request that causes them ------------------------------------------------


def _learned(be: Engine) -> tuple:
    """The objects the engine learned into: the cost model and the policy."""
    return be.costs, be.policy


def test_a_failing_drafter_fails_only_its_request(engine, reference):
    be = engine.with_config(max_batch=4)
    runs = [(0, "plain"), (1, "draft"), (3, "draft-cost")]
    handles = [be.submit(PROMPTS[i], PARAMS[i], SPECS[name]) for i, name in runs]
    bad = be.submit(PROMPTS[2], SamplingParams(max_tokens=40, ignore_eos=True), SPECS["ngram"],
                    drafter=FailingDrafter(after=3))
    be.step()  # the first step profiles the cost policy (rows "draft-cost" follow it)
    learned = _learned(be)
    assert learned[0] is not None and learned[1] is not None
    with pytest.raises(RuntimeError, match="injected drafter fault"):
        bad.result()
    assert sum(not h.done for h in handles) >= 2  # others were still running when it failed
    assert [h.result().token_ids for h in handles] == [reference[name][i] for i, name in runs]
    assert be.failed is None and be.stats.rows_steps.get(4, 0) >= 3
    after = _learned(be)
    assert after[0] is learned[0] and after[1] is learned[1]
    for seen_before, seen_after in zip(learned[2:], after[2:], strict=True):
        assert all(seen_after[key] is value for key, value in seen_before.items())
    # The slot it held serves new requests as before.
    again = be.generate([PROMPTS[2]], PARAMS[2], SPECS["ngram"])
    assert again[0].token_ids == reference["ngram"][2]
    assert be.num_running == 0 and be.kv_used_tokens == 0


class PoisonedTarget:
    """The target, except that a decode or verification forward raises when a row's last token is ``poison``."""

    def __init__(self, target, poison: int) -> None:
        self.target, self.poison, self.raised = target, poison, 0

    def __call__(self, tokens, positions, cache, **kwargs):
        if not kwargs.get("last_only") and bool((tokens[:, 0] == self.poison).any()):
            self.raised += 1
            raise RuntimeError("injected forward fault")
        return self.target(tokens, positions, cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_a_failing_shared_forward_fails_only_the_row_that_causes_it(engine, reference):
    runs = [(0, "plain"), (1, "draft"), (4, "ngram")]
    used = {t for i, name in runs for t in PROMPTS[i] + reference[name][i]}
    poison = next(t for t in range(2, engine.target.args.vocab_size) if t not in used)
    be = engine.with_config(max_batch=4)
    be.target = PoisonedTarget(be.target, poison)  # the row with the poisoned token breaks the batched forward
    handles = [be.submit(PROMPTS[i], PARAMS[i], SPECS[name]) for i, name in runs]
    bad = be.submit([5, 6, poison], SamplingParams(max_tokens=20, ignore_eos=True), SPECS["draft"])
    with pytest.raises(RuntimeError, match="injected forward fault"):
        bad.result()
    assert be.target.raised == 2  # the batched forward, then the row alone
    assert [h.result().token_ids for h in handles] == [reference[name][i] for i, name in runs]
    assert be.failed is None and be.num_running == 0 and be.kv_used_tokens == 0


def test_a_request_whose_callback_raises_fails_alone(engine, reference):
    be = engine.with_config(max_batch=2)

    def broken(tokens):
        raise ValueError("the client's callback broke")

    bad = be.submit(PROMPTS[1], PARAMS[1], SPECS["draft"], on_tokens=broken)
    good = be.submit(PROMPTS[3], PARAMS[3], SPECS["draft"])
    with pytest.raises(ValueError, match="callback broke"):
        bad.result()
    assert good.result().token_ids == reference["draft"][3]


# -- wide steps and the cost policy's profile -----------------------------------------------------


def test_a_65_wide_forward_matches_one_token_at_a_time(engine):
    # k = 64 verifies 65 tokens per row at once: past SMALL_M, through whatever attention this CPU runs.
    target = engine.target
    rows = [[(7 * i + 3 + r) % target.args.vocab_size for i in range(70)] for r in range(2)]
    tokens = torch.tensor(rows)
    wide_cache, step_cache = target.new_cache(2, 80), target.new_cache(2, 80)
    pos = torch.arange(70).expand(2, -1)
    target(tokens[:, :5], pos[:, :5], wide_cache)
    wide = target(tokens[:, 5:], pos[:, 5:], wide_cache)
    assert wide.shape[:2] == (2, 65)
    one = torch.stack([target(tokens[:, i:i + 1], pos[:, i:i + 1], step_cache)[:, 0] for i in range(70)], dim=1)
    torch.testing.assert_close(wide, one[:, 5:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shape"):  # 64 tokens at 65 positions: refused, not misread
        target(tokens[:, 5:69], pos[:, 5:], wide_cache)


def test_k_64_matches_plain_in_both_engines(engine):
    spec = SpecConfig(method="draft", k=64, k_policy="fixed")
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    plain = [engine.generate(p, params)[0].token_ids for p in PROMPTS[:2]]
    assert [engine.generate(p, params, spec)[0].token_ids for p in PROMPTS[:2]] == plain
    be = engine.with_config(max_batch=2)
    assert [r.token_ids for r in be.generate(PROMPTS[:2], params, spec)] == plain
    assert max(be.stats.width_steps) == 65


def test_the_cost_policy_is_profiled_once_never_for_a_request_s_k(engine, monkeypatch):
    from verispec.engine.costs import PROFILE_K

    profiled = []
    original = Engine.profile

    def spy(self, k_max=PROFILE_K, context=64):
        profiled.append(k_max)
        return original(self, k_max, context)

    monkeypatch.setattr(Engine, "profile", spy)
    for slots in (1, 2):
        profiled.clear()
        be = engine.with_config(max_batch=slots)
        be.costs = be.policy = None  # a fresh engine: profiled on first use of the cost policy
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        plain = [engine.generate(p, params)[0].token_ids for p in PROMPTS[:2]]
        for k in (3, 40):  # k = 40: priced by extending the curves, not profiled again
            out = be.generate(PROMPTS[:2], params, SpecConfig(method="draft", k=k, k_policy="cost"))
            assert [r.token_ids for r in out] == plain
        assert profiled == [PROFILE_K]  # the engine's own width: a k = 40 request did not size it
        assert be.costs.target_s(2 * 41, rows=2) >= be.costs.target_s(2 * (PROFILE_K + 1), rows=2)
    # One row is also timed at the wide widths a prediction drafts; more rows only up to k_max + 1 each.
    from verispec.engine.costs import PROFILE_WIDE

    costs = be.profile(k_max=3, context=16)
    assert sorted(costs.target.curves[1].points) == [1, 2, 3, 4, *PROFILE_WIDE]
    assert sorted(costs.target.curves[2].points) == [2, 4, 6, 8]
    # Profiling past the context it runs at (widths above 64 at a 16-token context) is fine too.
    assert len(be.profile(k_max=70, context=16).target.curves[1].points) == 71
