"""``make demo``: speculative vs plain decoding on the real Qwen2.5-Coder pair, a table and plots.

The demo is one fixed run of the benchmark harness (``verispec bench``): greedy decoding of a few
HumanEval prompts and, where Spec-Bench is present, a summarization and a QA prompt, every method
of :data:`METHODS` against plain decoding, interleaved per prompt, and llama.cpp's plain decoding of
the same GGUF file where the optional ``llamacpp`` extra is installed.
"""

from __future__ import annotations

import importlib.util

from verispec.bench import datasets
from verispec.bench.command import BenchOptions, run_bench

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# Plain decoding (the baseline), the default speculation (a bare ``hybrid`` takes every option from
# :data:`~verispec.config.DEFAULT_SPEC`), the draft model alone at a fixed k, and prompt lookup.
METHODS = "none,hybrid,draft:policy=fixed,vocab=0,window=0,confidence=0,ngram:policy=fixed"


def demo_options(out: str, n_prompts: int = 4, max_tokens: int = 96) -> BenchOptions:
    """The benchmark run ``make demo`` is, writing its report and plots to ``out``.

    Half of ``n_prompts`` are HumanEval's first prompts; the other half Spec-Bench summarization
    and QA prompts when its questions are present (else HumanEval alone). llama.cpp runs as a peer
    where ``llama_cpp`` can be imported.
    """
    spec_bench = datasets.default_spec_bench().is_file()
    peers = ["llamacpp"] if importlib.util.find_spec("llama_cpp") is not None else []
    return BenchOptions(model=TARGET, draft=DRAFT, methods=METHODS, peers=peers,
                        dataset="humaneval,spec_bench" if spec_bench else "humaneval", n=n_prompts // 2 or 1,
                        categories=["summarization", "qa"], per_category=max(1, n_prompts // 4),
                        max_tokens=max_tokens, max_len=2048,
                        out=out)


def run_demo(out: str, n_prompts: int = 4, max_tokens: int = 96) -> None:
    """Run the demo (see :func:`demo_options`); prints the summary table and writes report.md, report.json and plots."""
    run_bench(demo_options(out, n_prompts, max_tokens))
