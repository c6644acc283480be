"""``verispec bench``: the evaluation harness from the command line.

Plain decoding runs first as the baseline, then every method, interleaved per prompt; peers
(``--peers hf,llamacpp``) load beside the engine and run as more methods of the same interleaving;
the stability suite (``--stability``) last. A method with its own kernels (``none:kernels=q8``) runs on
an engine of its own, in the same interleaving; ``--clients`` runs the closed-loop sweep of
:mod:`verispec.bench.clients` instead.
Everything lands in ``--out``: report.json, report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from verispec.errors import VerispecError

log = logging.getLogger("verispec.bench")


@dataclass(frozen=True)
class BenchOptions:
    """Everything a benchmark run needs; the CLI fills it from its flags."""

    model: str
    draft: str | None = None
    methods: str = ""  # comma-separated method strings; empty: default_methods()
    dataset: str = "spec_bench"
    spec_bench: str | None = None
    per_category: int | None = None
    categories: list[str] = field(default_factory=list)  # Spec-Bench categories to keep (empty: all)
    n: int | None = None
    ids: list[str] = field(default_factory=list)  # keep only these prompt ids, in the dataset's order (empty: all)
    seed: int = 0
    prompt_field: str = "prompt"
    raw: bool = False
    max_tokens: int = 128
    # What a method string leaves out (verispec.config.spec_defaults: None keeps DEFAULT_SPEC's value).
    k: int | None = None
    k_policy: str | None = None
    confidence: float | None = None
    draft_vocab: int | None = None
    draft_window: int | None = None
    k_sweep: list[int] = field(default_factory=list)
    repeats: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    peers: list[str] = field(default_factory=list)
    peer_methods: list[str] = field(default_factory=list)  # empty: every method of each peer
    lookup_tokens: int = 10
    stability: bool = False
    stability_max_tokens: int = 16
    mt_bench_turns: int = 1
    dtype: str = "auto"
    weights: str = "auto"
    draft_weights: str = "auto"
    max_len: int = 4096
    compile: bool = False
    kernels: str = "auto"
    # Numbers of concurrent clients (verispec.bench.clients; 0: "alone"): a closed-loop sweep instead of the
    # per-prompt comparison. Empty: no sweep.
    clients: list[int] = field(default_factory=list)
    out: str = "bench_out"
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        from verispec.bench.peers import PEERS

        if self.repeats < 1:
            raise VerispecError("--repeats must be at least 1")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise VerispecError(f"unknown peer '{unknown[0]}' (choose from {', '.join(PEERS)})")
        for m in self.peer_methods:
            if m not in PEER_ROWS:
                raise VerispecError(f"unknown peer method '{m}' (choose from {', '.join(PEER_ROWS)})")
            if m.split("-")[0] not in self.peers:
                raise VerispecError(f"peer method '{m}' needs --peers {m.split('-')[0]}")
        if self.mt_bench_turns not in (1, 2):
            raise VerispecError("--mt-bench-turns must be 1 or 2")
        if self.stability_max_tokens < 1:
            raise VerispecError("--stability-max-tokens must be at least 1")
        if self.clients and (self.peers or self.stability or self.k_sweep):
            raise VerispecError("--clients runs the closed-loop sweep alone: no --peers, --stability or --k-sweep")
        if any(c < 0 for c in self.clients):
            raise VerispecError("--clients takes numbers of clients >= 1 and 'alone'")


def default_methods(has_draft: bool) -> str:
    """The methods a run without ``--methods`` compares with plain decoding: verispec's default speculation
    (:data:`~verispec.config.DEFAULT_SPEC`'s method), the draft model alone and prompt lookup; ngram without a draft."""
    from verispec.config import DEFAULT_SPEC

    return ",".join(dict.fromkeys([DEFAULT_SPEC.method, "draft", "ngram"])) if has_draft else "ngram"


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run the benchmark ``opts`` describes, write the report files and return the report dict.

    A method string's options override :func:`~verispec.config.spec_defaults` for that method; the
    options it leaves out take ``opts``' k, k_policy, confidence, draft_vocab and draft_window, and
    where those are None, :data:`~verispec.config.DEFAULT_SPEC`'s values (the ones ``generate`` runs).
    A method with its own ``kernels`` runs on an engine of its own, loaded beside the run's; with
    ``opts.clients`` the run is the closed-loop sweep of :mod:`verispec.bench.clients` instead of the
    per-prompt comparison.
    """
    from verispec import hub
    from verispec.bench import datasets
    from verispec.bench.harness import BenchRunner, engine_generate
    from verispec.bench.memory import MemoryTracker, drafter_footprint, peak_rss_bytes, rss_bytes
    from verispec.bench.methods import BASELINE, parse_methods, with_k_sweep
    from verispec.bench.stats import aggregate, overall, repeat_ratios
    from verispec.bench.structured import structured
    from verispec.config import spec_defaults
    from verispec.sampling import SamplingParams

    # Validate everything cheap before loading any weights.
    defaults = spec_defaults(k=opts.k, k_policy=opts.k_policy, confidence=opts.confidence,
                             draft_vocab=opts.draft_vocab, draft_window=opts.draft_window)
    draft, _ = hub.resolve_draft(opts.model, opts.draft)  # "auto" that finds none is logged once, at loading
    methods = with_k_sweep(parse_methods(opts.methods or default_methods(draft is not None), defaults),
                           opts.k_sweep)
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=opts.temperature, top_p=opts.top_p,
                            top_k=opts.top_k)
    prompts = datasets.load(opts.dataset, Path(opts.spec_bench) if opts.spec_bench else None, opts.per_category,
                            opts.n, opts.seed, opts.mt_bench_turns, opts.prompt_field, not opts.raw,
                            opts.categories)
    if opts.ids:
        wanted = set(opts.ids)
        if missing := sorted(wanted - {p.id for p in prompts}):
            raise VerispecError(f"--ids: no prompt {', '.join(missing)} in dataset '{opts.dataset}'")
        prompts = [p for p in prompts if p.id in wanted]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    peer_errors = _check_peers(opts)  # a peer that cannot run is reported now, and the run goes on without it

    engines = _method_engines(_load_engines(opts, [m.kernels_or(opts.kernels) for m in methods]), methods, opts)
    engine = engines[BASE_ENGINE]
    rss_after_load = rss_bytes()
    for m in methods:  # build every drafter now: an unavailable method fails before hours of running
        engines[m.label].check_spec(m.spec)
    for eng in {id(e): e for e in engines.values()}.values():
        if any(m.spec.enabled and m.spec.k_policy == "cost" and engines[m.label] is eng for m in methods):
            eng.profile()  # before any timed request, as a server profiles before it serves
    if opts.clients:
        return _run_clients(opts, engines, methods, params, prompts, out)
    # Peers load beside the engine and run as more methods of the same interleaved run: a host that drifts
    # during the run moves verispec's and the peers' times alike.
    peers = _load_peers(opts, engine, prompts, peer_errors) if opts.peers else None
    memory = MemoryTracker()
    runner = BenchRunner(params, opts.repeats, opts.seed, opts.progress, memory)
    gens = {m.label: engine_generate(engines[m.label], m.spec, m.predict,
                                     m.sampling if m.run_options else None, m.policy_off, m.constrain)
            for m in methods}
    kinds = {m.label: "baseline" if m.is_baseline else "verispec" for m in methods}
    if peers is not None:
        gens.update(peers.methods)
        kinds.update(dict.fromkeys(peers.methods, "peer"))
    try:
        items, records = runner.run_prompts(gens, prompts, BASELINE)
    except BaseException:
        if peers is not None:
            peers.finish(None, params.greedy)  # free them, without the probe: the run is over
        raise
    peers_info = peers.finish(engine.encode(prompts[0].text, prompts[0].chat), params.greedy) \
        if peers is not None else None

    rows = aggregate(items, records, BASELINE, kinds, {m.label: m.spec.k for m in methods if not m.is_baseline})
    refs, greedy = _references(opts, methods, params, records)
    consistency = _consistency(records, refs, greedy)
    warnings = _warnings(records, consistency, kinds, greedy, refs)
    if peers_info is not None:
        warnings += [f"peer {name} not run: {lib['error']}" for name, lib in peers_info["libraries"].items()
                     if lib.get("error")]
    if peers_info is not None and not peers_info.get("error"):
        peers_info.update(_peer_ratios(rows))
    stability = _stability(engine, [m for m in methods if not m.from_sweep and not m.run_options], opts) \
        if opts.stability else None

    footprints = {m.label: drafter_footprint(engines[m.label], engines[m.label].drafter(m.spec),
                                             m.spec.method in ("draft", "hybrid"))
                  for m in methods}
    # The peers stay loaded through the run: their resident memory at load is not any verispec method's.
    peer_rss = peers.rss_bytes if peers is not None else 0
    mem = {"rss_after_load_bytes": rss_after_load, "peers_rss_bytes": peer_rss, "peak_rss_bytes": peak_rss_bytes(),
           "methods": [{"method": label,
                        "max_rss_bytes": (memory.max_rss[label] - (peer_rss if kinds[label] != "peer" else 0)
                                          if label in memory.max_rss else None),
                        "draft_model_bytes": footprints[label].model_bytes if label in footprints else None,
                        "draft_cache_bytes": footprints[label].cache_bytes if label in footprints else None,
                        "draft_increment_bytes": footprints[label].total_bytes if label in footprints else None}
                       for label in records]}

    report = _report_head(opts, engines, methods, params, kinds, refs)
    report["methods"] += [{"label": label, "kind": "peer", "family": label, "from_sweep": False, "spec": None}
                          for label in records if kinds.get(label) == "peer"]
    # Each repeat's tokens/s over plain decoding's (and each plain peer's) in the same repeat: the spread.
    spread = {ref: ratios for ref in (BASELINE, "llamacpp-plain", "hf-plain")
              if (ratios := repeat_ratios(items, records, ref))} if opts.repeats > 1 else None
    report |= {
        "summary": [r.as_dict() for r in overall(rows)],
        "per_category": [r.as_dict() for r in rows],
        "consistency": [c.as_dict() for c in consistency],
        "repeat_ratios": spread,
        "memory": mem, "peers": peers_info, "stability": stability, "plots": [], "warnings": warnings,
        "structured": structured(prompts, items, records, {m.label for m in methods if m.constrain}),
        "items": [i.as_dict() for i in items],
        "records": [r.as_dict() for recs in records.values() for r in recs],
    }
    if opts.plots:
        report["plots"] = _plots(rows, methods, out, report["title"])
    _write(report, out)
    return report


BASE_ENGINE = ""  # the key of the run's own engine (--kernels, default slot settings) in the methods' engines


def _method_engines(loaded: dict[str, Any], methods: list[Any], opts: BenchOptions) -> dict[str, Any]:
    """Per method label: the engine that runs it, ``loaded``'s of its kernels, or one over the same models with
    its slot settings (``Engine.with_config``); under :data:`BASE_ENGINE` the run's own."""
    engines = {BASE_ENGINE: loaded[opts.kernels]}
    own: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
    for m in methods:
        kern, slot = m.kernels_or(opts.kernels), tuple(sorted(m.slot_options.items()))
        if slot and (kern, slot) not in own:
            own[kern, slot] = loaded[kern].with_config(**dict(slot))
        engines[m.label] = own[kern, slot] if slot else loaded[kern]
    return engines


def _load_engines(opts: BenchOptions, kernels: list[str]) -> dict[str, Any]:
    """One engine per kernels choice the methods ask for (the run's --kernels first), over the same model files.

    No prefix reuse: the methods run one after another on each prompt, and reuse would spare every method
    after the first its prefill.
    """
    from verispec.engine.engine import Engine

    return {kern: Engine.from_pretrained(opts.model, draft=opts.draft, dtype=opts.dtype, weights=opts.weights,
                                         draft_weights=opts.draft_weights, max_len=opts.max_len,
                                         progress=opts.progress, compile=opts.compile, kernels=kern,
                                         prefix_reuse=False)
            for kern in dict.fromkeys([opts.kernels, *kernels])}


def _references(opts: BenchOptions, methods: list[Any], params: Any, records: dict[str, list[Any]]
                ) -> tuple[dict[str, str | None], dict[str, bool]]:
    """Per label: the plain-decoding method it must reproduce (None where none has its kernels and sampling: it
    is then compared with the baseline, and a difference is no warning), and whether it decodes greedily."""
    from verispec.bench.methods import BASELINE, reference

    refs: dict[str, str | None] = {label: BASELINE for label in records}
    greedy = dict.fromkeys(records, params.greedy)
    for m in methods:
        if m.is_baseline:
            continue
        ref = reference(m, methods, opts.kernels, params)
        refs[m.label] = ref.label if ref is not None else None
        greedy[m.label] = m.sampling(params).greedy
    return refs, greedy


def _report_head(opts: BenchOptions, engines: dict[str, Any], methods: list[Any], params: Any,
                 kinds: dict[str, str], refs: dict[str, str | None]) -> dict[str, Any]:
    """What every report starts with: title, settings, models, machine, versions and the methods as they ran."""
    from verispec import kernels as fast_kernels
    from verispec.bench.hardware import machine
    from verispec.bench.methods import BASELINE, spec_dict
    from verispec.bench.report import now, versions

    config = engines[BASE_ENGINE].describe()  # resolved: the draft "auto" picked, the weight formats "auto" chose
    title = f"verispec bench: {Path(opts.model).name}" + (f" + {Path(config['draft']).name}" if config["draft"] else "")

    def run_as(m: Any) -> dict[str, Any]:
        kern = m.kernels_or(opts.kernels)
        sampling = m.sampling(params)
        described = engines[m.label].describe()
        return {"kernels": kern, **m.slot_options, "quantized_kernels": fast_kernels.quantized_label(kern),
                "matmul_kernels": described["kernels"], "activations": described["activations"],
                "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k},
                **({"reference": refs.get(m.label) or BASELINE} if refs else {})}

    return {
        "title": title, "date": now(),
        "settings": {**asdict(opts), "sampling": asdict(params)},
        "models": {"target": opts.model, "draft": config["draft"], "dtype": config["dtype"],
                   "weights": config["weights"], "draft_weights": config["draft_weights"], "max_len": opts.max_len,
                   "quantized_kernels": fast_kernels.quantized_label(opts.kernels),
                   "kernels": config["kernels"], "activations": config["activations"],
                   "activations_reason": config["activations_reason"]},
        "machine": machine(), "versions": versions(),
        "methods": [{"label": m.label, "kind": kinds[m.label], "family": m.family, "from_sweep": m.from_sweep,
                     "predict": m.predict, "spec": spec_dict(m.spec), **run_as(m)} for m in methods],
    }


def _run_clients(opts: BenchOptions, engines: dict[str, Any], methods: list[Any], params: Any, prompts: list[Any],
                 out: Path) -> dict[str, Any]:
    """The closed-loop sweep over ``opts.clients`` (:mod:`verispec.bench.clients`): report.json, report.md and a
    plot of throughput and latency against the number of clients."""
    from verispec.bench import clients, plots
    from verispec.bench.methods import BASELINE

    ids = []
    for p in prompts:  # a prompt that could never be admitted with its new tokens is left out
        try:
            tokens = engines[BASE_ENGINE].encode(p.text, p.chat)
        except VerispecError:  # longer than the context
            continue
        if len(tokens) + opts.max_tokens <= engines[BASE_ENGINE].max_len:
            ids.append(tokens)
    if not ids:
        raise VerispecError(f"no prompt of '{opts.dataset}' fits --max-len {opts.max_len} with "
                            f"{opts.max_tokens} new tokens")
    served = [m for m in methods if not m.predict]
    runs = {m.label: clients.ClientMethod(engines[m.label], m.spec,
                                          replace(m.sampling(params), seed=opts.seed))
            for m in served}
    rows = clients.run_levels(runs, ids, opts.clients, opts.repeats, BASELINE, opts.progress)
    report = _report_head(opts, engines, served, params,
                          {m.label: "baseline" if m.is_baseline else "verispec" for m in served}, {})
    report |= {"title": report["title"] + ", clients " + ",".join(map(clients.level_name, opts.clients)),
               "prompts": len(ids), "clients": rows, "plots": [],
               "warnings": [f"{m.label}: predictions are not sent in the clients sweep" for m in methods if m.predict]}
    if opts.plots:
        plot = plots.clients_sweep(rows, out / "clients.png", report["title"])
        report["plots"] = [plot.name] if plot is not None else []
    _write(report, out)
    return report


def _write(report: dict[str, Any], out: Path) -> None:
    from verispec.bench.report import markdown, write_json

    write_json(report, out / "report.json")
    (out / "report.md").write_text(markdown(report), encoding="utf-8")
    _print_summary(report, out)


def _consistency(records: dict[str, list[Any]], refs: dict[str, str | None], greedy: dict[str, bool]) -> list[Any]:
    """Every method's outputs against its reference's (the baseline's where it has none; all repeats feed a
    sampled run's distribution check)."""
    from verispec.bench.consistency import compare
    from verispec.bench.methods import BASELINE

    out = []
    for label, recs in records.items():
        if label == BASELINE:
            continue
        ref = refs.get(label) or BASELINE
        base = records[ref]
        out.append(compare(label, [r.token_ids for r in recs], [r.token_ids for r in base], [r.text for r in recs],
                           [r.text for r in base], greedy[label], [s for r in recs for s in r.samples],
                           [s for r in base for s in r.samples], reference=ref))
    return out


def _warnings(records: dict[str, list[Any]], consistency: list[Any], kinds: dict[str, str], greedy: dict[str, bool],
              refs: dict[str, str | None]) -> list[str]:
    """Findings a reader must not miss: greedy runs that are not reproducible or not lossless (against the plain
    decoding of the same kernels and sampling)."""
    out = []
    unstable = sorted({r.method for recs in records.values() for r in recs
                       if greedy.get(r.method) and not r.repeats_agree})
    if unstable:
        out.append(f"greedy repeats produced different tokens for: {', '.join(unstable)} "
                   "(nondeterministic kernels?)")
    diverged = [c.method for c in consistency
                if c.diverged and kinds.get(c.method) == "verispec" and greedy[c.method] and refs.get(c.method)]
    if diverged:
        out.append(f"greedy outputs differ from plain decoding for: {', '.join(diverged)} (see consistency)")
    return out


PEER_ROWS = ("hf-assisted", "hf-prompt-lookup", "hf-plain", "llamacpp-plain", "llamacpp-prompt-lookup")
"""Peer rows verispec's best method is compared with (``best_vs_<row>``; None when the row did not run)."""


def _peer_ratios(rows: list[Any]) -> dict[str, Any]:
    """tokens/s of every method over hf-plain's and llamacpp-plain's (overall and per category), and of verispec's
    best method over each peer's."""
    from verispec.bench.stats import best_method, overall, ratios_by_category, spec_bench_mean

    best = best_method(rows)
    tps = {r.method: r.tokens_per_s for r in overall(rows)}
    out: dict[str, Any] = {}
    for plain in ("hf-plain", "llamacpp-plain"):
        key = plain.replace("-", "_")
        out["vs_" + key] = {r.method: r.tokens_per_s / tps[plain] if tps.get(plain) else None
                            for r in overall(rows)}
        # Per category too, and the mean over Spec-Bench's categories (Spec-Bench reports it so).
        by_cat = ratios_by_category(rows, plain)
        out[f"vs_{key}_by_category"] = by_cat
        out[f"spec_bench_mean_vs_{key}"] = {m: spec_bench_mean(c) for m, c in by_cat.items()}
    out["best_method"] = best.method if best else None
    for peer in PEER_ROWS:
        out["best_vs_" + peer.replace("-", "_")] = best.tokens_per_s / tps[peer] if best and tps.get(peer) else None
    return out


def _stability(engine: Any, methods: list[Any], opts: BenchOptions) -> dict[str, Any]:
    from verispec.bench.stability import cases, run_suite

    results = run_suite(engine, methods, opts.stability_max_tokens, progress=opts.progress)
    return {"passed": sum(r.passed for r in results), "total": len(results), "max_tokens": opts.stability_max_tokens,
            "cases": {c.name: c.description for c in cases(engine, opts.stability_max_tokens)},
            "results": [r.as_dict() for r in results]}


def _print_summary(report: dict[str, Any], out: Path) -> None:
    from verispec.bench.clients import table
    from verispec.bench.report import summary_table

    if "clients" in report:
        print(f"\n{report['title']}\n\n{table(report['clients'], 'plain')}\n")
    else:
        print(f"\n{report['title']}\n\n{summary_table(report)}\n")
    peers = report.get("peers")
    for peer in ("hf-assisted", "llamacpp-plain"):
        ratio = peers.get("best_vs_" + peer.replace("-", "_")) if peers else None
        if ratio is not None:
            print(f"best verispec method {peers['best_method']}: {ratio:.2f}x the tokens/s of {peer}\n")
    if report.get("stability"):
        print(f"stability: {report['stability']['passed']}/{report['stability']['total']} passed\n")
    for w in report["warnings"]:
        print(f"warning: {w}")
    plots = f" and {len(report['plots'])} plots" if report["plots"] else ""
    print(f"wrote {out}/report.md, {out}/report.json{plots}")


def _check_peers(opts: BenchOptions) -> dict[str, str]:
    """Peers that cannot run, with the reason, found before any weights load; each is logged once.

    Only llama.cpp has something cheap to check: the optional package and a GGUF target.
    """
    from verispec.bench.peers import gguf_file, import_llama_cpp

    errors = {}
    if "llamacpp" in opts.peers:
        try:
            import_llama_cpp()
            gguf_file(opts.model)
        except VerispecError as e:
            errors["llamacpp"] = str(e)
            log.warning("peer llamacpp skipped: %s", e)
    return errors


@dataclass
class LoadedPeers:
    """The peer libraries loaded beside the engine: their generate functions, and how each runs (or why not)."""

    methods: dict[str, Any] = field(default_factory=dict)  # label -> Generate, every selected peer method
    libraries: dict[str, dict[str, Any]] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)  # name -> the loaded peer object (close() frees it)
    rss_bytes: int = 0  # what loading them added to the process's resident memory

    def finish(self, first_prompt: list[int] | None, greedy: bool) -> dict[str, Any]:
        """Run the llama.cpp decode-cost probe on ``first_prompt``, free every peer, and describe the run."""
        for name, peer in self.handles.items():
            try:
                if name == "llamacpp" and first_prompt is not None:
                    try:  # a failing probe costs only its own figures
                        self.libraries[name].update(peer.decode_costs(first_prompt))
                    except Exception as e:  # noqa: BLE001
                        log.warning("llama.cpp decode-cost probe failed: %s", e)
                        self.libraries[name]["decode_costs_error"] = f"{type(e).__name__}: {e}"
            finally:
                peer.close()
        self.handles = {}
        failed = {name: lib["error"] for name, lib in self.libraries.items() if lib.get("error")}
        return {"decoding": "greedy" if greedy else "sampled", "libraries": self.libraries,
                "error": "; ".join(f"{n}: {e}" for n, e in failed.items())
                if failed and len(failed) == len(self.libraries) else None}


def _load_peers(opts: BenchOptions, engine: Any, prompts: list[Any], errors: dict[str, str]) -> LoadedPeers:
    """Load every peer library the run asks for, beside the engine, so that its methods run interleaved
    with verispec's on each prompt.

    ``errors`` names peers already found unable to run (:func:`_check_peers`); they are recorded,
    not retried. A peer that fails to load is recorded the same way and the others still run.
    """
    from verispec.bench.memory import rss_bytes

    loaded = LoadedPeers()
    before = rss_bytes()
    load = {"hf": _load_hf_peer, "llamacpp": _load_llamacpp_peer}
    for name in dict.fromkeys(opts.peers):
        if name in errors:
            loaded.libraries[name] = {"library": name, "error": errors[name]}
            continue
        try:
            peer, info = load[name](opts, engine, prompts)
        except Exception as e:  # noqa: BLE001 (a peer that cannot load must not cost the whole run)
            log.warning("peer %s skipped: %s", name, e)
            loaded.libraries[name] = {"library": name,
                                      "error": str(e) if isinstance(e, VerispecError) else f"{type(e).__name__}: {e}"}
            continue
        loaded.handles[name], loaded.libraries[name] = peer, info
        loaded.methods.update(_selected(opts, peer.methods()))
    loaded.rss_bytes = max(0, rss_bytes() - before)
    return loaded


def _selected(opts: BenchOptions, methods: dict[str, Any]) -> dict[str, Any]:
    """The peer methods ``--peer-methods`` asks for (all when it names none)."""
    return {label: gen for label, gen in methods.items() if not opts.peer_methods or label in opts.peer_methods}


def _load_hf_peer(opts: BenchOptions, engine: Any, prompts: list[Any]) -> tuple[Any, dict[str, Any]]:
    """transformers: hf-plain, hf-assisted (with a draft), hf-prompt-lookup."""
    from verispec.bench.peers import HFPeers

    info: dict[str, Any] = {"library": "transformers", "version": _version("transformers"),
                            "dtype": str(engine.target.dtype).replace("torch.", ""),
                            "prompt_lookup_num_tokens": opts.lookup_tokens, "error": None}
    return HFPeers.load(engine, opts.model, engine.config.draft, opts.lookup_tokens), info


def _load_llamacpp_peer(opts: BenchOptions, engine: Any, prompts: list[Any]) -> tuple[Any, dict[str, Any]]:
    """llama.cpp (llama-cpp-python): llamacpp-plain, llamacpp-prompt-lookup; its per-token decode cost after the run."""
    from verispec.bench.peers import LLAMACPP_BATCH, LLAMACPP_MAX_NGRAM, LlamaCppPeers, llamacpp_context

    # A follow-up turn carries the baseline's answer, unknown before the run: room for the engine's longest.
    lens = [engine.max_len if p.followups else len(engine.encode(p.text, p.chat)) for p in prompts]
    n_ctx = llamacpp_context(lens, opts.max_tokens, engine.max_len, opts.lookup_tokens)
    peers = LlamaCppPeers.load(engine, opts.model, opts.lookup_tokens, n_ctx)
    info: dict[str, Any] = {"library": "llama-cpp-python", "version": _version("llama-cpp-python"),
                            "gguf": str(peers.path), "n_threads": peers.threads, "n_ctx": n_ctx,
                            "n_batch": LLAMACPP_BATCH, "use_mmap": False, "num_pred_tokens": opts.lookup_tokens,
                            "max_ngram_size": LLAMACPP_MAX_NGRAM, "extra_buffer_types": peers.extra_buffers,
                            "system_info": peers.system_info, "error": None}
    return peers, info


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _plots(rows: list[Any], methods: list[Any], out: Path, title: str) -> list[str]:
    from verispec.bench import plots

    # k-sweep variants get their own plot; in the others they would crowd out the methods asked for by name.
    sweep = frozenset(m.label for m in methods if m.from_sweep)
    written = [plots.speedup_by_category(rows, out / "speedup_by_category.png", title, sweep),
               plots.acceptance_by_position(rows, out / "acceptance_by_position.png", title, sweep),
               plots.stage_breakdown(rows, out / "stage_breakdown.png", title),
               plots.speedup_vs_k(rows, {m.label: m.family for m in methods if not m.is_baseline},
                                  out / "speedup_vs_k.png", title)]
    return [p.name for p in written if p is not None]


def add_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None],
               add_spec_tuning_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench`` on the CLI's subparsers: ``add_engine_args`` adds --model, --draft, --dtype, ...
    and ``add_spec_tuning_args`` -k, --k-policy, --confidence, --draft-vocab, --draft-window, as for generate."""
    from verispec.bench.methods import OPTIONS, RUN_OPTIONS

    b = sub.add_parser("bench", help="benchmark methods against plain decoding (and peers): report.md, .json, plots",
                       description="Plain decoding runs first as the baseline, then every method, interleaved per "
                       "prompt; peers (--peers hf,llamacpp) run as more methods of the same interleaving, the "
                       "stability suite (--stability) last; --clients runs a sweep of concurrent clients instead. "
                       "--out receives report.md, report.json and PNG plots. A method string's options override the "
                       "speculation settings, --kernels and the sampling below for that method; those it leaves out "
                       "take -k, --k-policy, --confidence, --draft-vocab and --draft-window, whose defaults are the "
                       "ones `verispec generate` runs. See docs/bench.md.")
    add_engine_args(b)
    add_spec_tuning_args(b)
    b.add_argument("--methods", default="",
                   help="comma-separated methods, each name[:key=value,...] e.g. none,draft,ngram,draft:k=3,"
                   "draft:policy=fixed,hybrid:vocab=0,layerskip:layers=7,retrieval:datastore=PATH,none:kernels=q8,"
                   "hybrid:temperature=0.8,top_p=0.9 (default: "
                   f"{default_methods(True)} with a draft model, else {default_methods(False)}); options: "
                   + ", ".join([*OPTIONS, "predict", *RUN_OPTIONS]))
    b.add_argument("--dataset", default="spec_bench",
                   help="spec_bench, humaneval, humaneval:A-B, chat_code, code_edit, code_edit_polyglot, "
                   "code_edit_tune or jsonl:PATH (comma-separated to combine)")
    b.add_argument("--spec-bench", help="a Spec-Bench question.jsonl (default: $VERISPEC_SPEC_BENCH, else the "
                   "copy packaged with verispec)")
    b.add_argument("--per-category", type=int, help="Spec-Bench prompts sampled per category (default: all)")
    b.add_argument("--categories", default="", help="Spec-Bench categories to run, comma-separated, e.g. rag,qa "
                   "(default: all; the same prompts as a run of all of them)")
    b.add_argument("--n", type=int, help="first N prompts of HumanEval or a JSONL file (default: all)")
    b.add_argument("--ids", default="", help="only these prompt ids, comma-separated (e.g. code_edit-02,code_edit-03)")
    b.add_argument("--seed", type=int, default=0, help="seed of the per-category sample (and of sampled decoding)")
    b.add_argument("--prompt-field", default="prompt", help="JSONL field holding the prompt")
    b.add_argument("--raw", action="store_true", help="JSONL prompts are raw completions (no chat template)")
    b.add_argument("--mt-bench-turns", type=int, default=1, choices=(1, 2),
                   help="2: MT-bench rows also run their second turn (after the baseline's first answer)")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--k-sweep", help="also run every method without an explicit k at each of these k, e.g. 1,2,4,8")
    b.add_argument("--repeats", type=int, default=1, help="runs per prompt and method (the median wall time counts; "
                   "each repeat's ratios to plain decoding give the spread), or per --clients level and method")
    b.add_argument("--clients", default="", help="a closed-loop sweep instead of the per-prompt comparison: numbers "
                   "of concurrent clients, each keeping one request in flight, e.g. 1,2,4,8 ('alone': one request "
                   "after another through Engine.generate)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--peers", default="", help="peer libraries to compare with, comma-separated: hf (transformers), "
                   "llamacpp (llama-cpp-python on the same GGUF; pip install 'verispec[llamacpp]')")
    b.add_argument("--peer-methods", default="", help="only these peer methods, comma-separated (default: all "
                   "of each peer): " + ", ".join(PEER_ROWS))
    b.add_argument("--lookup-tokens", type=int, default=10, help="draft tokens per prompt lookup of the peers: "
                   "hf-prompt-lookup's prompt_lookup_num_tokens, llamacpp-prompt-lookup's num_pred_tokens")
    b.add_argument("--stability", action="store_true", help="also run the stability suite")
    b.add_argument("--quality", action="store_true", help="run the kernels' quality gate instead: perplexity and "
                   "HumanEval pass@1 of --model under each int4/int8 kernel path and llama.cpp (see docs/bench.md)")
    b.add_argument("--stability-max-tokens", type=int, default=16)
    b.add_argument("--out", default="bench_out", help="output folder")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("--no-plots", action="store_true")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from verispec.bench.clients import parse_clients
    from verispec.bench.methods import parse_ints

    if args.quality:
        from verispec.bench.quality import run_quality

        run_quality(args.model, args.out, weights=args.weights, dtype=args.dtype)
        print((Path(args.out) / "quality.md").read_text(), end="")
        return 0

    opts = BenchOptions(
        model=args.model, draft=args.draft, methods=args.methods, dataset=args.dataset, spec_bench=args.spec_bench,
        per_category=args.per_category, categories=_csv(args.categories), n=args.n, ids=_csv(args.ids), seed=args.seed,
        prompt_field=args.prompt_field, raw=args.raw, max_tokens=args.max_tokens, k=args.k, k_policy=args.k_policy,
        confidence=args.confidence, draft_vocab=args.draft_vocab, draft_window=args.draft_window,
        k_sweep=parse_ints(args.k_sweep), repeats=args.repeats, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, peers=_csv(args.peers), peer_methods=_csv(args.peer_methods),
        lookup_tokens=args.lookup_tokens, stability=args.stability, stability_max_tokens=args.stability_max_tokens,
        mt_bench_turns=args.mt_bench_turns, dtype=args.dtype, weights=args.weights, draft_weights=args.draft_weights,
        max_len=args.max_len, compile=args.compile, kernels=args.kernels,
        clients=parse_clients(args.clients), out=args.out, progress=not args.no_progress,
        plots=not args.no_plots)
    run_bench(opts)
    return 0


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
