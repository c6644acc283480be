"""Render docs/results.md and README.md's results table from the reports in docs/results/.

    python bench/readme_tables.py [docs/results] [--check]

No figure is typed by hand: every number, host and date below comes from a report file that a
step of bench/run_all.sh (or bench/gpu_check.py) wrote. README.md gets one table, between the
comment markers ``<!-- results:begin -->`` and ``<!-- results:end -->``. ``--check`` writes
nothing and exits 1 if either file is not what the reports render.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from verispec.bench.datasets import SPEC_BENCH_CATEGORIES
from verispec.bench.report import category_ratios
from verispec.bench.stats import MethodStats, ratios_by_category, spec_bench_mean

ROOT = Path(__file__).resolve().parent.parent
DEFAULT, README = ROOT / "docs" / "results", ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
KNOWN_MACHINE_KEYS = {"date", "cpu", "threads", "bf16_native", "python", "torch", "transformers"}


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


def provenance(folder: Path, machine: dict[str, Any] | None = None, date: str | None = None) -> str:
    """'Host: ... · run of DATE', from the report's own record, else the step's machine.json, else its caption."""
    if machine is None and (folder / "machine.json").is_file():
        machine = load(folder / "machine.json")
    date = date or (machine or {}).get("date")
    if machine:
        return f"Host: {host(machine)}. Run of {str(date)[:10]}." if date else f"Host: {host(machine)}."
    for md in sorted(folder.glob("*.md")) + sorted(folder.glob("*.txt")):
        for line in md.read_text(encoding="utf-8").splitlines():
            if re.search(r"\b\d{4}-\d{2}-\d{2}\b", line) and not line.startswith(("|", "wrote ")):
                return "Host and date: as the report's caption below records them."
    return "The report records no host or date."


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
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)]
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


def bench_section(folder: Path, base: Path, categories: bool = True) -> list[str]:
    report = load(folder / "report.json")
    out = [provenance(folder, report["machine"], report["date"]), "", prompt_set(report), models_line(report)]
    if (peers := peers_line(report)):
        out.append(peers)
    out += ["", summary_table(report), ""]
    if categories and len({r["category"] for r in report["per_category"]}) > 2:
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


def stability_section(folder: Path, base: Path) -> list[str]:
    report = load(folder / "report.json")
    st = report.get("stability") or {}
    out = [provenance(folder, report["machine"], report["date"]), "", prompt_set(report), models_line(report), ""]
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


# -- the other steps ------------------------------------------------------------------------------

def json_machine(path: Path) -> dict[str, Any] | None:
    return load(path).get("machine") if path.is_file() else None


def concurrency_section(folder: Path, base: Path) -> list[str]:
    out = []
    for part in sorted(p for p in folder.iterdir() if (p / "concurrency.json").is_file()):
        data = load(part / "concurrency.json")
        clients = ", ".join(dict.fromkeys(str(r["concurrency"]) for r in data["rows"]))
        out += [f"**{clients} clients** ({link(part / 'concurrency.md', base, 'report')})", "",
                provenance(part, data["machine"]), "", md_body(part / "concurrency.md"), "",
                f"![concurrency {clients}]({(part / 'concurrency.png').relative_to(base).as_posix()})", ""]
    return out


def verify_cost_section(folder: Path, base: Path) -> list[str]:
    data = load(folder / "verify_cost.json")
    a = data["args"]
    return [provenance(folder, data["machine"]), "",
            f"Target {a['model']} ({a['dtype']}, {a.get('kernels', 'auto')} kernels): t(M), the fastest of "
            f"{a['reps']} forwards scoring M tokens, over t(1); plain tok/s: plain greedy decoding of "
            f"{a['decode_tokens']} tokens, best of {a['reps']}.", "",
            table_lines(folder / "verify_cost.md"), "",
            f"![verify cost]({(folder / 'verify_cost.png').relative_to(base).as_posix()})"]


def md_section(folder: Path, base: Path, files: list[str], machine_from: str | None = None) -> list[str]:
    machine = json_machine(folder / machine_from) if machine_from else None
    out = [provenance(folder, machine), ""]
    for name in files:
        if (folder / name).is_file():
            out += [md_body(folder / name), ""]
    return out


def two_process_section(folder: Path, base: Path) -> list[str]:
    return [provenance(folder, json_machine(folder / "two_process.json")), "", "```",
            (folder / "two_process.md").read_text(encoding="utf-8").strip(), "```"]


def advise_section(folder: Path, base: Path) -> list[str]:
    text = "\n".join(ln for ln in (folder / "advise.txt").read_text(encoding="utf-8").splitlines()
                     if not ln.startswith("wrote "))
    out = [provenance(folder, json_machine(folder / "advise.json")), "", "```", text.strip(), "```"]
    if (folder / "advise.png").is_file():
        out += ["", f"![advise]({(folder / 'advise.png').relative_to(base).as_posix()})"]
    return out


def gpu_section(folder: Path, base: Path) -> list[str]:
    """Checks and figures of bench/gpu_check.py: one gpu_check.json, or checks/ and figures/ from separate runs."""
    whole = folder / "gpu_check.json"
    checks_path = whole if whole.is_file() else folder / "checks" / "gpu_check.json"
    figures_path = whole if whole.is_file() else folder / "figures" / "gpu_check.json"
    out: list[str] = []
    if checks_path.is_file():
        c = load(checks_path)
        out += [f"**Checks** ({link(checks_path.with_suffix('.md'), base, 'report')}). Device: {c['device']}, "
                f"torch {c['torch']}. Run of {c['date']}.", "", "| check | result | cases |", "|---|---|---|"]
        for name in ("parity", "identity", "compiled", "quantized", "batch"):
            v = c.get(name) or {}
            cases = ", ".join(k for k in v if k not in ("ok", "seconds", "max_abs_diff"))
            out.append(f"| {name} | {'pass' if v.get('ok') else 'FAIL'} | {cases} |")
        if "engine_compile" in c:
            e = c["engine_compile"]
            out += ["", f"Plain greedy decoding through the Engine: {e['eager']['tokens_per_s']} tokens/s eager, "
                    f"{e['compiled']['tokens_per_s']} with `compile=True` (inductor and CUDA graphs; "
                    f"{e['compiled']['setup_s']} s to load and compile against {e['eager']['setup_s']} s)."]
        out.append("")
    if figures_path.is_file() and "figures" in (g := load(figures_path)):
        f = g["figures"]
        ms = [m for m in ("1", "2", "4", "8", "16") if m in f["t_ms"]["eager"]]
        modes = list(f["t_ms"])
        out += [f"**Figures** ({link(figures_path.with_suffix('.md'), base, 'report')}). Device: {g['device']}, "
                f"torch {g['torch']}. Run of {g['date']}. Random bf16 weights of real shapes: a {f['target']} "
                f"target at a {f['context']}-token context; t(M) in ms for M tokens scored in one forward "
                f"(M = {', '.join(ms)} of the report's 1..{len(f['t_ms']['eager'])}).", "",
                "| | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---:|" * len(ms)]
        names = {"eager": "eager", "graphs": "CUDA graphs"}
        for mode in modes:
            out.append(f"| {names.get(mode, mode)} t(M) ms | " + " | ".join(f"{f['t_ms'][mode][m]:.2f}" for m in ms)
                       + " |")
            out.append(f"| {names.get(mode, mode)} t(M)/t(1) | " + " | ".join(f"{f['ratio'][mode][m]:.2f}"
                                                                            for m in ms) + " |")
        out += ["", "| | " + " | ".join(names.get(m, m) for m in modes) + " |", "|---|" + "---:|" * len(modes),
                "| draft step (0.5B shape), ms | " + " | ".join(f"{f['draft_ms'][m]:.2f}" for m in modes) + " |",
                "| draft cost c | " + " | ".join(f"{f['c'][m]:.2f}" for m in modes) + " |"]
        if "roofline_fraction" in f:
            out.append(f"| t(1) against the bandwidth floor ({f['target_weight_GB']} GB at {f['bandwidth_GBs']} "
                       "GB/s) | " + " | ".join(f"{f['roofline_fraction'][m]:.2f}" for m in modes) + " |")
        out.append("| plain greedy tokens/s (Engine) | " + " | ".join(
            str(f["plain_tokens_per_s"].get(m, "–")) for m in modes) + " |")
        for a in sorted(f.get("predicted_speedup", {}).get(modes[0], {})):
            out.append(f"| predicted speedup at acceptance {a} (best k) | " + " | ".join(
                f"{f['predicted_speedup'][m][a]['speedup']:.2f} (k={f['predicted_speedup'][m][a]['k']})"
                for m in modes) + " |")
        out.append("")
    return out


# -- the page -------------------------------------------------------------------------------------

# (step folder, heading, what it measures, renderer)
SECTIONS: list[tuple[str, str, str, Any]] = [
    ("report", "The report split: verispec's defaults against plain decoding and fixed k",
     "The int4 pair under verispec's defaults (`hybrid`: the cost policy, a 32768-token draft head, the confidence "
     "stop and a 256-token draft window) against plain decoding and against the same settings at a fixed k of 2, "
     "3 and 5, on prompts no default was tuned on: Spec-Bench sampled with seed 1, HumanEval problems 100-119 and "
     "the packaged chat-formatted coding requests (`chat_code`). The defaults were chosen on Spec-Bench seed 0 "
     "and HumanEval 0-19 (the sections below).", bench_section),
    ("code_edit", "Code edits: lookups that copy the prompt",
     "The int4 pair on the packaged `code_edit` requests (rewrite a quoted Python function), 256 new tokens: "
     "verispec's defaults against prompt lookup (`ngram`), suffix decoding (`suffix`) and the hybrid with the "
     "suffix lookup, the lookups at k = 16 so a long copy is not cut short, and without the index of earlier "
     "outputs (`global=0`: every method answers the same prompts, and the index would hand a later method an "
     "earlier one's answer). No setting was tuned on these prompts.", bench_section),
    ("trees", "Token trees: suffix drafts with several ways per node",
     "The int4 pair, the hybrid with the suffix lookup drafting chains (`width=1`, the default) against token "
     "trees of up to 3 continuations per node (`width=3`, the same node budget), without the index of earlier "
     "outputs, on the packaged `code_edit` and `chat_code` requests; 256 new tokens. The width was looked at on "
     "12 edit requests built from HumanEval 0-19 (`bench/code_edit_tune.py`), not on these.", bench_section),
    ("int4_long", "int4 target and draft against llama.cpp, long answers",
     "The report split (as above) plus the packaged `code_edit` requests, 256 new tokens: plain decoding, "
     "verispec's defaults and the hybrid with the suffix lookup (k = 16, without the index of earlier outputs, as "
     "in the code edits section) against llama.cpp plain decoding. The target runs from its GGUF's Q4_K tensors "
     "as int4 (its Q6_K tensors as int8), the draft as `int4-all`, through verispec's CPU kernels; llama.cpp "
     "runs the same GGUF file on the same prompt token ids. Tokens/s include the prefill. The ratio table "
     "divides every method's tokens/s by llama.cpp plain decoding's, per category; its last column is the mean "
     "over Spec-Bench's six categories.", bench_section),
    ("int4_long_q8", "The same on 8-bit activations against llama.cpp",
     "As the section above, with verispec's int4/int8 layers multiplying 8-bit activations (`--kernels q8`, "
     "AVX-512 VNNI) for plain decoding and every method; llama.cpp unchanged.", bench_section),
    ("predicted", "Predicted outputs: code edits with the quoted code as the prediction",
     "The int4 pair on 8-bit activations (`--kernels q8`) on the packaged `code_edit` requests, each answer run to "
     "its end (up to 1024 tokens): verispec's defaults without a prediction (`hybrid`), with the request's quoted "
     "function as the prediction (`hybrid:predict=1`, what a client sends as OpenAI's `prediction`), with another "
     "request's function (`hybrid:predict=other`: an unrelated prediction) and plain decoding with the prediction "
     "alone (`none:predict=1`), against llama.cpp plain decoding on the same GGUF. Nothing was tuned on these "
     "prompts (the prediction drafter was looked at on the 12 edits of `bench/code_edit_tune.py`).", bench_section),
    ("predicted_polyglot", "Predicted outputs: code edits in Go, TypeScript, Rust, SQL and bash",
     "As the section above, on the packaged `code_edit_polyglot` requests (15 edits, three per language).",
     bench_section),
    ("peer_spread", "Run-to-run spread of the ratios against llama.cpp",
     "`bench/peer_spread.py`: the ratios of the section above (8-bit activations), repeated to give their "
     "spread, on the packaged chat-formatted coding requests and Spec-Bench's translation and summarization "
     "prompts (seed 1). "
     "llama.cpp plain decoding is one more method of the interleaved run: every method decodes a prompt in turn, "
     "repeat after repeat, so each repeat's ratio compares runs seconds apart.",
     lambda f, b: md_section(f, b, ["peer_spread.md"], "peer_spread.json")),
    ("int4", "int4 target and draft, every drafter, against llama.cpp",
     "The same pair and peer, every drafter and k policy side by side on shorter answers, where the prefill is a "
     "larger share of the wall time.", bench_section),
    ("draft_window", "Draft window on long prompts",
     "How much of a long prompt the draft model reads (`window=N`: its first 4 and last N tokens) against what "
     "it costs on code, on the categories with the longest prompts and HumanEval.", bench_section),
    ("humaneval", "bf16 target on code",
     "The dense bf16 target with the draft model, prompt lookup and the hybrid drafter on code.",
     lambda f, b: bench_section(f, b, categories=False)),
    ("full", "bf16 target on Spec-Bench with transformers as peers",
     "The dense bf16 target on every Spec-Bench category and code, with transformers' plain, assisted and "
     "prompt-lookup generation on the same weights as peers.", bench_section),
    ("stability", "Stability on odd inputs",
     "The stability suite of `verispec bench --stability`: context limits, template markup, emoji, control "
     "characters, mixed scripts, an empty prompt, one token and a drafter that never proposes; each case must "
     "give plain decoding's tokens, or refuse as plain decoding refuses.", stability_section),
    ("concurrency", "Concurrency: one engine, many slots",
     "`bench/concurrency.py`: a closed loop of clients over Spec-Bench prompts on one engine with a slot per "
     "client, plain decoding against verispec's defaults (`policy`: the cost policy over all running rows) and, "
     "at one client, the same requests through `generate` one after another (`alone`). Beyond prefill: "
     "throughput over the wall time outside the target's prompt prefill, which is the same work in every mode.",
     concurrency_section),
    ("prefix_reuse", "Prefix reuse: a chat's follow-up turn",
     "`bench/prefix_reuse.py`: a ~1,000-token conversation (a code file, a question and the model's answer), then "
     "a follow-up turn, on an engine with prefix reuse and on one without, per spec (plain decoding, and the draft "
     "model at a fixed k so that the first step drafts). With reuse the follow-up lands in the slot the "
     "conversation left and prefills only its new tokens.",
     lambda f, b: md_section(f, b, ["prefix_reuse.md"])),
    ("server", "Server: launch to ready, and the first requests",
     "`bench/server_ready.py`: `verispec serve` on the pair with its default settings, `/health` polled from "
     "launch; once it answers 200, chat requests one at a time (greedy, speculative under the server's defaults, "
     "then plain, then speculative again). The warm-up profiles before ready, so the first speculative request "
     "runs no profiling.", lambda f, b: md_section(f, b, ["server_ready.md"], "server_ready.json")),
    ("sampling", "What sampling costs",
     "`bench/sampling_speed.py`: the int4 pair decoding the same prompts greedily, at a temperature and with "
     "top-p, plainly and under verispec's defaults, side by side; the verification stage (distributions, "
     "acceptance test, draw) against the scoring stage (the target forward), from the engine's stage timers.",
     lambda f, b: md_section(f, b, ["sampling_speed.md"], "sampling_speed.json")),
    ("verify_cost", "Verification cost of the whole target forward",
     "`bench/verify_cost.py`: t(M)/t(1) for M scored tokens over a 64-token context, per weight format; "
     "`int4, q8` and `int8, q8`: the quantized layers on 8-bit activations (`--kernels q8`).",
     verify_cost_section),
    ("q8", "8-bit activations end to end",
     "`bench/q8_speed.py`: the int4 pair with `--kernels q8` (int4/int8 layers on 8-bit activations, AVX-512 VNNI) "
     "against verispec's bf16 kernels, two engines decoding the same report-split prompts, plainly and under "
     "verispec's defaults, side by side.", lambda f, b: md_section(f, b, ["q8_speed.md"], "q8_speed.json")),
    ("draft_cost", "Draft cost ratio by draft weight format",
     "`bench/draft_cost.py`: one target step and one draft token timed on the same 64-token context (the "
     "minimum of 7); c is their ratio.", lambda f, b: md_section(f, b, ["draft_cost.md"])),
    ("plain", "Plain decoding against transformers and the bandwidth roofline",
     "`bench/plain_decode.py`: plain greedy decoding of the dense bf16 target. The roofline divides the run's "
     "measured read bandwidth (`torch.sum` over a 1 GiB bf16 tensor, best of 5) by the bytes of weights a token "
     "reads.", lambda f, b: md_section(f, b, ["plain_decode.md"], "plain_decode.json")),
    ("fused_paths", "Fused forward paths",
     "`bench/fused_paths.py`: the prefill's attention through the fused `attend` kernel against SDPA, and decode "
     "steps with projections called straight into the kernels against module calls, and decode steps through the "
     "fused small ops (norms, attention, silu * up) against PyTorch's ops, alternating in one process.",
     lambda f, b: md_section(f, b, ["fused_paths.md"], "fused_paths.json")),
    ("kernels", "Per-projection kernels",
     "`bench/kernel_bench.py`: t(M) per projection shape of the 1.5B, PyTorch's stock int4/int8/bf16 kernels "
     "against verispec's, weights streamed from DRAM.", lambda f, b: md_section(f, b, ["kernels.md"])),
    ("load", "Loading from the converted cache",
     "`bench/load_time.py`: `Engine.from_pretrained` of the target from its converted cache.",
     lambda f, b: md_section(f, b, ["load_time.md"])),
    ("compile", "Eager against `--compile`",
     "`bench/compile_vs_eager.py`: the same requests eager and through `torch.compile`, side by side.",
     lambda f, b: md_section(f, b, ["compile_vs_eager.md", "compile_vs_eager_int4.md"], "compile_vs_eager.json")),
    ("two_process", "Draft and target in two processes",
     "`bench/two_process.py`: both models in one process with 2 threads against the draft in a process of its "
     "own, one thread each (docs/distributed.md).", two_process_section),
    ("advise", "`verispec advise`",
     "Measured bandwidth, verification cost curve, draft cost and acceptance; the predicted speedup per method "
     "and k, checked against a real run.", advise_section),
    ("gpu", "GPU",
     "`bench/gpu_check.py` on a CUDA machine: correctness checks on tiny random models (fp32), and the cost side "
     "of speculation on random weights of real shapes (docs/gpu.md).", gpu_section),
]

INTRO = """\
# Results

<!-- Rendered by bench/readme_tables.py from the reports in docs/results/: edit the script or rerun the
benchmarks, not this file. -->

Every figure on this page comes from a report in [results/](results/), written by one step of
[bench/run_all.sh](../bench/run_all.sh) (`make bench`; the GPU section by
[bench/gpu_check.py](../bench/gpu_check.py)), and each section names the host and the date its report
records. In `verispec bench` runs the methods generate prompt by prompt, interleaved, in one process, so
their ratios are measured side by side, each method prefilling every prompt itself (no prefix reuse
between them); absolute tokens/s compare only within a section (hosts differ, and a shared host's speed
varies from run to run).

How to read the tables ([docs/bench.md](bench.md) has the details): **tokens/s** is generated tokens over
the summed wall time of the requests, prefill included; **speedup vs plain** is a method's tokens/s over
plain decoding's on the same prompts; **mean accepted length** is tokens per target forward (1.00 for plain
decoding); **acceptance** is accepted over drafted tokens; **same tokens as plain** is the share of prompts
whose greedy output equals plain decoding's token for token (verification is exact; in bf16 a forward can
round differently when it scores several tokens than one, which can flip a near-tie, and a peer computes
with its own kernels). Method strings (`hybrid:policy=cost,vocab=32768`, ...) are those of
[`verispec bench --methods`](bench.md#methods).
"""


def results_page(root: Path, base: Path) -> str:
    present = [(step, *rest) for step, *rest in SECTIONS if (root / step).is_dir()]
    out = [INTRO, "## Contents", ""]
    out += [f"- [{title}](#{anchor(title)}) (`{step}`)" for step, title, _, _ in present]
    for step, title, what, render in present:
        out += ["", f"## {title}", "", f"Step `{step}` of run_all.sh. {what}", "", *render(root / step, base)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip() + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


CODE_COLUMNS = {"humaneval": "HumanEval", "chat_code": "chat code", "code_edit": "code edits"}


def readme_table(root: Path, base: Path) -> str:
    """README's one table: the long-answer int4 run (else the int4 one) against plain decoding and llama.cpp."""
    for step in ("int4_long", "int4"):
        if (root / step / "report.json").is_file():
            break
    else:
        return "_No int4 report in docs/results/._"
    folder = root / step
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
           "`bench/readme_tables.py`.", "",
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
    return "\n".join(out)


def splice(text: str, block: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + "\n" + text[end:]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    check = "--check" in sys.argv[1:]
    root = Path(args[0]).resolve() if args else DEFAULT
    page_path = root.parent / f"{root.name}.md"  # docs/results -> docs/results.md
    outputs = [(page_path, results_page(root, root.parent))]
    if root == DEFAULT:  # README shows the published results only, never those of another folder
        readme = README.read_text(encoding="utf-8")
        outputs.append((README, splice(readme, readme_table(root, ROOT)) if BEGIN in readme and END in readme
                        else readme))
    stale = [p for p, new in outputs if not p.is_file() or p.read_text(encoding="utf-8") != new]
    if check:
        for p in stale:
            print(f"{p} is not what bench/readme_tables.py renders from {root}", file=sys.stderr)
        sys.exit(1 if stale else 0)
    for p, new in outputs:
        if p in stale:
            p.write_text(new, encoding="utf-8")
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
