"""``make demo``: speculative vs plain decoding on the real Qwen2.5-Coder pair, a table and a plot."""

from __future__ import annotations

import json
from pathlib import Path

from verispec.bench import datasets
from verispec.bench.runner import machine, markdown_table, plot_speedup, rows_as_dicts, run_methods, summarize
from verispec.config import DEFAULT_SPEC, PLAIN, SpecConfig
from verispec.engine.engine import Engine
from verispec.sampling import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def run_demo(out: str, n_prompts: int = 4, max_tokens: int = 96) -> None:
    """Greedy decoding of a few HumanEval and Spec-Bench prompts: plain, verispec's default speculation
    (:data:`~verispec.config.DEFAULT_SPEC`, what ``verispec generate`` runs with a draft), the draft model
    alone and prompt lookup, each model in its default weight format."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = datasets.humaneval(n_prompts // 2 or 1)
    prompts += datasets.spec_bench(categories=["summarization", "qa"], per_category=max(1, n_prompts // 4))
    engine = Engine.from_pretrained(TARGET, draft=DRAFT, max_len=2048)
    d = DEFAULT_SPEC
    methods = {"plain": PLAIN, f"default ({d.method}, {d.k_policy} k<={d.k})": d,
               "draft k=5": SpecConfig(method="draft", k=5, k_policy="fixed"),
               "ngram k=5": SpecConfig(method="ngram", k=5, k_policy="fixed")}
    runs = run_methods(engine, prompts, methods, SamplingParams(max_tokens=max_tokens))
    rows = summarize(prompts, runs, baseline="plain")
    info = machine()
    table = markdown_table(rows)
    c = engine.describe()
    title = f"{TARGET} ({c['dtype']}, {c['weights']}), draft {DRAFT} ({c['draft_weights']}), {info['date']}"
    plot_speedup(rows, str(out_dir / "speedup.png"), title)
    header = f"# verispec demo\n\n{title}; {info['cpu']}, {info['threads']} threads\n\n"
    (out_dir / "demo.md").write_text(header + table + "\n")
    (out_dir / "demo.json").write_text(json.dumps({"machine": info, "rows": rows_as_dicts(rows)}, indent=2))
    print(f"\n{title}\n{table}\n\nwrote {out_dir}/demo.md, {out_dir}/speedup.png")
