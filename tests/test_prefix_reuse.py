"""Prefix reuse: a request starting with what a slot's cache holds prefills only the rest, and gets
exactly what it would get from an empty cache.

Each test checks three things: the positions reused (stats and per-request metrics), that the
reused row holds the K/V a fresh prefill would write there, and that outputs equal a fresh engine's
(greedy and seeded sampling, plain and speculative). A reuse count one too high leaves stale K/V in
the row and fails the K/V check; one too low shows in the counts.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import torch
from tiny_server import make_tiny_pair, metric_value, running_server

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig
from verispec.engine.prefix import MIN_MATCH, SlotPrefixes, common_prefix, held_tokens, reusable
from verispec.engine.scheduler import Scheduler
from verispec.server import ServerConfig, create_app

EOS_IDS = {1, 26}
MAX_LEN = 256
PLAIN = SpecConfig(method="none", k=0)
DRAFT = SpecConfig(k_policy="fixed", method="draft", k=4)
SPECS = {
    "plain": PLAIN,
    "draft": DRAFT,
    "hybrid": SpecConfig(k_policy="fixed", method="hybrid", k=3),
    "draft-cost": SpecConfig(method="draft", k=6, k_policy="cost"),
    "draft-window-vocab": SpecConfig(k_policy="fixed", method="draft", k=4, draft_window=16, draft_vocab=48),
}
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
TURN = [1, 5, 6, 7, 8, 9]  # an end-of-turn token, then the next user turn


def prompt(n: int, seed: int) -> list[int]:
    """``n`` pseudo-random token ids (no EOS ids: 2..95 less 26)."""
    rng = random.Random(seed)
    return [rng.choice([t for t in range(2, 96) if t not in EOS_IDS]) for _ in range(n)]


def other_first(ids: list[int]) -> list[int]:
    """``ids`` with another first token."""
    return [3 if ids[0] == 2 else 2] + ids[1:]


@pytest.fixture(scope="module")
def engine(qwen2_tiny, qwen2_noisy_draft_tiny) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=MAX_LEN, progress=False)
    return Engine(cfg, qwen2_tiny.model, None, EOS_IDS, draft=qwen2_noisy_draft_tiny.model)


def alone(engine: Engine, ids: list[int], params: SamplingParams = GREEDY, spec: SpecConfig = PLAIN) -> list[int]:
    """What a one-slot engine over the same models generates from an empty cache."""
    return engine.with_config(max_batch=1, prefix_reuse=False).generate(ids, params, spec)[0].token_ids


def follow_up(first: list[int], answer: list[int], finish: str) -> tuple[list[int], int]:
    """The next turn's prompt and how many of its positions a row holding that request keeps: all of
    prompt + answer, less the answer's last token when it stopped at max_tokens (that one was never fed)."""
    return first + answer + TURN, len(first) + len(answer) - (finish == "length")


def assert_row_is_fresh(be: Engine, slot: int, ids: list[int], engine: Engine, draft: bool = False) -> None:
    """The target row (and draft row) of ``slot`` hold, for ``ids[:-1]``, the K/V of a fresh prefill."""
    fresh = engine.with_config(max_batch=1, prefix_reuse=False)
    fresh.submit(ids, SamplingParams(max_tokens=8), DRAFT if draft else PLAIN)
    fresh.step()  # admits, prefills (the draft reads its prompt in the first propose)
    n = len(ids) - 1
    pairs = [(be.cache, fresh.cache)]
    if draft:
        pairs.append((be.draft_runner.cache, fresh.draft_runner.cache))
    for mine, ref in pairs:
        for a, b in zip(mine.k + mine.v, ref.k + ref.v, strict=True):
            torch.testing.assert_close(a[slot, :, :n], b[0, :, :n], atol=1e-5, rtol=1e-5)


def test_common_prefix_and_what_a_row_holds():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(300))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(200))]
        naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == naive
    assert reusable([4, 5, 6, 7], [4, 5, 6, 7]) == 3  # the last prompt token is the first step's input
    assert reusable([4, 5, 6, 7], [4, 5]) == 1 and reusable([4, 5], [9, 5, 6]) == 0 and reusable([], [4]) == 0
    # A step cut by a stop condition: the row holds K/V past the sequence, of tokens never appended.
    assert held_tokens([4, 5, 6], 5) == [4, 5, 6] and held_tokens([4, 5, 6], 2) == [4, 5]


def test_slot_choice_longest_match_then_empty_then_least_recently_used():
    system = list(range(10))
    p = SlotPrefixes()
    p.record(0, system + [50] * 200)  # another conversation behind a shared system prompt
    p.record(1, [])  # released, holds nothing
    assert p.choose(system + [60, 61], [0, 1, 2]) == 1  # a 10-token match does not evict 200 tokens
    assert p.choose(system + [60, 61], [0]) == 0  # but is taken when nothing else is free
    p.record(2, [7] * 100)
    p.record(3, [8] * 100)
    assert p.choose([9, 9], [0, 2, 3]) == 0  # no match, nothing empty: the least recently released
    # Saving 39 tokens where 61 are overwritten, below MIN_MATCH: as no match (LRU, or an empty slot).
    assert p.choose([8] * 40, [0, 2, 3]) == 0 and p.choose([8] * 40, [1, 2, 3]) == 1
    assert p.choose([8] * (MIN_MATCH + 1), [1, 2, 3]) == 3  # a long match wins over an empty slot
    p.record(1, [8] * 60)
    assert p.choose([8] * 40, [1, 2, 3]) == 1  # saves 39, overwrites 21: a match
    assert p.choose([8] * 51, [1, 2, 3]) == 3  # saves 50 in both: the least recently released
    assert p.claim(3, [8] * 20) == 19 and p.held(3) == []  # claimed: the row belongs to the request now


def test_scheduler_asks_where_to_put_a_request_and_cached_tokens_reserve_nothing():
    s: Scheduler[str] = Scheduler(slots=3, budget=100, max_len=100, choose=lambda item, free: free[-1])
    s.submit("a", 60)
    s.submit("b", 40)
    assert [(a.item, a.slot) for a in s.admit()] == [("a", 2), ("b", 1)]
    s.release(2)
    assert s.free_slots == 2 and s.used_tokens == 40


@pytest.mark.parametrize("spec", ["plain", "draft"])
def test_the_same_prompt_twice_prefills_nothing_the_second_time(engine, spec):
    p = prompt(40, seed=1)
    be = engine.with_config(max_batch=2)
    first = be.generate([p], GREEDY, SPECS[spec])[0]
    assert first.metrics.prefix_reused_tokens == 0 and be.stats.prefill_tokens == len(p) - 1
    catch_up = be.stats.catch_up_tokens
    h = be.submit(p, GREEDY, SPECS[spec])
    be.step()
    # Nothing prefilled: the first step scored the one last prompt token (with the drafts).
    assert be.stats.prefill_tokens == len(p) - 1
    assert be.stats.prefix_reused_tokens == len(p) - 1 and be.stats.prefix_hits == 1
    assert_row_is_fresh(be, 0, p, engine, draft=spec == "draft")
    second = h.result()
    assert second.metrics.prefix_reused_tokens == len(p) - 1
    assert second.token_ids == first.token_ids == alone(engine, p, GREEDY, SPECS[spec])
    if spec == "draft":  # the draft model did not read the prompt again either
        assert be.stats.prefix_draft_reused_tokens == len(p) - 1 and be.stats.catch_up_tokens == catch_up
    assert be.free_slots == 2 and be.kv_used_tokens == 0  # a slot holding a prefix is free
    summary = be.stats.summary()
    assert summary["prefix_hits"] == 1 and summary["prefix_reused_tokens"] == len(p) - 1
    assert summary["requests"]["prefix_reused_tokens"] == len(p) - 1

    off = engine.with_config(max_batch=2, prefix_reuse=False)
    assert [off.generate([p], GREEDY, SPECS[spec])[0].token_ids for _ in range(2)] == [first.token_ids] * 2
    assert off.stats.prefill_tokens == 2 * (len(p) - 1) and off.stats.prefix_reused_tokens == 0


@pytest.mark.parametrize("spec", ["plain", "draft"])
def test_a_follow_up_turn_reuses_the_conversation_so_far(engine, spec):
    a = prompt(30, seed=2)
    be = engine.with_config(max_batch=2)
    first = be.generate([a], SamplingParams(max_tokens=24, ignore_eos=True), SPECS[spec])[0]
    b, kept = follow_up(a, first.token_ids, first.finish_reason)
    h = be.submit(b, GREEDY, SPECS[spec])
    be.step()
    assert be.stats.prefix_reused_tokens == kept and be.stats.prefill_tokens == len(a) - 1 + len(b) - 1 - kept
    # The answer's K/V came from decode steps, a fresh row's from one prefill: equal up to rounding.
    assert_row_is_fresh(be, 0, b, engine)
    assert h.result().token_ids == alone(engine, b, GREEDY, SPECS[spec])
    assert h.result().metrics.prefix_reused_tokens == kept
    # Two finish reasons: an answer cut at max_tokens and one that stopped at an EOS.
    stopped = be.generate([b], SamplingParams(max_tokens=100), SPECS[spec])[0]
    c, kept = follow_up(b, stopped.token_ids, stopped.finish_reason)
    assert {first.finish_reason, stopped.finish_reason} == {"length", "stop"}
    third = be.generate([c], GREEDY, SPECS[spec])[0]
    assert third.metrics.prefix_reused_tokens == kept and third.token_ids == alone(engine, c, GREEDY, SPECS[spec])


def conversation(be: Engine, spec: SpecConfig, params: SamplingParams) -> list[list[int]]:
    """A mix of repeats, follow-ups, shorter and diverging prompts, one at a time and several at once."""
    a, x = prompt(40, seed=3), prompt(25, seed=4)
    out = [r.token_ids for r in be.generate([a, x], params, spec)]
    b = a + out[0] + TURN
    out += [r.token_ids for r in be.generate([b, a, x[:9]], params, spec)]
    out += [r.token_ids for r in be.generate([b + out[2] + TURN, other_first(x)], params, spec)]
    out.append(be.generate([a[:20] + x], params, spec)[0].token_ids)
    return out


@pytest.mark.parametrize("spec", list(SPECS))
def test_outputs_are_the_same_with_and_without_reuse(engine, spec):
    on = engine.with_config(max_batch=2)
    outputs = conversation(on, SPECS[spec], GREEDY)
    assert outputs == conversation(engine.with_config(max_batch=2, prefix_reuse=False), SPECS[spec], GREEDY)
    assert on.stats.prefix_hits >= 4
    if SPECS[spec].method == "draft" and SPECS[spec].k_policy == "fixed":  # (the cost policy may never draft)
        assert on.stats.prefix_draft_reused_tokens > 0


@pytest.mark.parametrize("spec", ["plain", "draft", "hybrid"])
def test_seeded_sampling_draws_the_same_tokens_with_and_without_reuse(engine, spec):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    on = engine.with_config(max_batch=2)
    outputs = conversation(on, SPECS[spec], params)
    assert outputs == conversation(engine.with_config(max_batch=2, prefix_reuse=False), SPECS[spec], params)
    assert on.stats.prefix_hits >= 4


def test_a_cached_prefix_longer_than_the_prompt_or_diverging(engine):
    p = prompt(40, seed=5)
    be = engine.with_config(max_batch=1)
    be.generate([p], GREEDY, DRAFT)
    cases = [(p[:10], 9),  # the row holds more than the prompt: keep all but its last token
             (other_first(p), 0),  # diverges at the first token
             (other_first(p)[:20] + [3, 4], 20),  # diverges after 20 tokens (of the request before)
             (p[:1], 0)]  # a one-token prompt has nothing to prefill
    for ids, kept in cases:
        before = be.stats.prefill_tokens
        h = be.submit(ids, GREEDY, DRAFT)
        be.step()
        assert be.stats.prefill_tokens - before == len(ids) - 1 - kept
        assert_row_is_fresh(be, 0, ids, engine, draft=True)
        assert h.result().token_ids == alone(engine, ids, GREEDY, DRAFT)
        assert h.result().metrics.prefix_reused_tokens == kept


def test_a_request_goes_to_the_slot_holding_its_prefix(engine):
    x, y, z = (prompt(MIN_MATCH + 6, seed=s) for s in (6, 7, 8))
    be = engine.with_config(max_batch=3)
    first = be.generate([x, y, z], SamplingParams(max_tokens=8))
    turns = [follow_up(ids, r.token_ids, r.finish_reason) for ids, r in zip((x, y, z), first, strict=True)]
    # One at a time, then two admitted in the same step: each finds its own conversation.
    (yb, y_kept), (zb, z_kept), (xb, x_kept) = turns[1], turns[2], turns[0]
    ry = be.generate([yb], GREEDY)[0]
    rz, rx = be.generate([zb, xb], GREEDY)
    assert [r.metrics.prefix_reused_tokens for r in (ry, rz, rx)] == [y_kept, z_kept, x_kept]
    assert [r.token_ids for r in (ry, rz, rx)] == [alone(engine, ids) for ids in (yb, zb, xb)]
    # A request sharing nothing takes the least recently used slot: the one y's turn left first.
    fresh = be.submit(prompt(20, seed=9), GREEDY)
    be.step()
    assert be._running and next(iter(be._running)) == 1 and not fresh.done
    be.run_until_done()
    # z's follow-up still finds z's conversation (with its answer) where it was.
    rz2 = be.generate([zb + rz.token_ids + TURN], GREEDY)[0]
    assert rz2.metrics.prefix_reused_tokens == len(zb) + len(rz.token_ids) - 1


def test_the_single_request_engine_reuses_its_row(engine):
    a = prompt(30, seed=10)
    assert engine.slots == 1 and engine.prefix_reuse
    first = engine.generate(a, GREEDY, DRAFT)[0]
    again = engine.generate(a, GREEDY, DRAFT)[0]
    assert again.metrics.prefix_reused_tokens == len(a) - 1 and again.token_ids == first.token_ids
    b, kept = follow_up(a, first.token_ids, first.finish_reason)
    # An engine over the same models has caches of its own: this engine's row is left as it was.
    expected = alone(engine, b, GREEDY, SPECS["hybrid"])
    assert engine.generate(a, GREEDY, DRAFT)[0].metrics.prefix_reused_tokens == len(a) - 1
    second = engine.generate(b, GREEDY, SPECS["hybrid"])[0]
    assert second.metrics.prefix_reused_tokens == kept and second.token_ids == expected
    assert engine.generate(b, GREEDY)[0].metrics.prefix_reused_tokens == len(b) - 1
    # Profiling the cost policy times forwards on caches of its own: the row is kept through it.
    assert engine.generate(b, GREEDY, SPECS["draft-cost"])[0].metrics.prefix_reused_tokens == len(b) - 1
    engine.profile(4)
    assert engine.generate(b, GREEDY)[0].metrics.prefix_reused_tokens == len(b) - 1
    assert engine.with_config(prefix_reuse=False).generate(b, GREEDY)[0].metrics.prefix_reused_tokens == 0


def test_the_single_request_engine_with_layer_skip(engine):
    spec = SpecConfig(k_policy="fixed", method="layerskip", k=3, layers=1)
    a = prompt(30, seed=11)
    first = engine.generate(a, GREEDY, spec)[0]
    b, kept = follow_up(a, first.token_ids, first.finish_reason)
    expected = alone(engine, b, GREEDY, spec)
    engine.generate(a, GREEDY, spec)
    second = engine.generate(b, GREEDY, spec)[0]
    assert second.metrics.prefix_reused_tokens == kept and second.token_ids == expected


@pytest.fixture(scope="module")
def text_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("prefix_server_models"))
    return Engine.from_pretrained(str(target), draft=str(draft), dtype="float32", max_len=MAX_LEN, progress=False)


@pytest.mark.parametrize(("max_batch", "reuse"), [(2, True), (1, True), (2, False)])
def test_the_server_counts_reused_prompt_tokens(text_engine: Engine, max_batch: int, reuse: bool) -> None:
    config = ServerConfig(model_name="tiny", spec=DRAFT, max_batch=max_batch, prefix_reuse=reuse)
    app = create_app(text_engine, config)
    body = {"model": "tiny", "prompt": "a prompt that the second request repeats", "max_tokens": 6,
            "temperature": 0, "speculative": {"enabled": True, "method": "draft"}}
    with running_server(app, config) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        texts = []
        for _ in range(2):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        reused = metric_value(client, "verispec:prefix_reused_tokens_total", path="speculative", method="draft")
        stats: dict[str, Any] = client.get("/stats").json()
    assert texts[0] == texts[1]
    prompt_len = len(text_engine.encode(body["prompt"]))
    assert reused == (prompt_len - 1 if reuse else 0)
    assert stats["paths"]["speculative"]["total"]["prefix_reused_tokens"] == reused
    batch = stats["batch"]  # one engine worker for every max_batch
    assert batch["max_batch"] == max_batch
    assert batch["prefix_reuse"] is reuse and batch["prefix_reused_tokens"] == reused
    assert batch["prefix_hits"] == int(reuse) and batch["prefill_tokens"] == 2 * (prompt_len - 1) - reused


def test_serve_has_a_switch_to_turn_reuse_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import verispec.server
    from verispec.cli import build_parser

    seen: list[ServerConfig] = []
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(verispec.server, "serve", lambda engine, config, **k: seen.append(config) or False)
    for flags, reuse in (([], True), (["--no-prefix-reuse"], False)):
        args = build_parser().parse_args(["serve", "--model", "m", *flags])
        assert args.func(args) == 0 and seen[-1].prefix_reuse is reuse


@pytest.mark.parametrize("name", ["plain", "draft"])
def test_rows_running_together_share_a_prompt_prefill(engine: Engine, name: str) -> None:
    # n choices of one request, and prompts that share a system prompt, prefill their common prefix once.
    spec = SPECS[name]
    system = prompt(60, 11)
    prompts = [system + prompt(5, 12), system + prompt(5, 12), system + prompt(7, 13)]
    be = engine.with_config(max_batch=4, prefix_reuse=True)
    before = be.stats.prefill_tokens
    results = be.generate(prompts, GREEDY, spec)
    assert be.stats.prefill_tokens - before == (len(prompts[0]) - 1) + (len(prompts[2]) - 1 - len(system))
    assert [r.metrics.prefix_reused_tokens for r in results] == [0, len(prompts[1]) - 1, len(system)]
    for ids, r in zip(prompts, results, strict=True):
        assert r.token_ids == alone(engine, ids, spec=spec)
    # With reuse off every row prefills its own prompt.
    off = engine.with_config(max_batch=4, prefix_reuse=False)
    off.generate(prompts, GREEDY, spec)
    assert off.stats.prefill_tokens == sum(len(p) - 1 for p in prompts)
