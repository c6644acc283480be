"""``make demo``: speculative vs plain decoding on the real Qwen2.5-Coder pair, a table and plots.

The demo is one fixed run of the benchmark harness (``verispec bench``): greedy decoding of the
requests verispec is built for, written the way users ask (:data:`PROMPTS`: two coding requests and two
code edits, each answer over 200 tokens), every method of :data:`METHODS` against plain decoding,
interleaved per prompt, and llama.cpp's plain decoding of the same GGUF file where the optional
``llamacpp`` extra is installed. It takes about five minutes on two cores.
"""

from __future__ import annotations

import importlib.util

from verispec.bench.command import BenchOptions, run_bench

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# Plain decoding (the baseline), the default speculation (a bare ``hybrid`` takes every option from
# :data:`~verispec.config.DEFAULT_SPEC`) and the same with each edit's quoted code as its predicted output.
METHODS = "none,hybrid,hybrid:predict=1"
# Packaged chat requests: two "write me" coding requests, two edits of quoted code (their code is the prediction).
DATASETS = "chat_code,code_edit"
PROMPTS = ("chat_code-01", "chat_code-02", "code_edit-02", "code_edit-03")


def demo_options(out: str, max_tokens: int = 256) -> BenchOptions:
    """The benchmark run ``make demo`` is, writing its report and plots to ``out``: :data:`PROMPTS` under
    :data:`METHODS`, and llama.cpp's plain decoding as a peer where ``llama_cpp`` can be imported."""
    peers = ["llamacpp"] if importlib.util.find_spec("llama_cpp") is not None else []
    # llama.cpp's plain decoding only: its prompt-lookup row would add two minutes of slow decoding.
    return BenchOptions(model=TARGET, draft=DRAFT, methods=METHODS, peers=peers,
                        peer_methods=["llamacpp-plain"] if peers else [], dataset=DATASETS,
                        ids=list(PROMPTS), max_tokens=max_tokens, max_len=2048, out=out)


def run_demo(out: str, max_tokens: int = 256) -> None:
    """Run the demo (see :func:`demo_options`); prints the summary table and writes report.md, report.json and plots."""
    run_bench(demo_options(out, max_tokens))
