"""The server's metrics: Prometheus series (named like vLLM's) and the rolling summary behind /stats.

Every series carries ``path`` ("speculative" or "plain") and ``method`` labels so the two
arms of a canary can be compared side by side. Each app owns its own
:class:`~prometheus_client.CollectorRegistry`; nothing is registered globally.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from verispec.engine.engine import GenerationResult
from verispec.engine.metrics import mean_accepted_length
from verispec.server.worker import PLAIN_PATH, SPECULATIVE, GenRequest

LABELS = ("path", "method")
PATHS = (PLAIN_PATH, SPECULATIVE)
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class _Finished:
    """What the rolling window keeps of one finished request."""

    t: float
    generated: int
    steps: int
    drafted: int
    accepted: int
    engine_s: float
    e2e_s: float
    ttft_s: float | None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by linear interpolation between order statistics; None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _mean_accepted(steps: int, accepted: int) -> float | None:
    return mean_accepted_length(steps, accepted) if steps else None


class ServerMetrics:
    """Prometheus series plus a rolling window of recent requests; implements the worker's Observer.

    Hooks are called from the worker thread and the asyncio loop; prometheus_client is
    thread-safe and the window is guarded by a lock.
    """

    def __init__(self, window_s: float = 60.0, label_sets: tuple[tuple[str, str], ...] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.window_s = window_s
        r = self.registry
        self.num_drafts = Counter("verispec:spec_decode_num_drafts", "Speculative steps that drafted at least one "
                                  "token.", LABELS, registry=r)
        self.num_draft_tokens = Counter("verispec:spec_decode_num_draft_tokens", "Draft tokens proposed.", LABELS,
                                        registry=r)
        self.num_accepted_tokens = Counter("verispec:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           LABELS, registry=r)
        self.num_accepted_per_pos = Counter("verispec:spec_decode_num_accepted_tokens_per_pos",
                                            "Draft tokens accepted, by position in the draft (0-based).",
                                            (*LABELS, "position"), registry=r)
        self.num_steps = Counter("verispec:spec_decode_num_steps", "Target forwards after prefill (decode steps).",
                                 LABELS, registry=r)
        self.request_success = Counter("verispec:request_success", "Requests that finished, by finish reason "
                                       "(stop, length, cancelled).", (*LABELS, "finished_reason"), registry=r)
        self.request_failure = Counter("verispec:request_failure", "Requests the engine failed.", LABELS, registry=r)
        self.prompt_tokens = Counter("verispec:prompt_tokens", "Prompt tokens of requests that ran (prefilled or "
                                     "reused).", LABELS, registry=r)
        self.prefix_reused_tokens = Counter("verispec:prefix_reused_tokens", "Prompt tokens not prefilled because "
                                            "an earlier request left their KV in the cache (prefix reuse).", LABELS,
                                            registry=r)
        self.generation_tokens = Counter("verispec:generation_tokens", "Tokens generated.", LABELS, registry=r)
        self.prediction_tokens = Counter("verispec:prediction_tokens", "Drafted tokens of predicted outputs, by "
                                         "outcome (accepted, rejected).", (*LABELS, "outcome"), registry=r)
        self.ttft = Histogram("verispec:time_to_first_token_seconds", "From arrival to the first generated token.",
                              LABELS, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("verispec:inter_token_latency_seconds", "Time per output token between successive "
                             "steps (a step's gap divided by the tokens it produced).", LABELS,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("verispec:e2e_request_latency_seconds", "From arrival to the last token.", LABELS,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("verispec:num_requests_running", "Requests the engine is generating.", LABELS,
                             registry=r)
        self.waiting = Gauge("verispec:num_requests_waiting", "Requests queued for the engine.", LABELS, registry=r)
        self.kv_cache_usage = Gauge("verispec:kv_cache_usage_perc", "Fraction of KV cache positions held by running "
                              "requests (1 = full).", LABELS, registry=r)
        for labels in label_sets:  # so the series exist (at 0) before the first request
            for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_steps,
                           self.prompt_tokens, self.prefix_reused_tokens, self.generation_tokens, self.ttft, self.itl,
                           self.e2e, self.running, self.waiting, self.kv_cache_usage, self.request_failure):
                metric.labels(*labels)

        self._lock = threading.Lock()
        self._window: dict[str, deque[_Finished]] = {p: deque() for p in PATHS}
        self._token_events: dict[str, deque[tuple[float, int]]] = {p: deque() for p in PATHS}
        self._ttft: dict[str, float] = {}
        self._counts: dict[tuple[str, str], int] = defaultdict(int)  # (path, "running"|"waiting"|"finished")
        self._kv: dict[tuple[str, str], float] = {}  # per (path, method); a path's usage is their sum
        self._totals: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PATHS}

    # -- Observer hooks ----------------------------------------------------------------------

    @staticmethod
    def _labels(req: GenRequest) -> tuple[str, str]:
        return req.path, req.method

    def queued(self, request: GenRequest) -> None:
        self.waiting.labels(*self._labels(request)).inc()
        with self._lock:
            self._counts[request.path, "waiting"] += 1

    def started(self, request: GenRequest) -> None:
        labels = self._labels(request)
        self.waiting.labels(*labels).dec()
        self.running.labels(*labels).inc()
        with self._lock:
            self._counts[request.path, "waiting"] -= 1
            self._counts[request.path, "running"] += 1

    def tokens(self, request: GenRequest, n: int, gap_s: float, first: bool) -> None:
        labels = self._labels(request)
        if first:
            self.ttft.labels(*labels).observe(gap_s)
        else:
            self.itl.labels(*labels).observe(gap_s)
        now = time.monotonic()
        with self._lock:
            if first:
                self._ttft[request.request_id] = gap_s
            self._token_events[request.path].append((now, n))
            self._prune(now)

    def kv_usage(self, request: GenRequest, fraction: float) -> None:
        labels = self._labels(request)
        self.kv_cache_usage.labels(*labels).set(fraction)
        with self._lock:
            self._kv[labels] = fraction

    def finished(self, request: GenRequest, result: GenerationResult | None, ran: bool) -> None:
        labels = self._labels(request)
        now = time.monotonic()
        e2e_s = time.perf_counter() - request.arrival
        if ran:
            self.running.labels(*labels).dec()
            self.kv_cache_usage.labels(*labels).set(0.0)
        else:
            self.waiting.labels(*labels).dec()
        with self._lock:
            self._counts[request.path, "running" if ran else "waiting"] -= 1
            if ran:
                self._kv[labels] = 0.0
            ttft_s = self._ttft.pop(request.request_id, None)
        if result is None:
            self.request_failure.labels(*labels).inc()
            return
        self.request_success.labels(*labels, result.finish_reason).inc()
        if not ran:
            return
        m = result.metrics
        self.prompt_tokens.labels(*labels).inc(len(result.prompt_token_ids))
        self.prefix_reused_tokens.labels(*labels).inc(m.prefix_reused_tokens)
        self.generation_tokens.labels(*labels).inc(len(result.token_ids))
        self.num_steps.labels(*labels).inc(m.steps)
        for outcome, n in (("accepted", m.accepted_prediction_tokens), ("rejected", m.rejected_prediction_tokens)):
            if n:
                self.prediction_tokens.labels(*labels, outcome).inc(n)
        if m.drafted:
            self.num_drafts.labels(*labels).inc(m.drafted_by_position[0] if m.drafted_by_position else 0)
            self.num_draft_tokens.labels(*labels).inc(m.drafted)
            self.num_accepted_tokens.labels(*labels).inc(m.accepted)
            for pos, count in enumerate(m.accepted_by_position):
                self.num_accepted_per_pos.labels(*labels, str(pos)).inc(count)
        self.e2e.labels(*labels).observe(e2e_s)
        with self._lock:
            totals = self._totals[request.path]
            for name, value in (("requests", 1), ("generated", len(result.token_ids)), ("steps", m.steps),
                                ("drafted", m.drafted), ("accepted", m.accepted),
                                ("prefix_reused", m.prefix_reused_tokens)):
                totals[name] += value
            if result.finish_reason != "cancelled":  # a cut-short request would skew the latencies
                self._window[request.path].append(_Finished(now, len(result.token_ids), m.steps, m.drafted,
                                                            m.accepted, m.total_s, e2e_s, ttft_s))
            self._prune(now)

    # -- reading -----------------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        for finished in self._window.values():
            while finished and finished[0].t < horizon:
                finished.popleft()
        for events in self._token_events.values():
            while events and events[0][0] < horizon:
                events.popleft()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """Per-path figures over the rolling window plus running totals (the JSON behind /stats)."""
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            paths = {}
            for path in PATHS:
                recent = list(self._window[path])
                events = list(self._token_events[path])
                totals = dict(self._totals[path])
                span = min(self.window_s, max(1e-9, now - events[0][0])) if events else self.window_s
                e2e = [f.e2e_s for f in recent]
                ttft = [f.ttft_s for f in recent if f.ttft_s is not None]
                paths[path] = {
                    "running": self._counts[path, "running"],
                    "waiting": self._counts[path, "waiting"],
                    "kv_usage": sum(v for (p, _), v in self._kv.items() if p == path),
                    "window": {
                        "requests": len(recent),
                        "acceptance_rate": _ratio(sum(f.accepted for f in recent), sum(f.drafted for f in recent)),
                        "mean_accepted_length": _mean_accepted(sum(f.steps for f in recent),
                                                               sum(f.accepted for f in recent)),
                        "tokens_per_s": _ratio(sum(f.generated for f in recent), sum(f.engine_s for f in recent)),
                        "throughput_tokens_per_s": sum(n for _, n in events) / span if events else 0.0,
                        "latency_p50_s": percentile(e2e, 0.5),
                        "latency_p95_s": percentile(e2e, 0.95),
                        "ttft_p50_s": percentile(ttft, 0.5),
                        "ttft_p95_s": percentile(ttft, 0.95),
                    },
                    "total": {
                        "requests": totals.get("requests", 0),
                        "generated_tokens": totals.get("generated", 0),
                        "steps": totals.get("steps", 0),
                        "drafted": totals.get("drafted", 0),
                        "accepted": totals.get("accepted", 0),
                        "prefix_reused_tokens": totals.get("prefix_reused", 0),
                        "acceptance_rate": _ratio(totals.get("accepted", 0), totals.get("drafted", 0)),
                        "mean_accepted_length": _mean_accepted(totals.get("steps", 0), totals.get("accepted", 0)),
                    },
                }
        return {"window_s": self.window_s, "paths": paths}
