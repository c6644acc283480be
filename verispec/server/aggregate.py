"""Figures of several replicas as one server's: Prometheus series with a ``replica`` label, and one ``/stats``.

Each replica keeps its own :class:`~verispec.server.metrics.ServerMetrics`; the ingress reads them and
merges here. Prometheus series keep their names and gain a ``replica`` label (sum them over
``replica`` for the server's total). In ``/stats`` counts and throughputs add up; acceptance and mean
accepted length are recomputed from the summed counts; rolling-window rates and latency percentiles,
which cannot be combined exactly, are weighted by each replica's requests in the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from verispec.engine.metrics import mean_accepted_length

REPLICA_LABEL = "replica"
_ADDITIVE = ("running", "waiting")
_SUMMED_WINDOW = ("requests", "throughput_tokens_per_s")
_WEIGHTED_WINDOW = ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "latency_p50_s", "latency_p95_s",
                    "ttft_p50_s", "ttft_p95_s")
_SUMMED_TOTAL = ("requests", "generated_tokens", "steps", "drafted", "accepted", "prefix_reused_tokens")


class _Families:
    """A collector that yields already-built metric families (so generate_latest renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: Mapping[str, bytes], extra: CollectorRegistry | None = None) -> bytes:
    """One exposition of every replica's series (``texts``: replica name -> its exposition), each sample
    labelled with its replica, followed by ``extra``'s own series."""
    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text.decode("utf-8")):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples.extend(Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))  # type: ignore[arg-type]
    body = generate_latest(registry)
    return body + (generate_latest(extra) if extra is not None else b"")


def _weighted(values: Iterable[tuple[float | None, int]]) -> float | None:
    pairs = [(v, w) for v, w in values if v is not None and w > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def merge_paths(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``paths`` of several :meth:`ServerMetrics.snapshot` results as one (see the module's docstring)."""
    names: list[str] = []
    for snap in snapshots:
        names += [p for p in snap.get("paths", {}) if p not in names]
    paths: dict[str, Any] = {}
    for name in names:
        parts = [snap["paths"][name] for snap in snapshots if name in snap.get("paths", {})]
        weights = [p["window"]["requests"] for p in parts]
        window: dict[str, Any] = {key: sum(p["window"][key] or 0 for p in parts) for key in _SUMMED_WINDOW}
        for key in _WEIGHTED_WINDOW:
            window[key] = _weighted((p["window"][key], w) for p, w in zip(parts, weights, strict=True))
        total: dict[str, Any] = {key: sum(p["total"][key] for p in parts) for key in _SUMMED_TOTAL}
        total["acceptance_rate"] = total["accepted"] / total["drafted"] if total["drafted"] else None
        total["mean_accepted_length"] = (mean_accepted_length(total["steps"], total["accepted"])
                                         if total["steps"] else None)
        paths[name] = {**{key: sum(p[key] for p in parts) for key in _ADDITIVE},
                       "kv_usage": sum(p["kv_usage"] for p in parts) / len(parts),
                       "window": window, "total": total}
    return paths
