"""The benchmark report: ``report.json`` (every figure and per-prompt record) and ``report.md`` (tables).

The markdown is rendered from the same dict that is written as JSON, so both always agree.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from verispec.bench.stats import STAGE_NAMES
from verispec.bench.structured import markdown as structured_markdown

REPORT_KEYS = ("title", "date", "settings", "models", "machine", "versions", "methods", "summary", "per_category",
               "consistency", "repeat_ratios", "memory", "peers", "stability", "plots", "warnings", "items", "records")
"""Top-level keys every report.json has (``peers`` and ``stability`` are None when not run, ``repeat_ratios``
with one repeat). A run with ``--clients`` has :data:`CLIENTS_REPORT_KEYS` instead."""

CLIENTS_REPORT_KEYS = ("title", "date", "settings", "models", "machine", "versions", "methods", "prompts", "clients",
                       "plots", "warnings")
"""Top-level keys of the report.json of a ``--clients`` run (:mod:`verispec.bench.clients`)."""


def versions() -> dict[str, str | None]:
    """Versions of Python, the libraries that shape the figures, and the checkout's git commit."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("verispec", "torch", "transformers", "tokenizers", "numpy", "rouge-score", "sacrebleu", "matplotlib",
                "llama-cpp-python"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                                           capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None, so the JSON is strict and portable."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(finite(report), indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                    encoding="utf-8")


# -- markdown -------------------------------------------------------------------------------------

def _f(x: Any, fmt: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:{fmt}}{suffix}"


def _mb(x: int | None) -> str:
    return "–" if x is None else f"{x / 2**20:,.1f}"


def _table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_table(report: dict[str, Any]) -> str:
    """Overall figures per method: the table printed to the terminal too."""
    exact = {c["method"]: c["exact_match"] for c in report["consistency"]}
    rows = []
    for r in report["summary"]:
        rows.append([r["method"], r["kind"], str(r["prompts"]), str(r["tokens"]), _f(r["tokens_per_s"]),
                     _f(r["speedup"], ".2f", "x"), _f(r["mean_ttft_s"] and r["mean_ttft_s"] * 1e3, ".0f"),
                     _f(r["mean_accepted_length"]), _f(r["acceptance_rate"] and 100 * r["acceptance_rate"], ".1f", "%"),
                     _f(r["draft_cost_ratio"], ".3f"),
                     _f(exact.get(r["method"]) and 100 * exact[r["method"]], ".0f", "%")
                     if r["kind"] != "baseline" else "–"])
    return _table(["method", "kind", "prompts", "tokens", "tokens/s", "speedup", "TTFT ms", "mean accepted length",
                   "acceptance", "draft cost c", "same tokens as plain"], rows, "llrrrrrrrrr")


def _swept(report: dict[str, Any]) -> set[str]:
    return {m["label"] for m in report["methods"] if m["from_sweep"]}


def _pivot(report: dict[str, Any], key: str, fmt: str, suffix: str = "") -> str:
    swept = _swept(report)
    rows = [r for r in report["per_category"] if r["method"] not in swept]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    val = {(r["method"], r["category"]): r for r in rows}
    body = []
    for c in cats:
        cells = [c, str(next((val[m, c]["prompts"] for m in methods if (m, c) in val), 0))]
        cells += [_f(val[m, c][key], fmt, suffix) if (m, c) in val else "–" for m in methods]
        body.append(cells)
    return _table(["category", "prompts", *methods], body)


def _k_sweep(report: dict[str, Any]) -> str | None:
    """Overall speedup (mean accepted length) per method family and k, when a family ran at several k."""
    family = {m["label"]: m["family"] for m in report["methods"] if m["kind"] == "verispec"}
    cells: dict[str, dict[int, str]] = {}
    for r in report["summary"]:
        if r["method"] in family and r["k"] is not None:
            cells.setdefault(family[r["method"]], {})[r["k"]] = (
                f"{_f(r['speedup'], '.2f', 'x')} ({_f(r['mean_accepted_length'])})")
    cells = {f: c for f, c in cells.items() if len(c) > 1}
    if not cells:
        return None
    ks = sorted({k for c in cells.values() for k in c})
    return _table(["method / k", *map(str, ks)], [[f, *[c.get(k, "–") for k in ks]] for f, c in cells.items()])


def _stages(report: dict[str, Any]) -> str:
    rows = []
    for r in report["summary"]:
        if r["stage_share"]:
            ms = r["stage_ms_per_token"]
            rows.append([r["method"], *[_f(100 * r["stage_share"][s], ".1f", "%") for s in STAGE_NAMES],
                         _f(sum(ms.values()), ".1f")])
    return _table(["method", *STAGE_NAMES, "ms per token"], rows)


def _acceptance_by_position(report: dict[str, Any]) -> str:
    swept = _swept(report)
    rows = [r for r in report["summary"] if r["acceptance_by_position"] and r["method"] not in swept]
    if not rows:
        return "_No speculative method ran._"
    width = max(len(r["acceptance_by_position"]) for r in rows)
    body = [[r["method"], *[_f(a, ".2f") for a in r["acceptance_by_position"]],
             *["–"] * (width - len(r["acceptance_by_position"]))] for r in rows]
    return _table(["method", *[str(i + 1) for i in range(width)]], body)


def _consistency(report: dict[str, Any]) -> str:
    body = []
    against = any(c.get("reference", "plain") != "plain" for c in report["consistency"])
    for c in report["consistency"]:
        d = c["distribution"]
        body.append([c["method"], *([c.get("reference", "plain")] if against else []), str(c["prompts"]),
                     _f(c["exact_match"] and 100 * c["exact_match"], ".0f", "%")
                     if c["exact_match"] is not None else "–", str(c["diverged"]),
                     _f(c["mean_first_divergence"], ".1f"), _f(c["rouge_l"], ".3f"), _f(c["bleu"], ".1f"),
                     _f(d and d["total_variation"], ".3f"), _f(d and d["p_value"], ".3f")])
    table = _table(["method", *(["against"] if against else []), "prompts", "exact match", "diverged",
                    "mean first divergence (token)", "ROUGE-L", "BLEU", "token TV (sanity)", "chi-square p (sanity)"],
                   body, "l" + "l" * against + "r" * 8)
    if against:
        table += ("\n\nEach method against plain decoding with the same kernels and sampling where the run has it "
                  "(`against`), else against the baseline.")
    if any(c["distribution"] for c in report["consistency"]):
        table += ("\n\nSampled run: outputs cannot match token for token. The last two columns compare the token "
                  "histograms of baseline and method outputs; they are a sanity check only (exactness of speculative "
                  "sampling is proven by the unit tests). A finite sample gives a positive TV even for identical "
                  "distributions.")
    return table


def _memory(report: dict[str, Any]) -> str:
    mem = report["memory"]
    peers = mem.get("peers_rss_bytes")
    head = (f"Process peak RSS: {_mb(mem['peak_rss_bytes'])} MiB"
            + (f" (the peers, loaded beside the engine, added {_mb(peers)} MiB; the verispec rows below leave "
               "that out)" if peers else "")
            + f"; RSS after loading the models: {_mb(mem['rss_after_load_bytes'])} MiB.\n\n")
    body = [[m["method"], _mb(m["max_rss_bytes"]), _mb(m["draft_model_bytes"]), _mb(m["draft_cache_bytes"]),
             _mb(m["draft_increment_bytes"])] for m in mem["methods"]]
    return head + _table(["method", "max RSS after a generation (MiB)", "draft weights (MiB)", "draft KV cache (MiB)",
                          "draft increment (MiB)"], body)


def _peer_library(name: str, lib: dict[str, Any], decoding: str) -> str:
    """One line on how a peer library ran (or why it did not)."""
    if lib.get("error"):
        return f"- **{name}**: not run: {_cell(lib['error'])}"
    if name == "hf":
        return (f"- **hf**: transformers {lib.get('version') or ''}, same weights ({lib['dtype']}), same prompt "
                f"token ids, {decoding}, same max_new_tokens; prompt lookup with "
                f"prompt_lookup_num_tokens={lib['prompt_lookup_num_tokens']}.")
    if name == "llamacpp":
        line = (f"- **llamacpp**: llama-cpp-python {lib.get('version') or ''} on the same GGUF file "
                f"(llama.cpp's own kernels), same prompt token ids, {decoding}, same max_tokens; "
                f"n_threads {lib['n_threads']}, n_ctx {lib['n_ctx']}, n_batch {lib['n_batch']}; prompt lookup "
                f"(LlamaPromptLookupDecoding) with num_pred_tokens={lib['num_pred_tokens']}, "
                f"max_ngram_size={lib['max_ngram_size']}.")
        if lib.get("extra_buffer_types") is False:
            line += (" Its extra buffer types (weight repacking, AMX) were off: with them llama.cpp crashed "
                     "decoding this GGUF on this host.")
        if lib.get("system_info"):
            line += f" Built with: {lib['system_info']}."
        if lib.get("eval_ms_per_token") is not None:
            line += (f" Per-token decode cost after a {lib['probe_prompt_tokens']}-token prompt (median of "
                     f"{lib['probe_tokens']}): {_f(lib['generate_ms_per_token'])} ms through Llama.generate, "
                     f"{_f(lib['eval_ms_per_token'])} ms for Llama.eval alone, so "
                     f"{_f(lib['python_loop_ms_per_token'])} ms of sampling and Python loop.")
        return line
    return f"- **{name}**"


def _peers(report: dict[str, Any]) -> str:
    p = report["peers"]
    if p is None:
        return "_Not run (use --peers hf,llamacpp)._"
    libs = p.get("libraries", {})
    lines = [_peer_library(name, lib, p["decoding"]) for name, lib in libs.items()]
    if p.get("error"):
        return "\n".join([f"Peers failed: {p['error']}", "", *lines])
    lines += ["", "Their rows are in the summary above.", ""]
    swept = _swept(report)
    vs = {plain: p.get("vs_" + plain.replace("-", "_")) or {} for plain in ("hf-plain", "llamacpp-plain")}
    plains = [plain for plain, ratios in vs.items() if any(v is not None for v in ratios.values())]
    rows = [[r["method"], _f(r["tokens_per_s"]), _f(r["speedup"], ".2f", "x"),
             *[_f(vs[plain].get(r["method"]), ".2f", "x") for plain in plains]]
            for r in report["summary"] if r["method"] not in swept]
    lines.append(_table(["method", "tokens/s", "vs verispec plain", *[f"vs {plain}" for plain in plains]], rows))
    for plain in plains:
        lines += ["", category_ratios(report, plain)]
    if p.get("best_method"):
        headline = ("hf-assisted", "llamacpp-plain")  # in bold: the strongest transformers peer, llama.cpp itself
        ratios = []
        for peer in ("hf-assisted", "hf-prompt-lookup", "hf-plain", "llamacpp-plain", "llamacpp-prompt-lookup"):
            value = p.get("best_vs_" + peer.replace("-", "_"))
            if value is not None:
                ratios.append(f"to {peer} " + (f"**{_f(value, '.2f', 'x')}**" if peer in headline
                                               else _f(value, ".2f", "x")))
        if ratios:
            lines += ["", f"Best verispec method: **{p['best_method']}**; tokens/s ratio {', '.join(ratios)}."]
    return "\n".join(lines)


def category_ratios(report: dict[str, Any], peer: str) -> str:
    """A table of every method's tokens/s over ``peer``'s per category, with the mean over Spec-Bench's categories."""
    from verispec.bench.stats import MethodStats, ratios_by_category, spec_bench_mean

    by_cat = ratios_by_category([MethodStats(**r) for r in report["per_category"]], peer)
    cats = list(dict.fromkeys(c for ratios in by_cat.values() for c in ratios))
    rows = [[method, *[_f(ratios.get(c), ".2f", "x") for c in cats], _f(spec_bench_mean(ratios), ".2f", "x")]
            for method, ratios in by_cat.items() if method not in _swept(report)]
    return f"Tokens/s over {peer}'s, per category:\n\n" + _table(["method", *cats, "Spec-Bench mean"], rows)


def _stability(report: dict[str, Any]) -> str:
    s = report["stability"]
    if s is None:
        return "_Not run (use --stability)._"
    results = s["results"]
    methods = list(dict.fromkeys(r["method"] for r in results))
    cases = list(dict.fromkeys(r["case"] for r in results))
    cell = {(r["case"], r["method"]): r for r in results}
    body = [[c, *[("pass" if cell[c, m]["passed"] else "**FAIL**") if (c, m) in cell else "·" for m in methods]]
            for c in cases]
    out = f"{s['passed']}/{s['total']} passed.\n\n" + _table(["case", *methods], body, "l" + "l" * len(methods))
    details = [f"- {r['case']} / {r['method']}: {_cell(r['detail'])}" for r in results if not r["passed"]]
    if details:
        out += "\n\nFailures:\n" + "\n".join(details)
    desc = [f"- {name}: {d}" for name, d in s["cases"].items()]
    return out + "\n\nCases:\n" + "\n".join(desc)


def _repeat_ratios(report: dict[str, Any]) -> str | None:
    """Per category and method: the median over repeats of each repeat's tokens/s ratio (range in brackets)."""
    spread = report.get("repeat_ratios")
    if not spread:
        return None
    refs = list(spread)
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for ref, by_method in spread.items():
        for method, by_cat in by_method.items():
            for cat, xs in by_cat.items():
                cells.setdefault((cat, method), {})[ref] = (f"{statistics.median(xs):.2f}x "
                                                            f"({min(xs):.2f}-{max(xs):.2f})")
    rows = [[cat, method, *[c.get(ref, "–") for ref in refs]] for (cat, method), c in
            sorted(cells.items(), key=lambda kv: kv[0][0] == "overall")]
    return _table(["category", "method", *[f"vs {ref}" for ref in refs]], rows, "ll" + "r" * len(refs))


def _clients_markdown(report: dict[str, Any]) -> str:
    """``report.md`` of a ``--clients`` run."""
    from verispec.bench.clients import table

    s, m, mach = report["settings"], report["models"], report["machine"]
    parts = [
        f"# {report['title']}", "",
        f"{report['date']} · target {m['target']} ({m['dtype']}, {m['weights']}) · draft {m['draft'] or '–'} "
        f"({m['draft_weights']}) · {mach.get('cpu')}, {mach.get('threads')} threads · torch "
        f"{report['versions'].get('torch')}", "",
        f"Dataset {s['dataset']}: {report['prompts']} prompts, at least two requests per client (the list again "
        f"from its start where it has fewer) · max_tokens {s['max_tokens']} · closed loop: each client keeps one "
        "request in flight; `alone`: one request after another through Engine.generate · "
        f"{s['repeats']} run{'s' if s['repeats'] > 1 else ''} per level and method, methods alternating (in "
        "reverse order every other repeat): "
        "each row is the run of median throughput; vs plain is the median of the per-repeat ratios to plain "
        "decoding's run (range in brackets). Beyond prefill: tokens per second of the wall time outside the "
        "target's prompt prefill (the same work in every method), against plain decoding's, paired by repeat.", "",
        table(report["clients"], "plain"), "",
    ]
    if report["warnings"]:
        parts += ["## Warnings", "", *[f"- {w}" for w in report["warnings"]], ""]
    if report["plots"]:
        parts += ["## Plots", "", *[f"![{Path(p).stem}]({p})" for p in report["plots"]], ""]
    return "\n".join(parts)


def markdown(report: dict[str, Any]) -> str:
    """``report.md``: every table of the report, then the plots."""
    if "clients" in report:
        return _clients_markdown(report)
    s, m, mach = report["settings"], report["models"], report["machine"]
    base = next(r for r in report["summary"] if r["kind"] == "baseline")
    n_prompts = len({(i["category"], i["prompt_id"]) for i in report["items"]})
    parts = [
        f"# {report['title']}", "",
        f"{report['date']} · target {m['target']} ({m['dtype']}, {m['weights']}) · draft {m['draft'] or '–'} "
        f"({m['draft_weights']}) · {mach.get('cpu')}, {mach.get('threads')} threads · torch "
        f"{report['versions'].get('torch')}", "",
        f"Dataset {s['dataset']}: {len(report['items'])} generations over {n_prompts} prompts · "
        f"max_tokens {s['max_tokens']} · "
        + ("greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-p {s['top_p']}, "
           f"top-k {s['top_k']}")
        + f" · repeats {s['repeats']} (median per-prompt wall time) · warm-up excluded", "",
        f"Baseline (plain decoding): **{base['tokens_per_s']:.2f} tokens/s** overall.", "",
        "## Summary (overall)", "", summary_table(report), "",
        "Speedup: tokens/s ratio to plain decoding on the same prompts. Mean accepted length: tokens per target "
        "forward (1.00 for plain decoding). Draft cost c: seconds to propose one draft token over seconds of one "
        "target scoring step.", "",
        "## Speedup per category", "", _pivot(report, "speedup", ".2f", "x"), "",
        "## Tokens/s per category", "", _pivot(report, "tokens_per_s", ".2f"), "",
        "## Mean accepted length per category", "", _pivot(report, "mean_accepted_length", ".2f"), "",
        *(["## Speedup vs k (mean accepted length)", "", sweep, ""] if (sweep := _k_sweep(report)) else []),
        *(["## Spread over repeats", "", "Each repeat's tokens/s (prefill included) over the reference's in the "
           "same repeat, runs seconds apart: the median over repeats (range in brackets).", "", spread, ""]
          if (spread := _repeat_ratios(report)) else []),
        "## Acceptance by draft position", "", _acceptance_by_position(report), "",
        "## Time per stage (share of wall time)", "", _stages(report), "",
        "## Output consistency against plain decoding", "", _consistency(report), "",
        *(["## Structured outputs", "", "Answers whose whole text parses as JSON and follows the prompt's schema "
           "(an answer in a Markdown fence does not); the constraint's time (grammar masks, draft cuts) per "
           "generated token.", "", structured_markdown(report["structured"]), ""] if report.get("structured") else []),
        "## Memory", "", _memory(report), "",
        "## Peers", "", _peers(report), "",
        "## Stability", "", _stability(report), "",
    ]
    if report["warnings"]:
        parts += ["## Warnings", "", *[f"- {w}" for w in report["warnings"]], ""]
    if report["plots"]:
        parts += ["## Plots", "", *[f"![{Path(p).stem}]({p})" for p in report["plots"]], ""]
    return "\n".join(parts)
