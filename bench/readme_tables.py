"""Render the README's results tables from benchmark reports, so no figure is typed by hand.

    python bench/readme_tables.py docs/benchmarks/2026-11-30
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.bench.report import category_ratios


def short(label: str) -> str:
    """A method label without a datastore path (it names the machine's cache, not the method)."""
    return label.split(":datastore=")[0]


def summary_table(report: dict, methods: list[str] | None = None) -> str:
    rows = [r for r in report["summary"] if methods is None or r["method"] in methods]
    out = ["| method | tokens/s | speedup vs plain | mean accepted length | acceptance | same tokens as plain |",
           "|---|---:|---:|---:|---:|---:|"]
    match = {c["method"]: c.get("exact_match") for c in report.get("consistency", [])}
    def fmt(v: float | None, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    for r in rows:
        out.append(f"| {short(r['method'])} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | "
                   f"{fmt(r['mean_accepted_length'], '.2f')} | {fmt(r['acceptance_rate'], '.0%')} | "
                   f"{fmt(match.get(r['method']), '.0%')} |")
    return "\n".join(out)


def category_table(report: dict) -> str:
    rows = report["per_category"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    out = ["| category | " + " | ".join(map(short, methods)) + " |", "|---|" + "---:|" * len(methods)]
    for c in cats:
        cells = []
        for m in methods:
            r = next((x for x in rows if x["method"] == m and x["category"] == c), None)
            cells.append("–" if r is None else f"{r['speedup']:.2f}x")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    root = Path(sys.argv[1])
    for name in ("int4", "int4_long", "humaneval", "full"):
        path = root / name / "report.json"
        if not path.is_file():
            continue
        report = json.loads(path.read_text())
        print(f"### {name}: {report['title']} ({report['date'][:10]})\n")
        print(summary_table(report) + "\n")
        if name in ("full", "int4"):
            print(category_table(report) + "\n")
        peers = report.get("peers") or {}
        for key in ("best_vs_llamacpp_plain", "best_vs_hf_assisted"):
            if peers.get(key) is not None:
                print(f"{key}: {peers[key]:.2f}x (best method {peers.get('best_method')})\n")
        if any(r["method"] == "llamacpp-plain" for r in report["per_category"]):
            print(category_ratios(report, "llamacpp-plain") + "\n")
    for name in ("plain_decode.md", "two_process.md", "compile_vs_eager.md", "concurrency/concurrency.md",
                 "verify_cost/verify_cost.md"):
        path = root / name
        if path.is_file():
            print(f"### {name}\n\n{path.read_text().strip()}\n")


if __name__ == "__main__":
    main()
