"""Run decoding methods side by side over benchmark prompts, interleaved per prompt, with repeats.

Every method generates prompt 1 (each repeat in turn), then prompt 2, ..., so slow drifts of
a noisy machine hit all methods alike; every other repeat runs the methods in reverse order, so a
steady drift does not always favour the method run first. A warm-up generation per method runs
first and is not counted. With ``repeats > 1`` the repeat with the median wall time represents the method on
that prompt (its stage times then match its wall time); every repeat's wall time is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from verispec.bench.datasets import BenchPrompt
from verispec.bench.memory import MemoryTracker
from verispec.constraints import Constraint
from verispec.engine.engine import Engine, GenerationResult
from verispec.engine.metrics import STAGES, Metrics
from verispec.sampling import SamplingParams

Payload = str | list[dict[str, str]]


def acceptance_by_position(m: Metrics) -> list[float]:
    """Accepted over drafted tokens at each draft position.

    Computed here rather than with ``Metrics.acceptance_by_position`` because the accepted
    counts stop at the last position ever accepted, so the two lists may differ in length.
    """
    acc = m.accepted_by_position
    return [(acc[i] if i < len(acc) else 0) / d if d else 0.0 for i, d in enumerate(m.drafted_by_position)]


def metrics_dict(m: Metrics) -> dict[str, Any]:
    """A request's (or merged requests') counters and derived rates as JSON-able values."""
    d = asdict(m)
    d["stage_s"] = {**{s: m.stage_s.get(s, 0.0) for s in STAGES}, "other": m.other_s}
    d.update(acceptance_rate=m.acceptance_rate, mean_accepted_length=m.mean_accepted_length,
             tokens_per_s=m.tokens_per_s, mean_ttft_s=m.mean_ttft_s, acceptance_by_position=acceptance_by_position(m))
    return d


@dataclass(frozen=True)
class Item:
    """One generation request as every method sees it: a prompt, or a later turn of a conversation."""

    index: int
    prompt_id: str
    category: str
    turn: int  # 1 for a first turn; MT-bench follow-ups are 2
    payload: Payload  # text, or chat messages for a follow-up turn
    chat: bool
    prediction: str | None = None  # the predicted output, for methods that send one
    unrelated: str | None = None  # another prompt's prediction, for methods that send an unrelated one
    schema: dict | None = None  # the JSON schema its answer follows, for methods that constrain

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "prompt_id": self.prompt_id, "category": self.category, "turn": self.turn,
                "chat": self.chat, "prompt": self.payload}


@dataclass
class Record:
    """One method's output on one item: the median-wall-time repeat, plus every repeat's wall time and tokens."""

    method: str
    item: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: Metrics
    wall_s: list[float]
    samples: list[list[int]]  # every repeat's tokens (a sampled run's distribution check uses them all)

    @property
    def repeats_agree(self) -> bool:
        return all(s == self.samples[0] for s in self.samples)

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "item": self.item, "tokens": len(self.token_ids), "token_ids": self.token_ids,
                "text": self.text, "finish_reason": self.finish_reason, "wall_s": self.wall_s,
                "repeats_agree": self.repeats_agree, "metrics": metrics_dict(self.metrics)}


Generate = Callable[[Item, SamplingParams], GenerationResult]
"""How a method generates one item: the engine with a SpecConfig, or a peer library."""


def engine_generate(engine: Engine, spec: Any, predict: str = "",
                    sampling: Callable[[SamplingParams], SamplingParams] | None = None,
                    policy_off: frozenset[str] = frozenset(), constrain: bool = False) -> Generate:
    """A :data:`Generate` for ``engine`` decoding with ``spec`` and, with ``predict``, the item's own ("own") or an
    unrelated ("other") prediction; ``sampling`` turns the run's sampling parameters into the method's own;
    ``constrain`` makes the answer follow the item's JSON schema, where it has one.

    ``policy_off``: the engine's cost policy runs with these rules switched off while this method generates.
    """
    ablated: list[Any] = []

    def gen(item: Item, params: SamplingParams) -> GenerationResult:
        prediction = {"own": item.prediction, "other": item.unrelated}.get(predict)
        saved = engine.policy
        if policy_off:
            if saved is None:
                engine.profile()  # the policy whose rules are switched off, and the one put back after
                saved = engine.policy
            if not ablated:
                ablated.append(replace(saved, chosen={}, off=policy_off))
            engine.policy = ablated[0]
        constraint = Constraint.json_schema(item.schema) if constrain and item.schema is not None else None
        try:
            return engine.generate(item.payload, sampling(params) if sampling else params, spec, chat=item.chat,
                                   prediction=prediction, constraint=constraint)[0]
        finally:
            if policy_off:
                engine.policy = saved
    return gen


@dataclass
class BenchRunner:
    """Runs a set of methods over items; see the module docstring for the protocol."""

    params: SamplingParams
    repeats: int = 1
    seed: int = 0
    progress: bool = True
    memory: MemoryTracker | None = None

    def _params(self, item: Item, rep: int) -> SamplingParams:
        # A seed per (item, repeat), the same for every method: reproducible, and repeats add fresh samples
        # (greedy decoding ignores it; a method that samples on its own takes it too).
        return replace(self.params, seed=self.seed * 1_000_003 + item.index * 1_009 + rep)

    def warm_up(self, methods: dict[str, Generate], item: Item) -> None:
        """One short untimed generation per method (allocations, lazy drafter set-up, cost profiling)."""
        params = SamplingParams(max_tokens=min(8, self.params.max_tokens))
        for gen in methods.values():
            gen(item, params)

    def run_item(self, methods: dict[str, Generate], item: Item) -> dict[str, Record]:
        """Every repeat of every method on ``item``, interleaved; the median-wall-time repeat represents each."""
        results: dict[str, list[GenerationResult]] = {label: [] for label in methods}
        for rep in range(self.repeats):
            params = self._params(item, rep)
            order = list(methods.items())
            for label, gen in order if rep % 2 == 0 else order[::-1]:
                results[label].append(gen(item, params))
                if self.memory is not None:
                    self.memory.sample(label)
        records = {}
        for label, runs in results.items():
            walls = [r.metrics.total_s for r in runs]
            median = sorted(range(len(runs)), key=lambda i: walls[i])[(len(runs) - 1) // 2]
            rep = runs[median]
            records[label] = Record(label, item.index, rep.token_ids, rep.text, rep.finish_reason, rep.metrics, walls,
                                    [r.token_ids for r in runs])
        return records

    def run_prompts(self, methods: dict[str, Generate], prompts: list[BenchPrompt],
                    baseline: str) -> tuple[list[Item], dict[str, list[Record]]]:
        """Run ``prompts``; a follow-up turn's prompt carries ``baseline``'s earlier answers.

        Using the baseline's answer gives every method the same second-turn prompt, so their
        outputs stay comparable token for token.
        """
        from tqdm import tqdm

        items: list[Item] = []
        records: dict[str, list[Record]] = {label: [] for label in methods}
        warm = True
        predictions = [p.prediction for p in prompts]
        for j, p in enumerate(tqdm(prompts, desc="prompts", unit="prompt", disable=not self.progress or None)):
            # The next prompt's prediction that is not this one's: what an unrelated prediction looks like.
            unrelated = next((x for x in predictions[j + 1:] + predictions[:j] if x and x != p.prediction), None)
            item = Item(len(items), p.id, p.category, 1, p.text, p.chat, p.prediction, unrelated, p.schema)
            messages = [{"role": "user", "content": p.text}]
            for turn, follow in enumerate((None, *p.followups), start=1):
                if follow is not None:
                    messages += [{"role": "assistant", "content": records[baseline][-1].text or ""},
                                 {"role": "user", "content": follow}]
                    item = Item(len(items), p.id, p.category, turn, list(messages), True)
                if warm:
                    self.warm_up(methods, item)
                    warm = False
                items.append(item)
                for label, rec in self.run_item(methods, item).items():
                    records[label].append(rec)
        return items, records

    def run_items(self, methods: dict[str, Generate], items: list[Item],
                  desc: str = "prompts") -> dict[str, list[Record]]:
        """Run fixed ``items`` (e.g. a peer library on the items an earlier run built)."""
        from tqdm import tqdm

        records: dict[str, list[Record]] = {label: [] for label in methods}
        if items:
            self.warm_up(methods, items[0])
        for item in tqdm(items, desc=desc, unit="prompt", disable=not self.progress or None):
            for label, rec in self.run_item(methods, item).items():
                records[label].append(rec)
        return records
