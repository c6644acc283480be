"""The same `verispec bench` run on this checkout and on an earlier commit, side by side.

The earlier commit is checked out into a temporary git worktree and imported from there (the same
virtual environment, models and kernel cache); the two sides then take turns, ``--repeats`` times,
in reverse order every other repeat, so a drift of the host hits both alike. Each side's reports
land in ``OUT/<side>-<repeat>/``; ``OUT/versus.md`` and ``versus.json`` give, per method and
category, this checkout's tokens/s over the earlier commit's (the median of the per-repeat ratios,
with their range), the same beyond prefill (tokens over the wall time outside the target's prompt
prefill: an earlier commit whose engine reused one method's prefill for the next gave the later
methods a head start there), and every run's speedup over its own plain decoding. ``--compare-only``
renders the comparison again from the reports already in OUT.

    python bench/versus_commit.py --base HEAD~1 --repeats 2 --out bench_out/versus -- \\
        --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --weights int4 \\
        --draft-weights int4-all --methods none,hybrid --dataset spec_bench,chat_code --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from verispec.cli import main; sys.argv[0] = 'verispec'; sys.exit(main())"


def bench(source: Path, args: list[str], out: Path) -> dict[str, Any]:
    """Run `verispec bench ARGS --out OUT` importing verispec from ``source``; its report.json."""
    env = os.environ | {"PYTHONPATH": str(source)}
    subprocess.run([sys.executable, "-c", RUN, "bench", *args, "--no-progress", "--out", str(out)],
                   env=env, check=True)
    return json.loads((out / "report.json").read_text())


def rates(report: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(method, category) -> (tokens/s, speedup over that run's plain decoding, tokens/s beyond prefill)."""
    rows = report["summary"] + report["per_category"]
    return {(r["method"], r["category"]): (r["tokens_per_s"], r["speedup"],
                                           r["tokens"] / (r["wall_s"] * (1.0 - r["stage_share"]["prefill"])))
            for r in rows}


def compare(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (method, category): head over base tokens/s, paired by repeat, and each side's speedups."""
    base, head = [rates(r) for r in runs["base"]], [rates(r) for r in runs["head"]]
    out = []
    for key in head[0]:
        if not all(key in b for b in base):
            continue
        ratios = [h[key][0] / b[key][0] for h, b in zip(head, base, strict=True)]
        beyond = [h[key][2] / b[key][2] for h, b in zip(head, base, strict=True)]
        out.append({"method": key[0], "category": key[1], "head_vs_base": statistics.median(ratios),
                    "runs": ratios, "beyond_prefill": statistics.median(beyond), "beyond_runs": beyond,
                    "head_speedup": statistics.median(h[key][1] for h in head),
                    "base_speedup": statistics.median(b[key][1] for b in base)})
    return out


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| method | category | this checkout vs base (tokens/s) | the same beyond prefill | "
             "speedup over plain: this | base |", "|---|---|---:|---:|---:|---:|"]

    def ratio(median: float, runs: list[float]) -> str:
        return f"{median:.2f}x" + (f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else "")

    for r in sorted(rows, key=lambda r: (r["method"], r["category"] != "overall", r["category"])):
        lines.append(f"| {r['method']} | {r['category']} | {ratio(r['head_vs_base'], r['runs'])} | "
                     f"{ratio(r['beyond_prefill'], r['beyond_runs'])} | {r['head_speedup']:.2f}x | "
                     f"{r['base_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def run_sides(args: argparse.Namespace, rev: str, bench_args: list[str], runs: dict[str, list[dict[str, Any]]]) -> None:
    """The bench on both sides, ``args.repeats`` times, alternating; reports appended to ``runs``."""
    with tempfile.TemporaryDirectory(prefix="verispec-base-") as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), rev], cwd=ROOT, check=True)
        try:
            sources = {"base": worktree, "head": ROOT}
            for rep in range(args.repeats):
                for side in ("base", "head") if rep % 2 == 0 else ("head", "base"):
                    print(f"== {side} run {rep + 1}/{args.repeats}", flush=True)
                    runs[side].append(bench(sources[side], bench_args, args.out / f"{side}-{rep + 1}"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_out/versus"))
    ap.add_argument("--compare-only", action="store_true", help="compare the reports already in --out")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of `verispec bench`")
    args = ap.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.repeats < 1 or not bench_args:
        ap.error("--repeats >= 1, and the bench arguments after --")
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    if args.compare_only:
        for side in runs:
            runs[side] = [json.loads((args.out / f"{side}-{rep + 1}" / "report.json").read_text())
                          for rep in range(args.repeats)]
    else:
        run_sides(args, rev, bench_args, runs)
    rows = compare(runs)
    machine = runs["head"][0]["machine"]
    header = (f"# This checkout against {rev}\n\n`verispec bench {' '.join(bench_args)}`, {args.repeats} runs of "
              f"each side, alternating; {machine.get('cpu', '?')}, {machine.get('threads', '?')} threads, "
              f"{runs['head'][0]['date']}.")
    (args.out / "versus.md").write_text(markdown(rows, header))
    (args.out / "versus.json").write_text(json.dumps({"base": rev, "bench_args": bench_args,
                                                      "repeats": args.repeats, "rows": rows}, indent=1))
    print(markdown(rows, header))


if __name__ == "__main__":
    main()
