"""Publish the benchmark reports: docs/results/ tidied, docs/results.md and README.md's table rendered.

    python -m verispec.bench.render [docs/results] [--tidy] [--check]

No figure is typed by hand: every number, host and date comes from a report file that a step of
bench/run_all.sh wrote. The page states one host, the one README's table ran on: the steps that ran
there get a section each, and the steps that ran elsewhere one short table per host, each row a
headline figure and a link to its report. README.md gets one table, between the comment markers
``<!-- results:begin -->`` and ``<!-- results:end -->``.

``--tidy`` first makes the folder small (bench/run_all.sh does so after every run):

- a ``verispec bench`` report.json keeps what the page, report.md and the plots read; per prompt it
  keeps the token count, wall time and a digest of the output tokens instead of the tokens and text
  (``lean_report``); a full report stays in the run's own output folder;
- every ``*.json`` is written without indentation, its ``out``/``json`` setting naming where it is now;
- every plot is drawn again from the JSON beside it and stored as a 64-colour palette PNG.

``--check`` writes nothing and exits 1 if the page or README's table is not what the reports render.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import re
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verispec.bench.datasets import SPEC_BENCH_CATEGORIES
from verispec.bench.report import category_ratios
from verispec.bench.stats import OVERALL, MethodStats, ratios_by_category, spec_bench_mean
from verispec.bench.structured import markdown as structured_markdown

ROOT = Path(__file__).resolve().parents[2]
DEFAULT, README = ROOT / "docs" / "results", ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
KNOWN_MACHINE_KEYS = {"date", "cpu", "threads", "bf16_native", "python", "torch", "transformers"}
# README's table: the first of these steps that ran on the page's host (the host of the latest run).
README_STEPS = ("int4_long", "report")
PEER_STEP = "int4_long"  # its llama.cpp headline goes under README's table where it ran on another host
COLOURS = 64


# -- tidying --------------------------------------------------------------------------------------

def digest(token_ids: list[int]) -> str:
    """A short digest of an output's token ids: equal outputs, equal digests."""
    raw = hashlib.sha256(json.dumps(token_ids).encode()).digest()[:9]
    return base64.urlsafe_b64encode(raw).decode()


def lean_report(report: dict[str, Any]) -> dict[str, Any]:
    """A ``verispec bench`` report without what nothing published reads: the prompts' text, the outputs'
    tokens and text (a digest of the tokens instead), the per-request metrics and the checkout's commit."""
    out = dict(report)
    out["items"] = [{k: v for k, v in item.items() if k != "prompt"} for item in report["items"]]
    records = []
    for r in report["records"]:
        lean = {k: v for k, v in r.items() if k not in ("token_ids", "text", "metrics")}
        if "token_ids" in r:
            lean["digest"] = digest(r["token_ids"])
        records.append(lean)
    out["records"] = records
    out["versions"] = {k: v for k, v in (report.get("versions") or {}).items() if k != "git_commit"}
    return out


def _script(name: str) -> Any:
    """A script of bench/ (not a package) by file name, or None where the checkout has none."""
    path = ROOT / "bench" / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _relocate(data: Any, path: Path) -> Any:
    """Point a report's own ``out`` (its folder) and ``json`` (its file) settings at where it is now."""
    if not isinstance(data, dict):
        return data
    for key in ("settings", "args"):
        block = data.get(key)
        if isinstance(block, dict):
            if isinstance(block.get("out"), str):
                block["out"] = _rel(path.parent)
            if isinstance(block.get("json"), str):
                block["json"] = _rel(path)
    return data


def compact_json(path: Path) -> Any:
    data = _relocate(json.loads(path.read_text(encoding="utf-8")), path)
    if path.name == "report.json" and isinstance(data, dict) and "records" in data:
        data = lean_report(data)
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n",
                    encoding="utf-8")
    return data


def shrink_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        if im.mode == "P":  # a palette PNG already: quantizing it again would only change its bytes
            return
        small = im.convert("RGB").quantize(colors=COLOURS)
    small.save(path, optimize=True)


def plot_report(report: dict[str, Any], folder: Path) -> list[Path]:
    """The plots ``verispec bench`` draws, from report.json's per-category rows (or its clients sweep)."""
    from verispec.bench import plots

    if "per_category" not in report and "clients" not in report:  # another table named so (the grammar engines')
        return []
    if "clients" in report:
        drawn = plots.clients_sweep(report["clients"], folder / "clients.png", report["title"])
        return [drawn] if drawn is not None and report.get("plots") else []
    rows = [MethodStats(**{**r, "method": short(r["method"])}) for r in report["per_category"]]
    methods = report["methods"]
    sweep = frozenset(short(m["label"]) for m in methods if m["from_sweep"])
    families = {short(m["label"]): short(m["family"]) for m in methods if m["kind"] != "baseline"}
    title = report["title"]
    drawn = [plots.speedup_by_category(rows, folder / "speedup_by_category.png", title, sweep),
             plots.acceptance_by_position(rows, folder / "acceptance_by_position.png", title, sweep),
             plots.stage_breakdown(rows, folder / "stage_breakdown.png", title),
             plots.speedup_vs_k(rows, families, folder / "speedup_vs_k.png", title)]
    return [p for p in drawn if p is not None]


def plot_verify_cost(data: dict[str, Any], folder: Path) -> list[Path]:
    if (script := _script("verify_cost")) is None:
        return []
    args, info = data["args"], data["machine"]
    title = (f"{args['model']} ({args['dtype']}, {args.get('kernels', 'auto')} kernels) · {info['cpu']}, "
             f"{info['threads']} threads · {info['date']}")
    script.plot(data["rows"], folder / "verify_cost.png", title)
    return [folder / "verify_cost.png"]


PLOTTERS = {"report.json": plot_report, "verify_cost.json": plot_verify_cost}


def tidy(root: Path) -> None:
    drawn: set[Path] = set()
    for path in sorted(root.rglob("*.json")):
        data = compact_json(path)
        plotter = PLOTTERS.get(path.name)
        if plotter is not None and isinstance(data, dict):
            drawn.update(plotter(data, path.parent))
    for png in sorted(root.rglob("*.png")):
        if png not in drawn:
            print(f"note: {_rel(png)} has no JSON to redraw it from; kept as it is", file=sys.stderr)
        shrink_png(png)


# -- small helpers --------------------------------------------------------------------------------

def short(label: str) -> str:
    """A method label without a datastore path (it names the machine's cache, not the method)."""
    return label.split(":datastore=")[0]


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def md_body(path: Path) -> str:
    """A markdown report without its top heading and the script's 'wrote ...' lines."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines()
             if not ln.startswith("# ") and not ln.startswith("wrote ")]
    return "\n".join(lines).strip()


def table_lines(path: Path) -> str:
    return "\n".join(ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("|"))


def md_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a markdown file's first table, as {column: cell}."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("|")]
    if len(lines) < 2:
        return []
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return [dict(zip(cells[0], row, strict=False)) for row in cells[2:]]


def host(machine: dict[str, Any]) -> str:
    """The machine a report records, in words: CPU, threads, native bf16, torch, and anything else it records."""
    parts = [str(machine.get("cpu", "CPU not recorded"))]
    if machine.get("threads") is not None:
        parts.append(f"{machine['threads']} threads")
    if "bf16_native" in machine:
        parts.append("native bf16 dot products (AVX-512 BF16 or AMX)" if machine["bf16_native"]
                     else "no native bf16 dot products (neither AVX-512 BF16 nor AMX)")
    parts += [f"{k} {v}" for k, v in machine.items() if k not in KNOWN_MACHINE_KEYS and v not in (None, "", [])]
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)


def step_machine(folder: Path) -> dict[str, Any]:
    """The machine a step ran on: its machine.json, else the first report in it that records one."""
    if (folder / "machine.json").is_file():
        return load(folder / "machine.json")
    for path in sorted(folder.rglob("*.json")):
        data = load(path)
        if isinstance(data, dict) and isinstance(data.get("machine"), dict):
            return data["machine"]
    return {}


def run_of(folder: Path, date: str | None = None) -> str:
    date = date or step_machine(folder).get("date")
    return f"Run of {str(date)[:10]}." if date else "The report records no date."


def link(path: Path, base: Path, text: str) -> str:
    return f"[{text}]({path.relative_to(base).as_posix()})"


# -- verispec bench reports -----------------------------------------------------------------------

def rows_of(report: dict[str, Any]) -> list[MethodStats]:
    return [MethodStats(**r) for r in report["per_category"]]


def prompt_set(report: dict[str, Any]) -> str:
    """Which prompts, how many tokens, how decoded: from the report's settings and items."""
    s = report["settings"]
    per_cat = Counter(i["category"] for i in report["items"] if i.get("turn", 1) == 1)
    parts = []
    for name in s["dataset"].split(","):
        if name == "spec_bench":
            n_cats = len([c for c in per_cat if c in SPEC_BENCH_CATEGORIES])
            cats = f" ({', '.join(s['categories'])})" if s.get("categories") else ""
            parts.append(f"Spec-Bench, {s.get('per_category') or 'all'} prompts in each of {n_cats} categories"
                         f"{cats} (seed {s['seed']})")
        elif name == "humaneval":
            parts.append(f"the first {per_cat.get('humaneval', s.get('n'))} HumanEval problems")
        elif name.startswith("humaneval:"):
            parts.append(f"HumanEval problems {name.split(':', 1)[1]}")
        else:
            parts.append(f"`{name}` ({per_cat.get(name, 0)} requests)")
    decoding = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    if s.get("k") is None and s.get("k_policy") is None:
        decoding += ", verispec's defaults for whatever the method string leaves out"
    else:
        decoding += f", k = {s['k']} and k policy `{s['k_policy']}` unless the method string sets them"
    repeats = (f"; {s['repeats']} runs of each prompt per method, the median wall time counts"
               if s.get("repeats", 1) > 1 else "; one run of each prompt per method")
    return f"Prompts: {' and '.join(parts)}; {s['max_tokens']} new tokens, {decoding}{repeats}."


def models_line(report: dict[str, Any]) -> str:
    m = report["models"]
    draft = f", draft {m['draft']} ({m['draft_weights']})" if m.get("draft") else ""
    kernels = {"verispec": "; int4/int8 layers on verispec's CPU kernels",
               "verispec q8": "; int4/int8 layers on verispec's CPU kernels, on 8-bit activations (q8)",
               "stock": "; int4/int8 layers on PyTorch's stock kernels"}.get(m.get("quantized_kernels"), "")
    paths = {k: v for k, v in (m.get("activations") or {}).items() if v}
    if kernels and paths:  # what --kernels auto chose per model
        kernels = "; int4/int8 layers on verispec's CPU kernels, " + ", ".join(
            f"the {who} on {'8-bit' if v == 'q8' else v} activations" for who, v in paths.items())
    return f"Models: target {m['target']} ({m['weights']}, {m['dtype']}){draft}{kernels}."


def peers_line(report: dict[str, Any]) -> str | None:
    libs = (report.get("peers") or {}).get("libraries") or {}
    out = []
    for name, lib in libs.items():
        if lib.get("error"):
            continue
        if name == "llamacpp":
            extra = ("; its extra buffer types (weight repacking, AMX) off, as with them llama.cpp crashed here"
                     if lib.get("extra_buffer_types") is False else "")
            if "AMX" in (report.get("machine") or {}).get("cpu", "") and "AMX" not in lib.get("system_info", "AMX"):
                extra += "; built without AMX"
            out.append(f"llama.cpp (llama-cpp-python {lib.get('version')}, {lib.get('n_threads')} threads{extra}) on "
                       "the same GGUF file")
        elif name == "hf":
            out.append(f"transformers {lib.get('version') or ''} on the same weights ({lib.get('dtype')})")
    return f"Peers: {'; '.join(out)}, same prompt token ids." if out else None


def summary_table(report: dict[str, Any]) -> str:
    out = ["| method | tokens/s | speedup vs plain | mean accepted length | acceptance | same tokens as plain |",
           "|---|---:|---:|---:|---:|---:|"]
    match = {c["method"]: c.get("exact_match") for c in report.get("consistency", [])}
    for r in report["summary"]:
        out.append(f"| {short(r['method'])} | {r['tokens_per_s']:.2f} | {fmt(r['speedup'], '.2f', 'x')} | "
                   f"{fmt(r['mean_accepted_length'], '.2f')} | {fmt(r['acceptance_rate'], '.0%')} | "
                   f"{fmt(match.get(r['method']), '.0%')} |")
    return "\n".join(out)


def category_table(report: dict[str, Any]) -> str:
    rows = report["per_category"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    val = {(r["method"], r["category"]): r for r in rows}
    out = ["| category | " + " | ".join(map(short, methods)) + " |", "|---|" + "---:|" * len(methods)]
    for c in cats:
        out.append(f"| {c} | " + " | ".join(fmt(val[m, c]["speedup"], ".2f", "x") if (m, c) in val else "–"
                                            for m in methods) + " |")
    return "\n".join(out)


def has_peer(report: dict[str, Any], peer: str) -> bool:
    return any(r["method"] == peer for r in report["per_category"])


def best_line(report: dict[str, Any]) -> str | None:
    p = report.get("peers") or {}
    ratios = [f"{fmt(p.get('best_vs_' + peer.replace('-', '_')), '.2f', 'x')} {peer}"
              for peer in ("llamacpp-plain", "llamacpp-prompt-lookup", "hf-plain", "hf-assisted", "hf-prompt-lookup")
              if p.get("best_vs_" + peer.replace("-", "_")) is not None]
    if not p.get("best_method") or not ratios:
        return None
    return f"Best verispec method (highest overall tokens/s): `{short(p['best_method'])}`, {', '.join(ratios)}."


def bench_section(folder: Path, base: Path) -> list[str]:
    report = load(folder / "report.json")
    out = [run_of(folder, report["date"]), "", prompt_set(report), models_line(report)]
    if (peers := peers_line(report)):
        out.append(peers)
    out += ["", summary_table(report), ""]
    if len({r["category"] for r in report["per_category"]}) > 2:
        out += ["Speedup over plain decoding, per category:", "", category_table(report), ""]
    for peer in ("llamacpp-plain", "hf-plain"):
        if has_peer(report, peer):
            out += [re.sub(r":datastore=[^ |]*", "", category_ratios(report, peer)), ""]
    if (best := best_line(report)):
        out += [best, ""]
    plots = [p for p in ("speedup_by_category.png",) if (folder / p).is_file()]
    out += [f"Full report: {link(folder / 'report.md', base, 'report.md')}."] + [""]
    out += [f"![{Path(p).stem}]({(folder / p).relative_to(base).as_posix()})" for p in plots]
    return out


def bench_headline(folder: Path) -> str:
    """Every method's tokens/s over plain decoding's, and over llama.cpp plain decoding's where it ran."""
    report = load(folder / "report.json")
    name = {r["method"]: "plain" if r["kind"] == "baseline" else f"`{short(r['method'])}`" for r in report["summary"]}
    spec = [r for r in report["summary"] if r["kind"] == "verispec"]
    out = "over plain decoding: " + ", ".join(f"{name[r['method']]} {fmt(r['speedup'], '.2f', 'x')}" for r in spec)
    if has_peer(report, "llamacpp-plain"):
        by_cat = ratios_by_category(rows_of(report), "llamacpp-plain")
        out += "; over llama.cpp plain decoding: " + ", ".join(
            f"{name[m]} {fmt(ratios.get('overall'), '.2f', 'x')}" for m, ratios in by_cat.items() if m in name)
    return out


def structured_ratios(report: dict[str, Any], decode: bool = False) -> tuple[float, float] | None:
    """(constrained plain over plain tokens/s, the constrained default's speedup over its own plain decoding
    as a share of the unconstrained default's), or None where the run lacks a method. ``decode``: tokens/s
    outside the prompts' prefill (which a constraint does not touch, and which weighs more in shorter answers)."""
    tps = {r["method"]: r["tokens"] / (r["wall_s"] * (1 - r["stage_share"]["prefill"])) if decode
           else r["tokens_per_s"] for r in report["summary"] if r["category"] == "overall"}
    need = ("plain", "none:constrain=1", "hybrid", "hybrid:constrain=1")
    if not all(tps.get(m) for m in need):
        return None
    plain, cplain, spec, cspec = (tps[m] for m in need)
    return cplain / plain, (cspec / cplain) / (spec / plain)


def structured_section(folder: Path, base: Path) -> list[str]:
    report = load(folder / "report.json")
    out = bench_section(folder, base)
    if (ratios := structured_ratios(report)) is not None:
        out += [f"Constrained plain decoding makes **{ratios[0]:.2f}x** the tokens/s of unconstrained plain "
                f"decoding; the constrained default keeps **{ratios[1]:.2f}x** of the unconstrained default's speedup "
                "over plain decoding (each over its own plain decoding).", ""]
    if (dec := structured_ratios(report, decode=True)) is not None:
        out += [f"Outside the prefill, where a constraint changes nothing, the same ratios are {dec[0]:.2f}x and "
                f"{dec[1]:.2f}x: constrained answers are shorter, so the same prompts' prefill weighs more in their "
                "tokens/s.", ""]
    if report.get("structured"):
        out += ["Answers that parse as JSON and follow their schema, and the constraint's time per token:", "",
                structured_markdown(report["structured"]), ""]
    engines = folder / "engines" / "README.md"
    if engines.is_file():
        out += [md_body(engines), ""]
    return out


def structured_headline(folder: Path) -> str:
    report = load(folder / "report.json")
    ratios = structured_ratios(report)
    valid = [r for r in report.get("structured") or [] if r["constrained"]]
    parts = [f"constrained plain {ratios[0]:.2f}x plain, constrained default keeps {ratios[1]:.2f}x of the speedup"
             ] if ratios else []
    parts += [f"{min(r['schema_valid'] for r in valid):.0%} schema-valid"] if valid else []
    return "; ".join(parts) or bench_headline(folder)


def ablation_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ``off=`` method: its rules, the default's and its own speedup over plain decoding (medians over the
    repeats), each repeat's ratio of the two, and the spread of the default's own speedup over the repeats."""
    ratios = (report.get("repeat_ratios") or {}).get("plain", {})
    default = ratios.get("hybrid", {}).get(OVERALL)
    rows = []
    for label, by_cat in ratios.items():
        rules = label.partition("off=")[2]
        if not rules or not default:
            continue
        mine = by_cat.get(OVERALL, [])
        rows.append({"rules": rules.replace("+", ", "), "with": statistics.median(default),
                     "without": statistics.median(mine), "ratios": [a / b for a, b in zip(mine, default, strict=False)],
                     "spread": max(default) / min(default) - 1.0})
    return rows


def ablation_section(folder: Path, base: Path) -> list[str]:
    report = load(folder / "report.json")
    rows = ablation_rows(report)
    out = [run_of(folder, report["date"]), "", prompt_set(report), models_line(report), "",
           "| rule switched off | defaults vs plain | without the rule vs plain | without / with, per repeat | "
           "spread of the defaults over repeats |", "|---|---|---|---|---|"]
    out += [f"| {r['rules']} | {r['with']:.3f}x | {r['without']:.3f}x | "
            f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | {100 * r['spread']:.1f}% |" for r in rows]
    return [*out, "", f"Full report: {link(folder / 'report.md', base, 'report.md')}.", ""]


def ablation_headline(folder: Path) -> str:
    rows = ablation_rows(load(folder / "report.json"))
    spread = max((r["spread"] for r in rows), default=0.0)
    return "tokens/s without each rule against with it: " + ", ".join(
        f"{r['rules']} {100 * (statistics.median(r['ratios']) - 1):+.1f}%" for r in rows if r["ratios"]) + \
        f" (spread of the defaults over repeats {100 * spread:.1f}%)"


def clients_section(folder: Path, base: Path) -> list[str]:
    """A ``verispec bench --clients`` report: the closed-loop sweep's table and plot."""
    from verispec.bench.clients import table

    report = load(folder / "report.json")
    s = report["settings"]
    out = [run_of(folder, report["date"]), "",
           f"Prompts: {report['prompts']} of `{s['dataset']}`, at least two requests per client; {s['max_tokens']} "
           f"new tokens; {s['repeats']} runs per level and method, the run of median throughput shown, vs plain the "
           "median of the per-repeat ratios (range in brackets).", models_line(report), "",
           table(report["clients"], "plain"), ""]
    if (folder / "clients.png").is_file():
        out.append(f"![clients]({(folder / 'clients.png').relative_to(base).as_posix()})")
    return out


def clients_headline(folder: Path) -> str:
    rows = [r for r in load(folder / "report.json")["clients"] if r["method"] != "plain"]
    return "tokens/s over plain decoding's: " + ", ".join(
        f"`{r['method']}` at {r['clients']} {'client' if str(r['clients']) == '1' else 'clients'} "
        f"{r['vs_plain']:.2f}x" for r in rows)


def report_parts(folder: Path) -> list[Path]:
    """The ``verispec bench`` reports of a step: its folder's, else those of its subfolders."""
    if (folder / "report.json").is_file():
        return [folder]
    return sorted(p for p in folder.iterdir() if (p / "report.json").is_file())


def report_section(folder: Path, base: Path) -> list[str]:
    report = load(folder / "report.json")
    return clients_section(folder, base) if "clients" in report else bench_section(folder, base)


def report_headline(folder: Path) -> str:
    return clients_headline(folder) if "clients" in load(folder / "report.json") else bench_headline(folder)


def stability_section(folder: Path, base: Path) -> list[str]:
    report = load(folder / "report.json")
    st = report.get("stability") or {}
    out = [run_of(folder, report["date"]), "", prompt_set(report), models_line(report), ""]
    if not st:
        return out + ["The report holds no stability results."]
    results = st["results"]
    methods = list(dict.fromkeys(r["method"] for r in results))
    cell = {(r["case"], r["method"]): r["passed"] for r in results}
    out += [f"{st['passed']} of {st['total']} cases passed.", "", "| case | " + " | ".join(methods) + " |",
            "|---|" + "---|" * len(methods)]
    for case in dict.fromkeys(r["case"] for r in results):
        out.append(f"| {case} | " + " | ".join(
            ("pass" if cell[case, m] else "**FAIL**") if (case, m) in cell else "·" for m in methods) + " |")
    return out + ["", f"Full report: {link(folder / 'report.md', base, 'report.md')}."]


def stability_headline(folder: Path) -> str:
    st = load(folder / "report.json").get("stability") or {}
    return f"{st['passed']} of {st['total']} cases passed" if st else "no stability results"


# -- the other steps ------------------------------------------------------------------------------

def concurrency_section(folder: Path, base: Path) -> list[str]:
    out = []
    for part in sorted(p for p in folder.iterdir() if (p / "concurrency.json").is_file()):
        data = load(part / "concurrency.json")
        clients = ", ".join(dict.fromkeys(str(r["concurrency"]) for r in data["rows"]))
        out += [f"**{clients} clients** ({link(part / 'concurrency.md', base, 'report')})", "",
                run_of(part, data["machine"].get("date")), "", md_body(part / "concurrency.md"), "",
                f"![concurrency {clients}]({(part / 'concurrency.png').relative_to(base).as_posix()})", ""]
    return out


def concurrency_headline(folder: Path) -> str:
    cells = []
    for part in sorted(p for p in folder.iterdir() if (p / "concurrency.json").is_file()):
        for r in load(part / "concurrency.json")["rows"]:
            if r["mode"] == "policy":
                cells.append(f"{r['concurrency']} clients {r['vs_plain']:.2f}x")
    return "the defaults' tokens/s over plain decoding's: " + ", ".join(cells)


def verify_cost_section(folder: Path, base: Path) -> list[str]:
    data = load(folder / "verify_cost.json")
    a = data["args"]
    return [run_of(folder, data["machine"].get("date")), "",
            f"Target {a['model']} ({a['dtype']}, {a.get('kernels', 'auto')} kernels): t(M), the fastest of "
            f"{a['reps']} forwards scoring M tokens, over t(1); plain tok/s: plain greedy decoding of "
            f"{a['decode_tokens']} tokens, best of {a['reps']}.", "",
            table_lines(folder / "verify_cost.md"), "",
            f"![verify cost]({(folder / 'verify_cost.png').relative_to(base).as_posix()})"]


def verify_cost_headline(folder: Path) -> str:
    rows = load(folder / "verify_cost.json")["rows"]
    m = len(rows[0]["ratio"])
    return f"t({m})/t(1): " + "; ".join(f"{r['format']} {r['ratio'][-1]:.2f}" for r in rows)  # format names kernels


def md_section(files: list[str]) -> Callable[[Path, Path], list[str]]:
    def render(folder: Path, base: Path) -> list[str]:
        out = [run_of(folder), ""]
        for name in files:
            if (folder / name).is_file():
                out += [md_body(folder / name), ""]
        return out
    return render


def peer_spread_headline(folder: Path) -> str:
    overall = load(folder / "peer_spread.json")["ratios"]["overall"]
    cells = [f"{'`' + m + '`' if m != 'plain' else m} {statistics.median(runs[0]):.2f}x"
             for m, runs in overall.items()]
    return "tokens/s over llama.cpp plain decoding's, all prompts, median of the repeats: " + ", ".join(cells)


def prefix_reuse_headline(folder: Path) -> str:
    cells = [f"{r['method']}: {r['without_reuse']['ttft_s']:.2f} s to {r['with_reuse']['ttft_s']:.2f} s "
             f"({r['speedup']:.1f}x)" for r in load(folder / "prefix_reuse.json")["runs"]]
    return "follow-up turn's time to first token without reuse and with it, " + "; ".join(cells)


def server_headline(folder: Path) -> str:
    data = load(folder / "server_ready.json")
    spec = next(r for r in data["requests"] if r["speculative"])
    plain = next(r for r in data["requests"] if not r["speculative"])
    return (f"launch to ready {data['ready_s']:.1f} s; first speculative request {spec['tokens_per_s']:.1f} "
            f"tokens/s, plain {plain['tokens_per_s']:.1f}")


def quality_headline(folder: Path) -> str:
    paths = load(folder / "quality.json")["paths"]
    base = next(p for p in paths if p["path"].startswith("bf16"))
    cells = [f"{p['path']} {p['perplexity']:.3f} ({100 * (p['perplexity'] / base['perplexity'] - 1):+.2f}%)"
             + (f", pass@1 {p['passed']}/{p['problems']}" if p["problems"] else "") for p in paths]
    return "perplexity: " + "; ".join(cells)


def advise_headline(folder: Path) -> str:
    rec = load(folder / "advise.json")["recommended"]
    err = f", predicted {rec['predicted']:.2f}x (error {rec['prediction_error']:.0%})" if rec["predicted"] else ""
    return f"recommended `{rec['label']}`: measured {rec['measured']:.2f}x plain decoding{err}"


def sampling_headline(folder: Path) -> str:
    cells = [f"{r['mode']} {r['vs_greedy']:.2f}x" for r in load(folder / "sampling_speed.json")["rows"]
             if "vs_greedy" in r]
    return "tokens/s over greedy plain decoding's: " + ", ".join(cells)


def kernels_headline(folder: Path) -> str:
    spans: dict[str, list[float]] = {}
    for r in md_rows(folder / "kernels.md"):
        spans.setdefault(r["kernel"], []).append(float(r["t(16)/t(1)"]))
    return "t(16)/t(1) over the projections: " + ", ".join(f"{k} {min(v):.2f}–{max(v):.2f}"
                                                         for k, v in spans.items())


def fused_paths_headline(folder: Path) -> str:
    decode = load(folder / "fused_paths.json")["decode"]
    cells = [f"{r['model']} {r['python_ops_s'] / r['fused_ops_s']:.3f}x" for r in decode if r.get("fused_ops_s")]
    return "decode step, the Python path's time over the fused small ops': " + ", ".join(cells)


# -- the page -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Section:
    step: str  # the folder, and bench/run_all.sh's step
    title: str
    what: str  # what it measures
    render: Callable[[Path, Path], list[str]]  # its section, where it ran on the page's host
    headline: Callable[[Path], str]  # its row, where it ran on another
    report: str  # the file that row links to
    own: bool = False  # render and headline read report.json themselves (else a report.json there wins)

    def lines(self, folder: Path, base: Path) -> list[str]:
        parts = [] if self.own else report_parts(folder)
        if parts == [folder]:
            return report_section(folder, base)
        if parts:  # one report per subfolder (concurrency's 1-4 and 8-16 clients)
            return [line for p in parts for line in
                    [f"**{p.name}** ({link(p / 'report.md', base, 'report')})", "", *report_section(p, base), ""]]
        return self.render(folder, base)

    def row(self, folder: Path) -> tuple[str, str]:
        """Its headline figure, and the report a row links to."""
        parts = [] if self.own else report_parts(folder)
        if parts:
            return "; ".join(report_headline(p) for p in parts), (parts[0] / "report.md").relative_to(folder).as_posix()
        return self.headline(folder), self.report


def bench(step: str, title: str, what: str) -> Section:
    return Section(step, title, what, bench_section, bench_headline, "report.md", own=True)


def script(step: str, title: str, what: str, name: str, headline: Callable[[Path], str]) -> Section:
    return Section(step, title, what, md_section([f"{name}.md"]), headline, f"{name}.md")


SECTIONS: list[Section] = [
    bench("report", "The report split: verispec's defaults against plain decoding and fixed k",
          "The int4 pair under verispec's defaults (`hybrid`: the cost policy, a 32768-token draft head, the "
          "confidence stop and a 256-token draft window) against plain decoding and against the same settings at a "
          "fixed k of 2, 3 and 5, on prompts no default was tuned on: Spec-Bench sampled with seed 1, HumanEval "
          "problems 100-119 and the packaged chat-formatted coding requests (`chat_code`). The defaults were chosen "
          "on Spec-Bench seed 0 and HumanEval 0-19."),
    Section("ablation", "The cost policy's rules, one switched off at a time",
            "The int4 pair on the tune split (Spec-Bench seed 0, HumanEval 0-5 and the code edits built on them, "
            "`code_edit_tune`), 128 new tokens, 2 repeats: verispec's defaults (`hybrid`) against the same with one "
            "rule of the cost policy switched off (`hybrid:off=RULE`). A rule stays only where switching it off costs "
            "more than the run-to-run spread: `probes` (a plainly decoding row drafts a short probe now and then) and "
            "`lookup_cut` (a free lookup is cut where the step's goodput peaks). `margin` (speculate only where the "
            "predicted gain is at least 5%) is part of the rule itself, an argmax with a margin for what the cost "
            "model leaves out, and is shown for what it is worth here. Three more were ablated in the run "
            "shown and removed for buying nothing beyond the spread: `catch_up` (a row whose draft model must "
            "first read context joins only if the saving over its expected remaining tokens wins that back), "
            "`context` (the step's cost grows with the context it attends to) and `learning` (measured steps "
            "refine the profiled costs); a rerun ablates the three that stay.",
            ablation_section, ablation_headline, "report.md", own=True),
    Section("structured", "Structured outputs: answers constrained to a JSON schema",
            "The int4 pair on the first 30 of the packaged `json_extract` requests (extraction requests written for "
            "verispec, each with its JSON schema: nested objects, arrays, enums), answers up to 512 tokens (one, "
            "`json_extract-05`, a recipe, needs 533 and is cut at 512 under every method): plain "
            "decoding and verispec's defaults, each unconstrained and constrained to the request's schema "
            "(`constrain=1`, what a client's `response_format` asks for). Nothing was tuned on these prompts. The "
            "grammar engines' mask times on Qwen's 151,936-token vocabulary follow (`python -m "
            "verispec.bench.grammar_engines`, with xgrammar and outlines-core installed beside llguidance).",
            structured_section, structured_headline, "report.md", own=True),
    bench("processing", "What penalties and logprobs cost",
          "The int4 pair, plain decoding on the report split's Spec-Bench prompts (seed 1, two per category), "
          "256 new tokens, 3 repeats: without processing, with presence and frequency penalties of 0.5, and with "
          "`logprobs=5` (each token's log-probability and the five likeliest)."),
    bench("code_edit", "Code edits: lookups that copy the prompt",
          "The int4 pair on the packaged `code_edit` requests (rewrite a quoted Python function), 256 new tokens: "
          "verispec's defaults against prompt lookup (`ngram`), suffix decoding (`suffix`) and the hybrid with the "
          "suffix lookup, the lookups at k = 16 so a long copy is not cut short, and without the index of earlier "
          "outputs (`global=0`: every method answers the same prompts, and the index would hand a later method an "
          "earlier one's answer). No setting was tuned on these prompts."),
    bench("trees", "Token trees: suffix drafts with several ways per node",
          "The int4 pair, the hybrid with the suffix lookup drafting chains (`width=1`, the default) against token "
          "trees of up to 3 continuations per node (`width=3`, the same node budget), without the index of earlier "
          "outputs, on the packaged `code_edit` and `chat_code` requests; 256 new tokens. The width was looked at "
          "on 12 edit requests built from HumanEval 0-19 (`--dataset code_edit_tune`), not on these."),
    bench("int4_long", "int4 target and draft against llama.cpp, long answers",
          "The report split (as above) plus the packaged `code_edit` requests, 256 new tokens: plain decoding "
          "and verispec's defaults (kernels `auto`) against llama.cpp plain decoding. The target runs from its "
          "GGUF's Q4_K tensors as int4 (its Q6_K tensors as int8), the draft as `int4-all`, through verispec's "
          "CPU kernels; llama.cpp runs the same GGUF file on the same prompt token ids. Tokens/s include the "
          "prefill. The ratio table divides every method's tokens/s by llama.cpp plain decoding's, per category; "
          "its last column is the mean over Spec-Bench's six categories."),
    bench("predicted", "Predicted outputs: code edits with the quoted code as the prediction",
          "The int4 pair on 8-bit activations (`--kernels q8`) on the packaged `code_edit` requests, each answer "
          "run to its end (up to 1024 tokens): verispec's defaults without a prediction (`hybrid`), with the "
          "request's quoted function as the prediction (`hybrid:predict=1`, what a client sends as OpenAI's "
          "`prediction`), and with another request's function (`hybrid:predict=other`: an unrelated "
          "prediction), against llama.cpp plain decoding on the same GGUF. Nothing was tuned on these prompts "
          "(the prediction drafter was looked at on the 12 edits of `--dataset code_edit_tune`)."),
    bench("predicted_polyglot", "Predicted outputs: code edits in Go, TypeScript, Rust, SQL and bash",
          "As the predicted outputs, on the packaged `code_edit_polyglot` requests (15 edits, three per language)."),
    Section("peer_spread", "Run-to-run spread of the ratios against llama.cpp",
            "The ratios against llama.cpp on 8-bit activations, repeated to give their "
            "spread, on the packaged chat-formatted coding requests and Spec-Bench's translation and summarization "
            "prompts (seed 1). llama.cpp plain decoding is one more method of the interleaved run: every method "
            "decodes a prompt in turn, repeat after repeat, so each repeat's ratio compares runs seconds apart.",
            md_section(["peer_spread.md"]), peer_spread_headline, "peer_spread.md"),
    Section("stability", "Stability on odd inputs",
            "The stability suite of `verispec bench --stability`: context limits, template markup, emoji, control "
            "characters, mixed scripts, an empty prompt, one token and a drafter that never proposes; each case "
            "must give plain decoding's tokens, or refuse as plain decoding refuses.",
            stability_section, stability_headline, "report.md", own=True),
    Section("concurrency", "Concurrency: one engine, many slots",
            "A closed loop of clients over Spec-Bench prompts on one engine with a slot per client (`verispec "
            "bench --clients`), plain decoding against verispec's defaults (`policy` or `hybrid`: the cost policy "
            "over all running rows) and, at one client, the same requests through `generate` one after another "
            "(`alone`). Beyond prefill: throughput over the wall time outside the target's prompt prefill, which is "
            "the same work in every mode.", concurrency_section, concurrency_headline, "1-4/concurrency.md"),
    script("prefix_reuse", "Prefix reuse: a chat's follow-up turn",
           "`bench/prefix_reuse.py`: a ~1,000-token conversation (a code file, a question and the model's answer), "
           "then a follow-up turn, on an engine with prefix reuse and on one without, per spec (plain decoding, and "
           "the draft model at a fixed k so that the first step drafts). With reuse the follow-up lands in the slot "
           "the conversation left and prefills only its new tokens.", "prefix_reuse", prefix_reuse_headline),
    script("server", "Server: launch to ready, and the first requests",
           "`bench/server_ready.py`: `verispec serve` on the pair with its default settings, `/health` polled from "
           "launch; once it answers 200, chat requests one at a time (greedy, speculative under the server's "
           "defaults, then plain, then speculative again). The warm-up profiles before ready, so the first "
           "speculative request runs no profiling.", "server_ready", server_headline),
    script("sampling", "What sampling costs",
           "The int4 pair decoding the same prompts greedily, at a temperature and with "
           "top-p, plainly and under verispec's defaults, side by side; the verification stage (distributions, "
           "acceptance test, draw) against the scoring stage (the target forward), from the engine's stage timers.",
           "sampling_speed", sampling_headline),
    Section("verify_cost", "Verification cost of the whole target forward",
            "`bench/verify_cost.py`: t(M)/t(1) for M scored tokens over a 64-token context, per weight format; "
            "`int4, q8` and `int8, q8`: the quantized layers on 8-bit activations (`--kernels q8`).",
            verify_cost_section, verify_cost_headline, "verify_cost.md"),
    bench("q8", "The activation path `--kernels auto` picks, end to end",
           "The int4 pair under `--kernels auto` (here: the activation path it timed faster at load for each model) "
           "against `--kernels bf16` (bf16 activations), two engines decoding the same prompts (the report split's "
           "Spec-Bench sample and the first 4 of HumanEval 100-119, `chat_code` and `code_edit`), plainly and under "
           "verispec's defaults, 2 repeats, side by side."),
    script("quality", "Quality gate for the kernels",
           "`verispec bench --quality`: the int4 target's perplexity on about 6,000 tokens of code (HumanEval "
           "canonical solutions 120-163) and prose (standard-library docstrings), scored 8 tokens per forward as "
           "a verification step scores them, under bf16 and 8-bit activations and under llama.cpp on the same "
           "GGUF, and pass@1 on HumanEval problems 100-119 (greedy) under each activation path. A path passes "
           "within 0.5% of bf16 activations' perplexity; `--kernels auto` reads the measurement.", "quality",
           quality_headline),
    script("advise", "`verispec advise` on the report split",
           "`verispec advise` on the int4 pair and the report split's prompts (as above), 128 new tokens: plain "
           "decoding and each drafter at a fixed k of 5 calibrate; the advisor predicts every drafter at k = 1..5 "
           "from the cost policy's profiled curves and the calibration's acceptance by depth, measures plain "
           "decoding, the defaults, the three best-predicted configurations and the other activation path in a "
           "second pass, and recommends what that pass measured fastest ([docs/bench.md](bench.md#which-"
           "configuration-to-run-verispec-advise)).", "advise", advise_headline),
    script("fused_paths", "Fused forward paths",
           "`bench/fused_paths.py`: the prefill's attention through the fused `attend` kernel against SDPA, and "
           "decode steps with projections called straight into the kernels against module calls, and decode steps "
           "through the fused small ops (norms, attention, silu * up) against PyTorch's ops, alternating in one "
           "process.", "fused_paths", fused_paths_headline),
    script("kernels", "Per-projection kernels",
           "`bench/kernel_bench.py`: t(M) per projection shape of the 1.5B, PyTorch's stock int4/int8/bf16 kernels "
           "against verispec's, weights streamed from DRAM.", "kernels", kernels_headline),
]

INTRO = """\
# Results

<!-- Rendered by `python -m verispec.bench.render` from the reports in docs/results/: edit
verispec/bench/render.py or rerun the benchmarks, not this file. -->

Every figure on this page comes from a report in [results/](results/), written by one step of
[bench/run_all.sh](../bench/run_all.sh) (`make bench`); a rerun replaces them. In `verispec bench` runs
the methods generate prompt by prompt, interleaved, in one process, so their ratios are measured side by
side, each method prefilling every prompt itself (no prefix reuse between them); absolute tokens/s compare
only within a section (a shared host's speed varies from run to run).

How to read the tables ([docs/bench.md](bench.md) has the details): **tokens/s** is generated tokens over
the summed wall time of the requests, prefill included; **speedup vs plain** is a method's tokens/s over
plain decoding's on the same prompts; **mean accepted length** is tokens per target forward (1.00 for plain
decoding); **acceptance** is accepted over drafted tokens; **same tokens as plain** is the share of prompts
whose greedy output equals plain decoding's token for token (verification is exact; in bf16 a forward can
round differently when it scores several tokens than one, which can flip a near-tie, and a peer computes
with its own kernels). Method strings (`hybrid:policy=cost,vocab=32768`, ...) are those of
[`verispec bench --methods`](bench.md#methods).
"""


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def page_host(root: Path, present: list[Section]) -> str:
    """The host of the latest run of README's table (the report split, the long answers), else of the latest
    run: the page shows what the current code does there, and its main table comes from that host."""
    main = [s for s in present if s.step in README_STEPS] or present
    latest = max(main, key=lambda s: str(step_machine(root / s.step).get("date", "")))
    return host(step_machine(root / latest.step))


def other_host_table(root: Path, base: Path, sections: list[Section]) -> list[str]:
    out = ["| result | run of | figures | report |", "|---|---|---|---|"]
    for s in sections:
        folder = root / s.step
        date = step_machine(folder).get("date", "–")
        headline, report = s.row(folder)
        out.append(f"| {s.title} (`{s.step}`) | {date} | {headline} | {link(folder / report, base, report)} |")
    return out


def results_page(root: Path, base: Path) -> str:
    present = [s for s in SECTIONS if (root / s.step).is_dir()]
    if not present:
        return INTRO + "\nNo reports yet.\n"
    main = page_host(root, present)
    here = [s for s in present if host(step_machine(root / s.step)) == main]
    elsewhere: dict[str, list[Section]] = {}
    for s in present:
        if s not in here:
            elsewhere.setdefault(host(step_machine(root / s.step)), []).append(s)
    out = [INTRO, f"**Host**: {main}. Every section below ran there, on the date it names; the runs on other hosts "
           "are in one table per host at the end.", "", "## Contents", ""]
    out += [f"- [{s.title}](#{anchor(s.title)}) (`{s.step}`)" for s in here]
    if elsewhere:
        out.append("- [Other hosts](#other-hosts)")
    for s in here:
        out += ["", f"## {s.title}", "", f"Step `{s.step}` of run_all.sh. {s.what}", "", *s.lines(root / s.step, base)]
    if elsewhere:
        out += ["", "## Other hosts", "", "Steps of run_all.sh that ran on another host, a headline figure each; "
                "the linked report has the rest."]
        for other, sections in elsewhere.items():
            out += ["", f"**{other}**", "", *other_host_table(root, base, sections)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip() + "\n"


CODE_COLUMNS = {"humaneval": "HumanEval", "chat_code": "chat code", "code_edit": "code edits"}


def readme_table(root: Path, base: Path) -> str:
    """README's one table: the page host's long-answer int4 run against plain decoding and llama.cpp, else its
    report split; under it, the llama.cpp headline of another host's long-answer run."""
    present = [s for s in SECTIONS if (root / s.step / "report.json").is_file()]
    main = page_host(root, present) if present else ""
    steps = [step for step in README_STEPS if any(s.step == step for s in present)
             and host(step_machine(root / step)) == main]
    if not steps:
        return f"_No {' or '.join(README_STEPS)} report in docs/results/._"
    folder = root / steps[0]
    report = load(folder / "report.json")
    s, m = report["settings"], report["models"]
    rows = rows_of(report)
    peer = "llamacpp-plain" if has_peer(report, "llamacpp-plain") else None
    by_cat = ratios_by_category(rows, peer) if peer else {}
    match = {c["method"]: c.get("exact_match") for c in report.get("consistency", [])}
    head = "| method | tokens/s | vs plain |"
    sep = "|---|---:|---:|"
    # The code categories the run has, each a column of its own against llama.cpp.
    code = [c for c in CODE_COLUMNS if any(c in v for v in by_cat.values())]
    if peer:
        head += " vs llama.cpp plain | Spec-Bench mean vs llama.cpp |" + "".join(
            f" {CODE_COLUMNS[c]} vs llama.cpp |" for c in code)
        sep += "---:|---:|" + "---:|" * len(code)
    out = [f"Host: {host(report['machine'])}; run of {report['date'][:10]}.",
           prompt_set(report),
           f"Target {m['target']} ({m['weights']}), draft {m['draft']} ({m['draft_weights']})"
           + ("; llama.cpp plain decoding on the same GGUF file." if peer else "."),
           f"Report: {link(folder / 'report.md', base, folder.relative_to(base).as_posix())}; rendered by "
           "`python -m verispec.bench.render`.", "",
           head + " same tokens as plain |", sep + "---:|"]
    for r in report["summary"]:
        if r["method"] == peer:
            continue
        line = f"| {short(r['method'])} | {r['tokens_per_s']:.2f} | {fmt(r['speedup'], '.2f', 'x')} |"
        if peer:
            ratios = by_cat.get(r["method"], {})
            line += f" {fmt(ratios.get('overall'), '.2f', 'x')} | {fmt(spec_bench_mean(ratios), '.2f', 'x')} |"
            line += "".join(f" {fmt(ratios.get(c), '.2f', 'x')} |" for c in code)
        out.append(line + f" {fmt(match.get(r['method']), '.0%')} |")
    if peer:
        p = next(r for r in report["summary"] if r["method"] == peer)
        out += ["", f"llama.cpp plain decoding made {p['tokens_per_s']:.2f} tokens/s on the same prompts "
                f"({s['max_tokens']} new tokens each)."]
    elif (root / PEER_STEP / "report.json").is_file():
        other = root / PEER_STEP
        out += ["", f"Against llama.cpp on the same GGUF file, long answers, {host(step_machine(other))}, run of "
                f"{str(step_machine(other).get('date', '–'))[:10]}: {bench_headline(other)} "
                f"({link(other / 'report.md', base, 'report')})."]
    return "\n".join(out)


def splice(text: str, block: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + "\n" + text[end:]


def rendered(root: Path) -> list[tuple[Path, str]]:
    """(file, text) for the page beside ``root`` (docs/results -> docs/results.md) and, for the published
    folder only, README.md with its table."""
    outputs = [(root.parent / f"{root.name}.md", results_page(root, root.parent))]
    if root == DEFAULT:
        readme = README.read_text(encoding="utf-8")
        outputs.append((README, splice(readme, readme_table(root, ROOT)) if BEGIN in readme and END in readme
                        else readme))
    return outputs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = [a for a in argv if not a.startswith("--")]
    unknown = [a for a in argv if a.startswith("--") and a not in ("--check", "--tidy")]
    if unknown or len(args) > 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root = Path(args[0]).resolve() if args else DEFAULT
    if "--check" in argv:
        stale = [p for p, new in rendered(root) if not p.is_file() or p.read_text(encoding="utf-8") != new]
        for p in stale:
            print(f"{p} is not what `python -m verispec.bench.render` renders from {root}", file=sys.stderr)
        return 1 if stale else 0
    if "--tidy" in argv:
        tidy(root)
    for p, new in rendered(root):
        if not p.is_file() or p.read_text(encoding="utf-8") != new:
            p.write_text(new, encoding="utf-8")
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
