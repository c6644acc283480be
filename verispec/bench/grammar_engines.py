"""What a grammar engine costs per token: the full-vocabulary mask of each ``json_extract`` schema on Qwen's tokenizer.

``python -m verispec.bench.grammar_engines [--out DIR] [--tokens N]`` compiles every schema of the ``json_extract``
set once in each importable engine (llguidance, xgrammar, outlines-core; the others are listed as not installed),
then walks a valid instance of the schema (:func:`example_instance`, tokenized as ``json.dumps`` prints it) token by
token: it times the bitmask of allowed tokens before each token, checks the token is allowed, and advances.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

TARGET = "qwen2.5-coder-1.5b-instruct"
ENGINES = ("llguidance", "xgrammar", "outlines-core")


@dataclass
class Walk:
    """A compiled schema's matcher: fill ``mask`` (int32 words, bit t = token t allowed), advance by a token (False
    or an exception: rejected), and whether the text so far may end here."""

    fill: Callable[[], Any]
    advance: Callable[[int], Any]
    accepting: Callable[[], bool]
    mask: Any


@dataclass
class Result:
    """An engine's timings over all schemas (or why it has none)."""

    engine: str
    version: str | None = None
    status: str = "ok"
    setup_s: float = 0.0  # the tokenizer conversion, once
    compile_ms: list[float] = field(default_factory=list)
    first_mask_us: list[float] = field(default_factory=list)  # each walk's first mask (also in mask_us)
    mask_us: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Means and percentiles (no per-token lists)."""
        out: dict[str, Any] = {"engine": self.engine, "version": self.version, "status": self.status,
                               "setup_s": round(self.setup_s, 3), "schemas": len(self.compile_ms),
                               "masks": len(self.mask_us), "errors": self.errors}
        if len(self.mask_us) >= 2:  # quantiles need two
            q = statistics.quantiles(self.mask_us, n=100)
            out.update(compile_ms_mean=statistics.fmean(self.compile_ms), compile_ms_max=max(self.compile_ms),
                       first_mask_us_mean=statistics.fmean(self.first_mask_us),
                       mask_us_mean=statistics.fmean(self.mask_us), mask_us_p50=q[49], mask_us_p99=q[98])
        return out


def example_instance(schema: dict, name: str = "value") -> Any:
    """A valid instance: every property, two array items (within min/maxItems), first enum/anyOf choice, non-null."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return example_instance(schema["anyOf"][0], name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return {k: example_instance(v, k) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        count = max(schema.get("minItems", 0), min(2, schema.get("maxItems", 2)))
        return [example_instance(schema.get("items", {}), name) for _ in range(count)]
    return {"string": f"example {name.replace('_', ' ')}", "integer": 42, "number": 3.25, "boolean": True,
            "null": None}.get(kind, "example")


def llguidance_engine(tok: Any, n_vocab: int) -> Callable[[dict], Walk]:
    """llguidance: LLMatcher on the JSON-schema grammar, masks by ``llguidance.torch.fill_next_token_bitmask``."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab)

    def compile_schema(schema: dict) -> Walk:
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        if m.is_error():
            raise ValueError(m.get_error())
        mask = llguidance.torch.allocate_token_bitmask(1, n_vocab)
        return Walk(lambda: llguidance.torch.fill_next_token_bitmask(m, mask), m.consume_token, m.is_accepting, mask)
    return compile_schema


def xgrammar_engine(tok: Any, n_vocab: int) -> Callable[[dict], Walk]:
    """xgrammar: GrammarCompiler.compile_json_schema (its cache off), GrammarMatcher.fill_next_token_bitmask."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=n_vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)

    def compile_schema(schema: dict) -> Walk:
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        eos = m.stop_token_ids[0]  # xgrammar completes on a stop token
        return Walk(lambda: m.fill_next_token_bitmask(mask), m.accept_token,
                    lambda: m.accept_token(eos) and m.is_terminated(), mask)
    return compile_schema


def _byte_level_vocab(tok: Any) -> dict[bytes, list[int]]:
    """Each ordinary token's bytes (byte-level BPE spells each byte as one printable character), specials left out."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    decoder = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in
                                                enumerate(b for b in range(256) if b not in printable)}
    special = set(tok.added_tokens_decoder)
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i not in special and all(c in decoder for c in text):
            vocab.setdefault(bytes(decoder[c] for c in text), []).append(i)
    return vocab


def outlines_core_engine(tok: Any, n_vocab: int) -> Callable[[dict], Walk]:
    """outlines-core: the regex of ``json_schema.build_regex_from_schema``, an Index on it, a Guide's mask."""
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = Vocabulary(tok.eos_token_id, _byte_level_vocab(tok))

    def compile_schema(schema: dict) -> Walk:
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))
        mask = torch.zeros((1, (n_vocab + 31) // 32), dtype=torch.int32)
        return Walk(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
                    lambda t: guide.advance(t, return_tokens=False), guide.is_finished, mask)
    return compile_schema


SETUPS = {"llguidance": ("llguidance", llguidance_engine), "xgrammar": ("xgrammar", xgrammar_engine),
          "outlines-core": ("outlines_core", outlines_core_engine)}


def measure(engine: str, tok: Any, n_vocab: int, schemas: list[tuple[str, dict]], max_tokens: int | None) -> Result:
    """Compile each schema, then time the mask before each token of its instance's walk."""
    module, setup = SETUPS[engine]
    if importlib.util.find_spec(module) is None:
        return Result(engine, status="not installed")
    res, t0 = Result(engine, metadata.version(module)), time.perf_counter()
    try:
        compile_schema = setup(tok, n_vocab)
    except Exception as e:  # e.g. a dependency of the engine missing
        res.status = f"setup failed: {type(e).__name__}: {e}"
        return res
    res.setup_s = time.perf_counter() - t0
    for sid, schema in schemas:
        tokens = tok.encode(json.dumps(example_instance(schema)), add_special_tokens=False)[:max_tokens]
        try:
            t0 = time.perf_counter()
            walk = compile_schema(schema)
            res.compile_ms.append((time.perf_counter() - t0) * 1e3)
            for i, t in enumerate(tokens):
                t0 = time.perf_counter_ns()
                walk.fill()
                res.mask_us.append((time.perf_counter_ns() - t0) / 1e3)
                if i == 0:
                    res.first_mask_us.append(res.mask_us[-1])
                if not (int(walk.mask.view(-1)[t // 32]) >> (t % 32)) & 1 or walk.advance(t) is False:
                    raise ValueError(f"token {i} ({tok.decode([t])!r}) rejected")
            if max_tokens is None and not walk.accepting():
                raise ValueError("the walk ended outside an accepting state")
        except Exception as e:  # one schema's failure is reported, not fatal
            res.errors.append(f"{sid}: {type(e).__name__}: {e}")
    return res


def cpu() -> dict[str, Any]:
    """The CPU's model name, family and model (first entry of /proc/cpuinfo) and core count."""
    info: dict[str, Any] = {"cores": os.cpu_count()}
    path = Path("/proc/cpuinfo")
    for key, _, value in (line.partition(":") for line in (path.read_text().splitlines() if path.exists() else [])):
        if key.strip() in ("model name", "cpu family", "model"):
            info.setdefault(key.strip(), value.strip())
    return info


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table of the summaries."""
    lines = ["| engine | version | setup s | compile ms mean / max | first mask µs | masks | mask µs mean | p50 | p99 "
             "| errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = [r["status"], *[""] * 6]
        if "mask_us_mean" in r:
            cells = [f"{r['setup_s']:.2f}", f"{r['compile_ms_mean']:.1f} / {r['compile_ms_max']:.1f}",
                     f"{r['first_mask_us_mean']:.0f}", r["masks"], *(f"{r['mask_us_' + k]:.1f}" for k in
                                                                     ("mean", "p50", "p99"))]
        lines.append("| " + " | ".join(map(str, [r["engine"], r["version"] or "-", *cells, len(r["errors"])])) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure every engine, print the table (and errors), and write report.json and README.md under --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for report.json and README.md (default: print only)")
    parser.add_argument("--tokens", type=int, help="walk at most N tokens of each instance (default: all)")
    args = parser.parse_args(argv)
    from verispec.bench.datasets import load
    from verispec.models.loader import load_tokenizer, open_source

    src = open_source(TARGET)
    tok, n_vocab = load_tokenizer(src), src.args.vocab_size
    schemas = [(p.id, p.schema) for p in load("json_extract") if p.schema is not None]
    results = [measure(e, tok, n_vocab, schemas, args.tokens).summary() for e in ENGINES]
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cpu": cpu(),
              "tokenizer": TARGET, "vocab": n_vocab, "schemas": len(schemas), "tokens": args.tokens,
              "results": results}
    text = (f"{report['date']}, {report['cpu']}, {len(schemas)} json_extract schemas, {TARGET}'s tokenizer "
            f"({n_vocab} ids)\n\n{table(results)}\n")
    print(text + "".join(f"{r['engine']}: {err}\n" for r in results for err in r["errors"]), end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "README.md").write_text(f"# Grammar engines: mask time per token\n\n{text}")


if __name__ == "__main__":
    main()
