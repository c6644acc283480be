"""The llama.cpp peer (``verispec bench --peers llamacpp``).

Everything but the last test runs without llama-cpp-python (an optional extra, absent in CI):
the missing package is simulated, and a stand-in for the llama.cpp contexts exercises the
bench's plumbing. The last test runs the real peer on SmolLM2's GGUF when the package is there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import make_tiny
from tiny_tokenizer import make_tiny_tokenizer

from verispec import hub
from verispec.bench import command, peers
from verispec.bench.command import BenchOptions, run_bench
from verispec.bench.harness import engine_generate
from verispec.cli import main
from verispec.config import PLAIN, SpecConfig
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

MAX_LEN = 96
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama as a Hugging Face folder (so not a GGUF), with a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("llamacpp_target")
    make_tiny(folder, arch="llama", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=11, scale=3.0)
    make_tiny_tokenizer(folder, 96)
    return str(folder)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    rows = [{"id": "p1", "category": "code", "prompt": "def add ( x , y ) : return x + y"},
            {"id": "p2", "category": "chat", "prompt": "what is the cat ?"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def no_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import llama_cpp`` fail as it does where the extra is not installed."""
    for name in ("llama_cpp", "llama_cpp.llama_speculative"):
        monkeypatch.setitem(sys.modules, name, None)


def _opts(model: str, data: Path, out: Path, peer_list: list[str], **kw: Any) -> BenchOptions:
    return BenchOptions(model=model, methods="ngram", dataset=f"jsonl:{data}", max_tokens=8, dtype="float32",
                        max_len=MAX_LEN, out=str(out), progress=False, plots=False, peers=peer_list, **kw)


# -- options ---------------------------------------------------------------------------------------

def test_peers_option_accepts_llamacpp(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[BenchOptions] = []
    monkeypatch.setattr(command, "run_bench", seen.append)
    for value, want in (("llamacpp", ["llamacpp"]), ("hf,llamacpp", ["hf", "llamacpp"]), (" llamacpp , hf ",
                                                                                          ["llamacpp", "hf"])):
        assert main(["bench", "--model", "m", "--peers", value, "--lookup-tokens", "4"]) == 0
        assert seen[-1].peers == want and seen[-1].lookup_tokens == 4
    assert "llamacpp" in peers.PEERS
    with pytest.raises(VerispecError, match="unknown peer 'llama'.*hf, llamacpp"):
        BenchOptions(model="m", peers=["llama"])


def test_peer_methods_option() -> None:
    assert main(["bench", "--model", "m", "--peers", "llamacpp", "--peer-methods", "llamacpp-lookup"]) == 2
    with pytest.raises(VerispecError, match="unknown peer method 'llamacpp-lookup'"):
        BenchOptions(model="m", peers=["llamacpp"], peer_methods=["llamacpp-lookup"])
    with pytest.raises(VerispecError, match="needs --peers hf"):
        BenchOptions(model="m", peers=["llamacpp"], peer_methods=["hf-plain"])


def test_sampling_arguments_match_the_engines() -> None:
    greedy = peers.LlamaCppPeers.sampling(SamplingParams())
    assert greedy["temp"] == 0.0 and greedy["top_k"] == 1
    sampled = peers.LlamaCppPeers.sampling(SamplingParams(temperature=0.7, top_p=0.9, top_k=20))
    assert (sampled["temp"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 20)
    for s in (greedy, sampled):  # nothing llama.cpp would add on its own
        assert s["repeat_penalty"] == 1.0 and s["min_p"] == 0.0 and s["typical_p"] == 1.0


def test_context_holds_the_longest_prompt_and_its_tokens() -> None:
    n_ctx = peers.llamacpp_context([10, 300, 20], max_tokens=128, max_len=4096, lookup_tokens=10)
    assert n_ctx >= 300 + 128 + 10
    # Never fewer new tokens than the decode-cost probe needs, never more than the engine's max_len allows.
    assert peers.llamacpp_context([5], 1, 4096, 10) >= 5 + peers.LLAMACPP_PROBE_TOKENS + 2
    assert peers.llamacpp_context([90], 128, 96, 10) < 90 + 128


# -- unavailable peer --------------------------------------------------------------------------------

def test_missing_package_names_the_extra(no_llama_cpp: None) -> None:
    with pytest.raises(VerispecError, match=r"pip install 'verispec\[llamacpp\]'"):
        peers.import_llama_cpp()


def test_missing_package_warns_once_and_the_run_goes_on(tiny_model: str, prompts: Path, tmp_path: Path,
                                                        no_llama_cpp: None, caplog: pytest.LogCaptureFixture,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="verispec.bench"):
        rc = main(["bench", "--model", tiny_model, "--methods", "ngram", "--dataset", f"jsonl:{prompts}",
                   "--max-tokens", "8", "--dtype", "float32", "--max-len", str(MAX_LEN), "--peers", "hf,llamacpp",
                   "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    warned = [r for r in caplog.records if "llamacpp" in r.getMessage()]
    assert len(warned) == 1 and "pip install 'verispec[llamacpp]'" in warned[0].getMessage()
    assert warned[0].exc_info is None  # a message, not a stack trace
    err = capsys.readouterr()
    assert "Traceback" not in err.err and "Traceback" not in err.out

    report = json.loads((out / "report.json").read_text())
    libs = report["peers"]["libraries"]
    assert libs["hf"]["error"] is None and "verispec[llamacpp]" in libs["llamacpp"]["error"]
    assert report["peers"]["error"] is None  # hf ran, so the peer ratios are there
    assert report["peers"]["best_vs_hf_plain"] > 0 and report["peers"]["best_vs_llamacpp_plain"] is None
    labels = {r["method"] for r in report["summary"]}
    assert {"plain", "ngram", "hf-plain", "hf-prompt-lookup"} <= labels and not any("llamacpp" in x for x in labels)
    assert any("peer llamacpp not run" in w for w in report["warnings"])
    md = (out / "report.md").read_text()
    assert "**llamacpp**: not run" in md and "verispec[llamacpp]" in md and "vs hf-plain" in md


def test_only_peer_missing_is_recorded(tiny_model: str, prompts: Path, tmp_path: Path, no_llama_cpp: None) -> None:
    report = run_bench(_opts(tiny_model, prompts, tmp_path / "out", ["llamacpp"]))
    assert "verispec[llamacpp]" in report["peers"]["error"]
    assert [r["method"] for r in report["summary"]] == ["plain", "ngram"]
    assert "Peers failed" in (tmp_path / "out" / "report.md").read_text()


def test_non_gguf_model_is_a_clear_error(tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(VerispecError, match="needs a GGUF model"):
        peers.gguf_file(tiny_model)
    gguf = tmp_path / "m" / "model-q4_k_m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert peers.gguf_file(str(gguf)) == gguf and peers.gguf_file(str(gguf.parent)) == gguf
    monkeypatch.setattr(peers, "import_llama_cpp", lambda: None)  # as if installed
    errors = command._check_peers(BenchOptions(model=tiny_model, peers=["llamacpp"]))
    assert "needs a GGUF model" in errors["llamacpp"]
    assert command._check_peers(BenchOptions(model=str(gguf), peers=["llamacpp"])) == {}


def _crash(path: str, extra: bool) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as a crash ends it (SIGSEGV would print a dump here)


def _crash_with_extra_buffers(path: str, extra: bool) -> None:
    if extra:
        _crash(path, extra)


def test_a_llamacpp_crash_turns_its_extra_buffers_off_or_is_a_clear_error(tmp_path: Path) -> None:
    # A child process decodes first (a crash there must not end the benchmark): with llama.cpp's extra
    # buffer types where that works, without them where only that works, else a clear error.
    gguf = tmp_path / "m.gguf"
    assert peers.llamacpp_extra_buffers(gguf, check=lambda path, extra: None, start_method="fork") is True
    assert peers.llamacpp_extra_buffers(gguf, check=_crash_with_extra_buffers, start_method="fork") is False
    with pytest.raises(VerispecError, match=r"could not decode .*m\.gguf.*\[-9, -9\]"):
        peers.llamacpp_extra_buffers(gguf, check=_crash, start_method="fork")


# -- the bench's plumbing, with a stand-in for llama.cpp ----------------------------------------------

class _FakeLlamaCpp:
    """Stands in for :class:`LlamaCppPeers`: the engine itself generates the two rows."""

    loaded: list[tuple[int, int]] = []

    def __init__(self, engine: Any, lookup_tokens: int) -> None:
        self.engine, self.path, self.threads = engine, Path("fake.gguf"), torch.get_num_threads()
        self.extra_buffers = True
        self.system_info = "AVX512 = 1 | REPACK = 1"
        self.lookup = SpecConfig("ngram", lookup_tokens, "fixed")

    @classmethod
    def load(cls, engine: Any, model: str, lookup_tokens: int, n_ctx: int) -> _FakeLlamaCpp:
        cls.loaded.append((lookup_tokens, n_ctx))
        return cls(engine, lookup_tokens)

    def methods(self) -> dict[str, Any]:
        return {peers.LLAMACPP_PLAIN: engine_generate(self.engine, PLAIN),
                peers.LLAMACPP_PROMPT_LOOKUP: engine_generate(self.engine, self.lookup)}

    def decode_costs(self, prompt: list[int]) -> dict[str, Any]:
        return {"generate_ms_per_token": 2.5, "eval_ms_per_token": 2.0, "python_loop_ms_per_token": 0.5,
                "probe_prompt_tokens": len(prompt), "probe_tokens": 32}

    def close(self) -> None:
        pass


def test_llamacpp_rows_ratios_and_report(tiny_model: str, prompts: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(peers, "import_llama_cpp", lambda: None)
    monkeypatch.setattr(peers, "gguf_file", lambda model: Path("fake.gguf"))
    monkeypatch.setattr(peers, "LlamaCppPeers", _FakeLlamaCpp)
    out = tmp_path / "out"
    report = run_bench(_opts(tiny_model, prompts, out, ["llamacpp"], lookup_tokens=4))
    assert _FakeLlamaCpp.loaded[-1][0] == 4 and _FakeLlamaCpp.loaded[-1][1] >= 8
    rows = {r["method"]: r for r in report["summary"]}
    assert rows["llamacpp-plain"]["kind"] == rows["llamacpp-prompt-lookup"]["kind"] == "peer"
    assert rows["llamacpp-plain"]["prompts"] == rows["llamacpp-prompt-lookup"]["prompts"] == 2
    p = report["peers"]
    lib = p["libraries"]["llamacpp"]
    assert lib["error"] is None and lib["num_pred_tokens"] == 4 and lib["eval_ms_per_token"] == 2.0
    assert p["best_method"] == "ngram" and p["best_vs_llamacpp_plain"] > 0 and p["best_vs_hf_assisted"] is None
    assert p["vs_llamacpp_plain"]["llamacpp-plain"] == pytest.approx(1.0)
    assert p["best_vs_llamacpp_plain"] == pytest.approx(rows["ngram"]["tokens_per_s"]
                                                        / rows["llamacpp-plain"]["tokens_per_s"])
    printed = capsys.readouterr().out
    assert "the tokens/s of llamacpp-plain" in printed
    md = (out / "report.md").read_text()
    assert "vs llamacpp-plain" in md and "tokens/s ratio to llamacpp-plain **" in md
    assert "2.00 ms for Llama.eval alone" in md and "num_pred_tokens=4" in md
    assert lib["system_info"] == "AVX512 = 1 | REPACK = 1" and "Built with: AVX512 = 1 | REPACK = 1." in md
    # --peer-methods: only the rows asked for run.
    report = run_bench(_opts(tiny_model, prompts, tmp_path / "one", ["llamacpp"], peer_methods=["llamacpp-plain"]))
    assert [r["method"] for r in report["summary"] if r["kind"] == "peer"] == ["llamacpp-plain"]
    assert report["peers"]["best_vs_llamacpp_plain"] > 0


# -- the real thing --------------------------------------------------------------------------------

def test_real_llamacpp_peer_on_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    if not hub.is_installed(SMOL):
        pytest.skip(f"{SMOL} is not installed (verispec models install {SMOL})")
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "category": "c", "prompt": p}) + "\n" for i, p in
                            enumerate(["Write a Python function that adds two numbers.", "Name three colors."])))
    report = run_bench(BenchOptions(model=SMOL, methods="ngram", dataset=f"jsonl:{data}", max_tokens=8,
                                    max_len=512, out=str(tmp_path / "out"), progress=False, plots=False,
                                    peers=["llamacpp"]))
    lib = report["peers"]["libraries"]["llamacpp"]
    assert lib["error"] is None and lib["gguf"].endswith(".gguf") and lib["n_threads"] == torch.get_num_threads()
    assert lib["eval_ms_per_token"] > 0 and lib["generate_ms_per_token"] > 0
    recs = [r for r in report["records"] if r["method"].startswith("llamacpp-")]
    assert sorted({r["method"] for r in recs}) == ["llamacpp-plain", "llamacpp-prompt-lookup"] and len(recs) == 4
    for r in recs:
        assert 0 < r["tokens"] <= 8 and r["metrics"]["ttft_s"] > 0 and r["metrics"]["total_s"] > 0
    # Same weights, different kernels: agreement is reported, not asserted.
    cons = {c["method"]: c for c in report["consistency"]}
    assert cons["llamacpp-plain"]["exact_match"] is not None
