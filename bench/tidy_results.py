"""Tidy a results folder: compact JSON, and every plot redrawn from its JSON as a small PNG.

    python bench/tidy_results.py [docs/results]

- Every ``*.json`` is rewritten without indentation (the same values; a report's per-prompt records
  are most of its bytes, and an indented list puts each token id on a line of its own).
- A report's ``out``/``json`` setting names where the report lives now (the folder may have moved).
- Plots are drawn again from the JSON beside them, with the plotting function that drew them:
  ``verispec.bench.plots`` for ``verispec bench`` reports (report.json), ``bench/concurrency.py``,
  ``bench/verify_cost.py`` and ``verispec.advise`` for theirs; then stored as 64-colour palette PNGs.

``bench/run_all.sh`` runs it at the end of every run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COLOURS = 64


def _script(name: str) -> Any:
    """A module of bench/ (not a package) by file name."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
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


def compact_json(path: Path) -> dict[str, Any] | list[Any]:
    data = _relocate(json.loads(path.read_text(encoding="utf-8")), path)
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n",
                    encoding="utf-8")
    return data


def shrink_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=COLOURS)
    small.save(path, optimize=True)


def _short(label: str) -> str:
    return label.split(":datastore=")[0]  # a datastore's path names the machine's cache, not the method


def plot_report(report: dict[str, Any], folder: Path) -> list[Path]:
    """The plots ``verispec bench`` draws, from report.json's per-category rows."""
    from verispec.bench import plots
    from verispec.bench.stats import MethodStats

    rows = [MethodStats(**{**r, "method": _short(r["method"])}) for r in report["per_category"]]
    methods = report["methods"]
    sweep = frozenset(_short(m["label"]) for m in methods if m["from_sweep"])
    families = {_short(m["label"]): _short(m["family"]) for m in methods if m["kind"] != "baseline"}
    title = report["title"]
    drawn = [plots.speedup_by_category(rows, folder / "speedup_by_category.png", title, sweep),
             plots.acceptance_by_position(rows, folder / "acceptance_by_position.png", title, sweep),
             plots.stage_breakdown(rows, folder / "stage_breakdown.png", title),
             plots.speedup_vs_k(rows, families, folder / "speedup_vs_k.png", title)]
    return [p for p in drawn if p is not None]


def plot_concurrency(data: dict[str, Any], folder: Path) -> list[Path]:
    args, info = data["args"], data["machine"]
    where = info.get("gpu") or f"{info['cpu']}, {info['threads']} threads"
    weights = f"{args['dtype']}, target {args['weights']}"
    if args["method"] == "draft":
        weights += f", draft {args['draft_weights']}"
    title = f"{Path(args['model']).name} + {args['method']} ({weights}), {args['max_tokens']} tokens, {where}"
    _script("concurrency").plot(data["rows"], folder / "concurrency.png", title)
    return [folder / "concurrency.png"]


def plot_verify_cost(data: dict[str, Any], folder: Path) -> list[Path]:
    args, info = data["args"], data["machine"]
    title = (f"{args['model']} ({args['dtype']}, {args.get('kernels', 'auto')} kernels) · {info['cpu']}, "
             f"{info['threads']} threads · {info['date']}")
    _script("verify_cost").plot(data["rows"], folder / "verify_cost.png", title)
    return [folder / "verify_cost.png"]


def plot_advise(data: dict[str, Any], folder: Path) -> list[Path]:
    from verispec.advise import _plot

    advice = [SimpleNamespace(method=m["method"], predicted={int(k): v for k, v in m["predicted"].items()})
              for m in data["methods"]]
    method = data["recommended"]["method"]
    measured = {int(k): v for k, v in data["measured_speedup"][method].items()}
    _plot(advice, method, measured, str(folder / "advise.png"))
    return [folder / "advise.png"]


PLOTTERS = {"report.json": plot_report, "concurrency.json": plot_concurrency,
            "verify_cost.json": plot_verify_cost, "advise.json": plot_advise}


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


def main() -> None:
    tidy(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "results"))


if __name__ == "__main__":
    main()
