"""The defaults a user gets without naming anything: weight formats, the draft partner, the speculation."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_quant import write_gguf
from tiny import make_tiny
from tiny_tokenizer import make_tiny_tokenizer

from verispec import Engine, EngineConfig, VerispecError, hub
from verispec import kernels as fast_kernels
from verispec.bench.methods import parse_method
from verispec.cli import _spec_from, _spec_tuning, build_parser, main
from verispec.config import DEFAULT_SPEC, PLAIN, default_spec, spec_defaults, user_spec
from verispec.models import loader
from verispec.models.linear import DenseLinear, Int4Linear, Int8Linear, matmul_kernels
from verispec.models.loader import build_model, open_source, resolve_weights

TARGET, DRAFT, SMOL = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
CONFIG_KEYS = {"model", "draft", "weights", "draft_weights", "dtype", "method", "k_policy", "k", "confidence",
               "draft_vocab", "draft_window", "kernels", "activations", "activations_reason"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A Llama target and draft with the tiny word-level tokenizer (text prompts work)."""
    folders = tmp_path_factory.mktemp("defaults_target"), tmp_path_factory.mktemp("defaults_draft")
    for seed, folder in enumerate(folders):
        make_tiny(folder, arch="llama", vocab=96, layers=2 - seed, dim=64, heads=4, kv_heads=2, seed=20 + seed)
        make_tiny_tokenizer(folder, 96)
    return str(folders[0]), str(folders[1])


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, DenseLinear | Int8Linear | Int4Linear)]


# -- weights="auto" ---------------------------------------------------------------------------------

def test_auto_weights_follow_the_source_precision(tmp_path: Path, monkeypatch, qwen2_tiny) -> None:
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    q4, f32 = tmp_path / "q4.gguf", tmp_path / "f32.gguf"
    write_gguf(q4)
    write_gguf(f32, quantized=False)
    for _ in range(2):  # parsed, then from the cached header
        quant, floats, folder = open_source(q4), open_source(f32), open_source(qwen2_tiny.path)
        assert (quant.quantized, floats.quantized, folder.quantized) == (True, False, False)
        assert resolve_weights(quant, "auto") == "int4"
        assert resolve_weights(quant, "auto", draft=True) == "int4-all"
        assert resolve_weights(quant, "auto", tp=2) == "dense"  # tensor parallelism shards dense weights only
        assert resolve_weights(quant, "auto", draft=True, tp=2) == "int4-all"  # the draft is not sharded
        for src in (floats, folder):
            assert resolve_weights(src, "auto") == resolve_weights(src, "auto", draft=True) == "dense"
        assert resolve_weights(quant, "int8") == "int8" and resolve_weights(folder, "int4") == "int4"
    header = next((tmp_path / "home" / "converted").glob("q4-*-header-*.json"))
    assert json.loads(header.read_text())["quantized"] is True
    # A header cached before it recorded the tensor types is parsed again.
    info = json.loads(header.read_text())
    del info["quantized"]
    header.write_text(json.dumps(info))
    assert open_source(q4).quantized and json.loads(header.read_text())["quantized"] is True


def test_engine_loads_a_quantized_gguf_as_int4_and_its_draft_as_int4_all(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("verispec.engine.loading.load_tokenizer", lambda src: None)  # the tiny GGUF has none
    q4 = tmp_path / "q4.gguf"
    write_gguf(q4)
    engine = Engine.from_pretrained(str(q4), draft=str(q4), dtype="float32", max_len=64, progress=False)
    assert (engine.config.weights, engine.config.draft_weights) == ("int4", "int4-all")
    reference = build_model(open_source(q4), torch.float32, "int4", progress=False)
    assert [type(m) for m in _layers(engine.target)] == [type(m) for m in _layers(reference)]
    assert Int8Linear in {type(m) for m in _layers(engine.target)}  # the Q8_0 tensors stay 8-bit
    assert {type(m) for m in _layers(engine.draft)} == {Int4Linear}
    c = engine.describe()
    assert (c["weights"], c["draft_weights"], c["dtype"]) == ("int4", "int4-all", "float32")
    dense = Engine.from_pretrained(str(q4), dtype="float32", max_len=64, progress=False, weights="dense")
    assert dense.config.weights == "dense" and {type(m) for m in _layers(dense.target)} == {DenseLinear}


def test_tensor_parallel_config_takes_auto_and_still_refuses_named_quantized_formats() -> None:
    assert EngineConfig(model="m", tp=2).weights == "auto"
    with pytest.raises(VerispecError, match="dense"):
        EngineConfig(model="m", tp=2, weights="int4")
    with pytest.raises(VerispecError, match="auto, dense"):
        EngineConfig(model="m", weights="q4")


# -- --draft auto -----------------------------------------------------------------------------------

def test_registry_names_the_draft_partners(monkeypatch) -> None:
    assert hub.REGISTRY[TARGET].draft == DRAFT
    assert hub.REGISTRY[DRAFT].draft is None and hub.REGISTRY[SMOL].draft is None
    monkeypatch.setattr(hub, "is_installed", lambda name: True)
    assert hub.resolve_draft(TARGET, "auto") == (DRAFT, None)
    draft, why = hub.resolve_draft(SMOL, "auto")
    assert draft is None and "no draft partner" in why
    draft, why = hub.resolve_draft("/models/mine.gguf", "auto")
    assert draft is None and "not in the model registry" in why
    monkeypatch.setattr(hub, "is_installed", lambda name: name != DRAFT)
    draft, why = hub.resolve_draft(TARGET, "auto")
    assert draft is None and f"verispec models install {DRAFT}" in why and "without a draft model" in why
    assert hub.resolve_draft(TARGET, "/my/draft") == ("/my/draft", None)
    assert hub.resolve_draft(TARGET, None) == (None, None)


def _partnered(monkeypatch, target: str, draft: str, installed: bool) -> None:
    """``target`` (a folder) as a registry entry whose partner is ``draft``."""
    entry = replace(hub.REGISTRY[TARGET], name=target, draft=draft)
    monkeypatch.setitem(hub.REGISTRY, target, entry)
    monkeypatch.setattr(hub, "is_installed", lambda name: installed)


def test_draft_auto_loads_the_installed_partner_or_runs_without(monkeypatch, caplog, pair) -> None:
    _partnered(monkeypatch, pair[0], pair[1], installed=True)
    engine = Engine.from_pretrained(pair[0], draft="auto", dtype="float32", max_len=64, progress=False)
    assert engine.draft is not None and engine.config.draft == pair[1]
    _partnered(monkeypatch, pair[0], pair[1], installed=False)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        engine = Engine.from_pretrained(pair[0], draft="auto", dtype="float32", max_len=64, progress=False)
    assert engine.draft is None and engine.config.draft is None
    said = [r.getMessage() for r in caplog.records if "--draft auto" in r.getMessage()]
    assert len(said) == 1 and "not installed" in said[0]


# -- the default speculation --------------------------------------------------------------------------

def test_default_speculation_is_one_definition() -> None:
    assert default_spec(True) is DEFAULT_SPEC and default_spec(False) is PLAIN
    assert user_spec(None, True) == DEFAULT_SPEC and user_spec(None, False) == PLAIN
    assert user_spec("none", True, k=3) == PLAIN
    assert user_spec("ngram", False) == replace(DEFAULT_SPEC, method="ngram")  # lookup needs no draft model
    assert user_spec(None, True, k=3, k_policy="fixed") == replace(DEFAULT_SPEC, k=3, k_policy="fixed")
    off = spec_defaults(draft_vocab=0, draft_window=0, confidence=0)
    assert (off.draft_vocab, off.draft_window, off.min_confidence) == (None, None, 0.0)
    assert spec_defaults(k=None) == DEFAULT_SPEC


def test_generate_and_bench_share_their_defaults() -> None:
    parser = build_parser()
    flags = [["-k", "3"], ["--k-policy", "fixed"], ["--confidence", "0"], ["--draft-vocab", "0"],
             ["--draft-window", "64"], []]
    for extra in flags:
        gen = parser.parse_args(["generate", "--model", "m", "--draft", "d", "--prompt", "hi", *extra])
        bench = parser.parse_args(["bench", "--model", "m", "--draft", "d", *extra])
        # A bench method named like the default one, with no options, is exactly what generate runs.
        assert parse_method(DEFAULT_SPEC.method, spec_defaults(**_spec_tuning(bench))).spec == _spec_from(gen)
        for dest in ("dtype", "weights", "draft_weights", "max_len", "kernels", "device", "compile"):
            assert getattr(gen, dest) == getattr(bench, dest), dest
    assert parser.parse_args(["bench", "--model", "m"]).weights == "auto"
    # Options a bench method names keep their meaning whatever the defaults are.
    assert parse_method("draft:k=3,policy=fixed").spec.k == 3
    assert parse_method("draft:k=3,policy=fixed", spec_defaults(k=7)).spec.k_policy == "fixed"


def test_generate_json_reports_the_resolved_configuration(capsys, caplog, pair) -> None:
    base = ["generate", "--model", pair[0], "--prompt", "write code for x", "--max-tokens", "3", "--dtype", "float32",
            "--max-len", "64", "--json"]

    def config(*extra: str) -> dict:
        assert main([*base, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert set(out["config"]) == CONFIG_KEYS
        return out["config"]

    d = DEFAULT_SPEC
    c = config("--draft", pair[1])
    assert c == {"model": pair[0], "draft": pair[1], "weights": "dense", "draft_weights": "dense",
                 "dtype": "float32", "method": d.method, "k_policy": d.k_policy, "k": d.k,
                 "confidence": d.confidence, "draft_vocab": d.draft_vocab, "draft_window": d.draft_window,
                 "kernels": "stock",  # fp32 dense layers run PyTorch's matmuls, with no int4/int8 activation path
                 "activations": {"target": None, "draft": None},
                 "activations_reason": {"target": "no int4/int8 layer runs verispec's kernels",
                                        "draft": "no int4/int8 layer runs verispec's kernels"}}
    c = config("--draft", pair[1], "--method", "draft", "-k", "2", "--k-policy", "fixed", "--confidence", "0",
               "--draft-vocab", "0", "--draft-window", "0")
    assert [c[key] for key in ("method", "k", "k_policy", "confidence", "draft_vocab", "draft_window")] == \
        ["draft", 2, "fixed", 0.0, None, None]
    c = config()
    assert (c["draft"], c["draft_weights"], c["method"], c["k"]) == (None, None, "none", 0)
    assert config("--method", "ngram")["method"] == "ngram"
    # --draft auto without a partner: one line saying so, and plain decoding.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verispec"):
        assert config("--draft", "auto")["method"] == "none"
    assert [r.getMessage() for r in caplog.records if "--draft auto" in r.getMessage()] == [
        f"--draft auto: {pair[0]} is not in the model registry; running without a draft model"]


def test_kernels_report_what_the_layers_run(qwen2_tiny) -> None:
    fp32 = build_model(open_source(qwen2_tiny.path), torch.float32, progress=False)
    bf16 = build_model(open_source(qwen2_tiny.path), torch.bfloat16, progress=False)
    stock = build_model(open_source(qwen2_tiny.path), torch.bfloat16, progress=False, kernels="stock")
    assert matmul_kernels(fp32) == matmul_kernels(stock) == matmul_kernels(None, stock) == "stock"
    fast = "verispec" if fast_kernels.available() else "stock"
    assert matmul_kernels(bf16) == fast
    assert matmul_kernels(bf16, fp32) == ("mixed" if fast_kernels.available() else "stock")


def test_loader_keeps_the_quantized_flag_through_its_caches(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))
    q4 = tmp_path / "q4.gguf"
    write_gguf(q4)
    src = open_source(q4)
    assert loader.converted(src, torch.float32, progress=False).quantized
    assert loader.converted_int4(src, torch.float32, progress=False).quantized
