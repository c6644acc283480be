"""The evaluation harness (``verispec bench``) on tiny random models with a tiny word-level tokenizer."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from verispec import kernels
from verispec.bench import datasets
from verispec.bench.command import BenchOptions, run_bench
from verispec.bench.consistency import bleu, compare, distribution_check, first_divergence, rouge_l
from verispec.bench.methods import BASELINE, parse_method, parse_methods, reference, split_methods, with_k_sweep
from verispec.bench.peers import hf_location, load_hf_model
from verispec.bench.report import REPORT_KEYS
from verispec.bench.stability import NULL_DRAFTER, run_suite
from verispec.bench.stats import MethodStats, ratios_by_category, spec_bench_mean
from verispec.cli import main
from verispec.config import DEFAULT_SPEC, PLAIN, SpecConfig
from verispec.demo import METHODS, demo_options
from verispec.engine.engine import Engine
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

MAX_LEN = 96


@pytest.fixture(scope="module")
def pair(chat_pair: tuple[str, str]) -> tuple[str, str]:
    """A Llama target and a noisy copy of it as draft (high but imperfect acceptance), both with the tokenizer."""
    return chat_pair


@pytest.fixture(scope="module")
def engine(pair: tuple[str, str]) -> Engine:
    return Engine.from_pretrained(pair[0], draft=pair[1], dtype="float32", max_len=MAX_LEN, progress=False)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _spec_bench_file(path: Path) -> Path:
    return _write_jsonl(path, [
        {"question_id": 81, "category": "writing", "turns": ["write a story about the cat", "and the dog ?"]},
        {"question_id": 82, "category": "coding", "turns": ["write code for x + y", "print it"]},
        {"question_id": 201, "category": "qa", "turns": ["what is the world ?"]},
        {"question_id": 202, "category": "qa", "turns": ["why is it a dog ?"]},
    ])


def _numbers(obj: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int | float):
        return [(path, float(obj))]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _numbers(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in _numbers(v, f"{path}[{i}]")]
    return []


# -- method strings --------------------------------------------------------------------------------

def test_method_strings_parse_into_spec_configs() -> None:
    m = parse_method("draft:k=3")
    assert (m.label, m.spec.method, m.spec.k, m.explicit_k) == ("draft:k=3", "draft", 3, True)
    assert parse_method("draft:policy=cost").spec.k_policy == "cost"
    # Options a string leaves out take the run's defaults: verispec's default speculation unless changed.
    assert parse_method("draft").spec == replace(DEFAULT_SPEC, method="draft")
    assert parse_method("draft", SpecConfig("hybrid", 7, "heuristic")).spec == SpecConfig("draft", 7, "heuristic")
    # 0 turns the default's draft vocabulary, window and confidence off.
    assert parse_method("draft:policy=fixed,vocab=0,window=0,confidence=0").spec == \
        SpecConfig("draft", DEFAULT_SPEC.k, "fixed", confidence=0.0)
    assert parse_method("layerskip:layers=7").spec.layers == 7
    assert parse_method("retrieval:datastore=/data/store.vds").spec.datastore == "/data/store.vds"
    ng = parse_method("ngram:k=8,max=5,min=2").spec
    assert (ng.k, ng.ngram_max, ng.ngram_min) == (8, 5, 2)
    assert parse_method("draft:policy=confidence,confidence=0.4").spec.confidence == 0.4
    assert parse_method("none").spec == PLAIN and parse_method("none").label == BASELINE
    for bad in ("bogus", "draft:foo=1", "draft:k=x", "none:k=2", "draft:k", "draft:policy=sometimes", "draft:k=0"):
        with pytest.raises(VerispecError):
            parse_method(bad)

    assert split_methods("none,draft:k=3,policy=cost,ngram") == ["none", "draft:k=3,policy=cost", "ngram"]
    with pytest.raises(VerispecError):
        split_methods("k=3,draft")
    labels = [m.label for m in parse_methods("draft,none,draft,ngram:k=4")]
    assert labels == [BASELINE, "draft", "ngram:k=4"]

    swept = with_k_sweep(parse_methods("draft,draft:k=3,ngram:max=3"), [1, 3])
    assert [m.label for m in swept] == [BASELINE, "draft", "draft:k=3", "ngram:max=3", "draft:k=1",
                                        "ngram:max=3,k=1", "ngram:max=3,k=3"]
    assert {m.family for m in swept if m.label.startswith("draft")} == {"draft"}
    assert swept[-1].family == "ngram:max=3" and swept[-1].spec.ngram_max == 3 and swept[-1].from_sweep


def test_run_options_in_method_strings() -> None:
    """kernels and sampling are options of the run a method string may change, plain decoding's included."""
    q8 = parse_method("none:kernels=q8")
    assert (q8.kernels, q8.spec, q8.is_baseline, q8.is_plain, q8.label) == ("q8", PLAIN, False, True, "none:kernels=q8")
    assert q8.kernels_or("auto") == "q8" and parse_method("hybrid").kernels_or("stock") == "stock"
    hot = parse_method("hybrid:temperature=0.8,top_p=0.9,k=3")
    assert (hot.spec.method, hot.spec.k, hot.temperature, hot.top_p, hot.top_k) == ("hybrid", 3, 0.8, 0.9, None)
    run = SamplingParams(max_tokens=7, top_k=5, seed=3)
    assert hot.sampling(run) == SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, top_k=5, seed=3)
    assert parse_method("hybrid").sampling(run) is run
    for bad in ("none:kernels=turbo", "hybrid:temperature=-1", "none:top_p=0", "none:top_k=x", "none:kernels=q8,k=2"):
        with pytest.raises(VerispecError):
            parse_method(bad)
    # Engine options beside the kernels: an engine over the same models with other slot settings.
    slots = parse_method("none:batch_prefill=0,prefill_chunk=64")
    assert slots.slot_options == {"batch_prefill": False, "prefill_chunk": 64} and slots.is_plain
    assert slots.sampling(run) is run and parse_method("hybrid:kernels=q8").slot_options == {}
    for bad in ("none:batch_prefill=2", "hybrid:prefill_chunk=0", "none:prefill_chunk=x"):
        with pytest.raises(VerispecError):
            parse_method(bad)
    # A k sweep keeps each variant's run options.
    swept = with_k_sweep(parse_methods("draft:kernels=stock"), [2])
    assert swept[-1].label == "draft:kernels=stock,k=2" and swept[-1].kernels == "stock"
    # Each method is checked against the plain decoding of its own kernels and sampling, where the run has one.
    methods = parse_methods("hybrid,none:kernels=q8,hybrid:kernels=q8,none:temperature=0.5,hybrid:temperature=0.5,"
                            "hybrid:kernels=stock")
    refs = {m.label: getattr(reference(m, methods, "auto", SamplingParams()), "label", None) for m in methods}
    assert refs == {BASELINE: None, "hybrid": BASELINE, "none:kernels=q8": None, "hybrid:kernels=q8": "none:kernels=q8",
                    "none:temperature=0.5": None, "hybrid:temperature=0.5": "none:temperature=0.5",
                    "hybrid:kernels=stock": None}


def test_each_method_runs_on_the_engine_of_its_kernels_and_slot_settings() -> None:
    from verispec.bench.command import BASE_ENGINE, _method_engines

    class Stub:
        def __init__(self, name: str, **config) -> None:
            self.name, self.config = name, config

        def with_config(self, **fields) -> Stub:
            return Stub(self.name, **self.config, **fields)

    loaded = {"auto": Stub("auto"), "q8": Stub("q8")}
    methods = parse_methods("hybrid,none:batch_prefill=0,hybrid:batch_prefill=0,none:kernels=q8,prefill_chunk=32")
    engines = _method_engines(loaded, methods, BenchOptions(model="m", kernels="auto"))
    assert engines[BASE_ENGINE] is engines[BASELINE] is engines["hybrid"] is loaded["auto"]
    assert engines["none:batch_prefill=0"] is engines["hybrid:batch_prefill=0"]  # one engine per setting
    assert (engines["none:batch_prefill=0"].name, engines["none:batch_prefill=0"].config) == \
        ("auto", {"batch_prefill": False})
    q8 = engines["none:kernels=q8,prefill_chunk=32"]
    assert (q8.name, q8.config) == ("q8", {"prefill_chunk": 32})


# -- consistency -------------------------------------------------------------------------------------

def test_consistency_metrics_on_known_inputs() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [5]) == 0
    text = "def add(x, y):\n    return x + y  # the sum of two numbers"
    assert rouge_l(text, text) == 1.0 and rouge_l("", "") == 1.0
    assert rouge_l("中文 文本", "中文 文本") == 1.0
    assert 0.0 < rouge_l("the cat sat on the mat", "the cat sat on a hat") < 1.0
    assert bleu([text, "hello world"], [text, "hello world"]) == pytest.approx(100.0)
    assert 0.0 <= bleu(["the cat sat on the mat today"], ["the cat sat on a mat today"]) < 100.0

    c = compare("m", [[1, 2, 3], [4, 5, 9, 9]], [[1, 2, 3], [4, 5, 6, 7]], ["a b c", "d e x x"],
                ["a b c", "d e f g"], greedy=True)
    assert (c.exact_match, c.diverged, c.first_divergence, c.mean_first_divergence) == (0.5, 1, [None, 2], 2.0)
    assert 0.0 < c.rouge_l < 1.0 and 0.0 <= c.bleu < 100.0 and c.distribution is None

    same = distribution_check([[1, 2, 3, 1]] * 50, [[1, 2, 3, 1]] * 50)
    assert same.total_variation == 0.0 and same.p_value == pytest.approx(1.0)
    diff = distribution_check([[1] * 10] * 50, [[2] * 10] * 50)
    assert diff.total_variation == 1.0 and diff.p_value < 1e-6
    sampled = compare("m", [[1, 2]], [[2, 1]], [None], [None], greedy=False)
    assert sampled.exact_match is None and sampled.rouge_l is None and sampled.distribution is not None


# -- datasets ----------------------------------------------------------------------------------------

def test_jsonl_and_spec_bench_datasets(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "category": "code", "prompt": "def f ( x ) :"},
        {"prompt": "hello world"},
        {"id": "c", "prompt": ["first turn", "second turn"]},
    ])
    got = datasets.load(f"jsonl:{path}")
    assert [(p.id, p.category, p.text, p.chat) for p in got] == [
        ("a", "code", "def f ( x ) :", True), ("1", "jsonl", "hello world", True), ("c", "jsonl", "first turn", True)]
    assert len(datasets.load(f"jsonl:{path}", n=2, chat=False)) == 2
    assert not datasets.jsonl(path, chat=False)[0].chat
    with pytest.raises(VerispecError):
        datasets.jsonl(path, field="question")
    with pytest.raises(VerispecError):
        datasets.load("nope")

    sb = _spec_bench_file(tmp_path / "question.jsonl")
    one = datasets.spec_bench(sb)
    assert {p.category for p in one} == {"mt_bench", "qa"} and all(not p.followups for p in one)
    two = datasets.spec_bench(sb, turns=2)
    assert [p.followups for p in two if p.category == "mt_bench"] == [("and the dog ?",), ("print it",)]
    sample = datasets.spec_bench(sb, per_category=1, seed=3)
    assert sorted(p.category for p in sample) == ["mt_bench", "qa"]
    assert sample == datasets.spec_bench(sb, per_category=1, seed=3)
    # A category asked for alone gets the prompts a run of every category samples for it.
    for seed in range(6):
        every = datasets.spec_bench(sb, per_category=1, seed=seed)
        assert datasets.load("spec_bench", sb, per_category=1, seed=seed, categories=["qa"]) == \
            [p for p in every if p.category == "qa"]
    with pytest.raises(VerispecError, match="unknown Spec-Bench categories rug"):
        datasets.spec_bench(sb, categories=["qa", "rug"])


def test_ratios_to_a_peer_per_category_and_their_spec_bench_mean() -> None:
    def row(method: str, category: str, tps: float) -> MethodStats:
        return MethodStats(method, "verispec", category, 1, 10, 10 / tps, tps, None, None, None, None)

    rows = [row("peer", "qa", 10), row("peer", "rag", 5), row("peer", "humaneval", 20), row("peer", "overall", 12),
            row("x", "qa", 15), row("x", "rag", 10), row("x", "humaneval", 60), row("x", "overall", 20),
            row("y", "mt_bench", 3)]
    by_cat = ratios_by_category(rows, "peer")
    assert by_cat == {"x": {"qa": 1.5, "rag": 2.0, "humaneval": 3.0, "overall": pytest.approx(20 / 12)}}
    # The mean of the Spec-Bench categories' ratios: HumanEval and overall are not among them.
    assert spec_bench_mean(by_cat["x"]) == pytest.approx(1.75)
    assert spec_bench_mean({"humaneval": 2.0}) is None


# -- stability ---------------------------------------------------------------------------------------

def test_stability_suite_passes_on_a_tiny_model(engine: Engine) -> None:
    results = run_suite(engine, parse_methods("draft,ngram,draft:policy=heuristic"), max_tokens=8, progress=False)
    cases = {r.case for r in results}
    assert {"near_context_limit", "over_context_limit", "special_characters", "emoji", "control_characters",
            "mixed_scripts", "empty_prompt", "max_tokens_1", NULL_DRAFTER} <= cases
    failed = [r for r in results if not r.passed]
    assert not failed, failed
    over = [r for r in results if r.case == "over_context_limit"]
    assert len(over) == 4 and all("refused" in r.detail for r in over)
    assert {r.method for r in results if r.case == NULL_DRAFTER} == {BASELINE, NULL_DRAFTER}


# -- make demo ---------------------------------------------------------------------------------------

def test_demo_is_a_bench_run_of_its_methods(pair: tuple[str, str], tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "p.jsonl", [
        {"id": "code", "category": "code", "prompt": "def add ( x , y ) : return x + y"},
        {"id": "edit", "category": "edit", "prompt": "add hints : def add ( x , y ) : return x + y",
         "prediction": "def add ( x , y ) : return x + y"},
        {"id": "chat", "category": "chat", "prompt": "what is the cat ?"}])
    opts = replace(demo_options(str(tmp_path / "out")), model=pair[0], draft=pair[1], dataset=f"jsonl:{data}",
                   ids=["edit", "code"], max_tokens=8, dtype="float32", max_len=MAX_LEN, progress=False)
    report = run_bench(opts)
    assert [m["label"] for m in report["methods"]] == [BASELINE, "hybrid", "hybrid:predict=1"] == \
        [BASELINE, *METHODS.split(",")[1:]]
    assert [i["prompt_id"] for i in report["items"]] == ["code", "edit"]  # the dataset's order, only those ids
    assert all(c["exact_match"] == 1.0 for c in report["consistency"])
    assert "speedup_by_category.png" in report["plots"] and (tmp_path / "out" / "report.md").is_file()


def test_demo_runs_llamacpp_where_the_extra_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, _i=installed: (object() if _i else None) if name == "llama_cpp"
                            else real(name, *a))
        assert demo_options("out").peers == (["llamacpp"] if installed else [])
        assert demo_options("out").peer_methods == (["llamacpp-plain"] if installed else [])


def test_the_demo_runs_packaged_prompts_with_long_answers() -> None:
    opts = demo_options("out")
    prompts = {p.id: p for p in datasets.load(opts.dataset)}
    assert set(opts.ids) <= set(prompts) and opts.max_tokens >= 200
    assert any(prompts[i].prediction for i in opts.ids) and any(not prompts[i].prediction for i in opts.ids)


def test_unknown_prompt_ids_are_refused_before_any_work(pair: tuple[str, str], tmp_path: Path) -> None:
    with pytest.raises(VerispecError, match="no prompt nope"):
        run_bench(BenchOptions(model=pair[0], dataset="chat_code", ids=["chat_code-01", "nope"],
                               out=str(tmp_path / "o"), progress=False))


def test_peer_models_load_from_the_engines_files(tmp_path: Path, pair: tuple[str, str]) -> None:
    gguf = tmp_path / "m" / "model-q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert hf_location(str(gguf)) == (gguf.parent, "model-q4.gguf")
    assert hf_location(str(gguf.parent)) == (gguf.parent, "model-q4.gguf")  # a folder holding only a GGUF
    assert hf_location(pair[0]) == (Path(pair[0]), None)  # a Hugging Face folder
    model = load_hf_model(pair[0], torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training


def test_peers_run_interleaved_with_verispec_methods(pair: tuple[str, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.bench.harness import BenchRunner

    calls: list[tuple[int, list[str]]] = []
    run_item = BenchRunner.run_item

    def spy(self: BenchRunner, methods: dict[str, Any], item: Any) -> Any:
        calls.append((item.index, list(methods)))
        return run_item(self, methods, item)

    monkeypatch.setattr(BenchRunner, "run_item", spy)
    data = _write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": f"say {i} things"} for i in range(2)])
    report = run_bench(BenchOptions(model=pair[0], draft=pair[1], methods="none,ngram", dataset=f"jsonl:{data}",
                                    max_tokens=6, dtype="float32", max_len=MAX_LEN, out=str(tmp_path / "out"),
                                    progress=False, plots=False, peers=["hf"], peer_methods=["hf-plain"]))
    # Each prompt runs every method, the peer's included, before the next prompt starts.
    assert calls == [(0, [BASELINE, "ngram", "hf-plain"]), (1, [BASELINE, "ngram", "hf-plain"])]
    mem = {m["method"]: m for m in report["memory"]["methods"]}
    assert report["memory"]["peers_rss_bytes"] >= 0 and mem["hf-plain"]["max_rss_bytes"] > 0
    assert report["peers"]["error"] is None and report["peers"]["libraries"]["hf"]["error"] is None
    assert [r["method"] for r in report["summary"]] == [BASELINE, "ngram", "hf-plain"]


def test_a_failed_run_frees_its_peers_without_probing(pair: tuple[str, str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.bench import command
    from verispec.bench.harness import BenchRunner

    finished: list[Any] = []
    finish = command.LoadedPeers.finish

    def spy(self: Any, first_prompt: list[int] | None, greedy: bool) -> dict[str, Any]:
        info = finish(self, first_prompt, greedy)
        finished.append((first_prompt, dict(self.handles)))
        return info

    def fail(self: BenchRunner, methods: dict[str, Any], item: Any) -> Any:
        raise RuntimeError("the host went away")

    monkeypatch.setattr(command.LoadedPeers, "finish", spy)
    monkeypatch.setattr(BenchRunner, "run_item", fail)
    data = _write_jsonl(tmp_path / "prompts.jsonl", [{"id": "p0", "prompt": "say things"}])
    with pytest.raises(RuntimeError, match="the host went away"):
        run_bench(BenchOptions(model=pair[0], draft=pair[1], methods="none", dataset=f"jsonl:{data}", max_tokens=4,
                               dtype="float32", max_len=MAX_LEN, out=str(tmp_path / "out"), progress=False,
                               plots=False, peers=["hf"], peer_methods=["hf-plain"]))
    assert finished == [(None, {})]  # freed once, no probe prompt


# -- the CLI end to end ------------------------------------------------------------------------------

def test_cli_end_to_end_greedy_with_peers_and_stability(pair: tuple[str, str], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = _write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "p1", "category": "code", "prompt": "def add ( x , y ) : return x + y"},
        {"id": "p2", "category": "code", "prompt": "write code to print hello world"},
        {"id": "p3", "category": "chat", "prompt": "what is the cat ?"},
    ])
    out = tmp_path / "out"
    rc = main(["bench", "--model", pair[0], "--draft", pair[1], "--methods", "none,draft,ngram,draft:policy=cost",
               "--dataset", f"jsonl:{data}", "--max-tokens", "10", "--repeats", "2", "--k-sweep", "2,4",
               "--peers", "hf", "--stability", "--stability-max-tokens", "6", "--dtype", "float32",
               "--max-len", str(MAX_LEN), "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "stability:" in printed

    report = json.loads((out / "report.json").read_text())
    assert set(REPORT_KEYS) <= set(report)
    bad = [(p, x) for p, x in _numbers(report) if not math.isfinite(x)]
    assert not bad, bad
    labels = [r["method"] for r in report["summary"]]
    assert labels[0] == BASELINE
    assert {"draft", "ngram", "draft:policy=cost", "draft:k=2", "draft:k=4", "ngram:k=2", "ngram:k=4",
            "hf-plain", "hf-assisted", "hf-prompt-lookup"} <= set(labels)
    cats = {r["category"] for r in report["per_category"]}
    assert cats == {"code", "chat", "overall"}
    by_cat = report["peers"]["vs_hf_plain_by_category"]
    assert set(by_cat["draft"]) == cats and by_cat["draft"]["code"] > 0
    assert report["peers"]["spec_bench_mean_vs_hf_plain"]["draft"] is None  # no Spec-Bench category ran
    assert "Tokens/s over hf-plain's, per category" in (out / "report.md").read_text()
    # Methods that leave the policy out run the default one, the cost policy, as draft:policy=cost does.
    policy = {m["label"]: m["spec"]["k_policy"] for m in report["methods"] if m["spec"]}
    assert policy["draft"] == policy["draft:k=2"] == policy["draft:policy=cost"] == "cost"
    for r in report["summary"]:
        assert r["tokens_per_s"] > 0 and r["prompts"] == 3
        assert r["speedup"] is not None
        if r["kind"] == "verispec" and policy[r["method"]] == "cost" and not r["acceptance_by_position"]:
            # The cost policy may decide that these tiny models never pay to speculate: then it
            # decodes plainly, one token per step, and has no acceptance to report.
            assert r["mean_accepted_length"] == pytest.approx(1.0) and r["acceptance_rate"] is None
        elif r["kind"] == "verispec":
            assert r["mean_accepted_length"] >= 1.0 and 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["acceptance_by_position"] and r["draft_cost_ratio"] is not None and r["draft_cost_ratio"] > 0
            assert set(r["stage_share"]) == {"prefill", "propose", "score", "verify", "other"}
            assert sum(r["stage_share"].values()) == pytest.approx(1.0, abs=1e-6)
        if r["kind"] == "peer":
            assert r["mean_accepted_length"] is None and r["stage_share"] == {}
    base = report["summary"][0]
    assert base["speedup"] == pytest.approx(1.0) and base["mean_accepted_length"] == pytest.approx(1.0)
    # Greedy speculation is lossless: every verispec method reproduces plain decoding exactly.
    cons = {c["method"]: c for c in report["consistency"]}
    for label, kind in ((r["method"], r["kind"]) for r in report["summary"]):
        if kind == "verispec":
            assert cons[label]["exact_match"] == 1.0 and cons[label]["rouge_l"] == 1.0
            assert cons[label]["bleu"] == pytest.approx(100.0)
    mem = {m["method"]: m for m in report["memory"]["methods"]}
    assert mem["draft"]["draft_model_bytes"] > 0 and mem["draft"]["draft_cache_bytes"] > 0
    assert mem["ngram"]["draft_increment_bytes"] == 0 and mem[BASELINE]["draft_increment_bytes"] == 0
    assert report["memory"]["peak_rss_bytes"] > 0
    peers = report["peers"]
    assert peers["error"] is None and peers["best_method"] and peers["best_vs_hf_assisted"] > 0
    assert report["stability"]["passed"] == report["stability"]["total"] > 0
    assert not any("k=2" in r["method"] for r in report["stability"]["results"])  # sweep variants skipped
    assert len(report["items"]) == 3
    recs = [r for r in report["records"] if r["method"] == "draft"]
    assert len(recs) == 3 and all(len(r["wall_s"]) == 2 and r["repeats_agree"] for r in recs)
    assert report["settings"]["repeats"] == 2 and report["machine"]["threads"] >= 1
    assert report["versions"]["torch"] and report["date"]

    md = (out / "report.md").read_text()
    for heading in ("## Summary", "## Speedup per category", "## Output consistency", "## Memory", "## Peers",
                    "## Stability", "hf-assisted", "tokens/s"):
        assert heading in md
    assert set(report["plots"]) == {"speedup_by_category.png", "acceptance_by_position.png", "stage_breakdown.png",
                                    "speedup_vs_k.png"}
    for name in report["plots"]:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_cli_spec_bench_two_turns_sampled(pair: tuple[str, str], tmp_path: Path) -> None:
    sb = _spec_bench_file(tmp_path / "question.jsonl")
    out = tmp_path / "out"
    rc = main(["bench", "--model", pair[0], "--draft", pair[1], "--methods", "draft:k=3", "--dataset", "spec_bench",
               "--spec-bench", str(sb), "--per-category", "2", "--categories", "mt_bench,qa", "--mt-bench-turns", "2",
               "--max-tokens", "8",
               "--temperature", "0.8", "--top-p", "0.9", "--dtype", "float32", "--max-len", str(MAX_LEN),
               "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    items = report["items"]
    assert len(items) == 6 and sorted(i["turn"] for i in items) == [1, 1, 1, 1, 2, 2]
    records = {(r["method"], r["item"]): r for r in report["records"]}
    for item in (i for i in items if i["turn"] == 2):
        first = next(i for i in items if i["prompt_id"] == item["prompt_id"] and i["turn"] == 1)
        # The second turn carries the baseline's first answer, for every method alike.
        assert item["prompt"][1] == {"role": "assistant", "content": records[BASELINE, first["index"]]["text"]}
    cons = report["consistency"][0]
    assert cons["exact_match"] is None and cons["distribution"]["baseline_tokens"] > 0
    assert "sanity check" in (out / "report.md").read_text()
    assert report["plots"] == [] and report["peers"] is None and report["stability"] is None


def test_layerskip_and_hybrid_draft_memory(pair: tuple[str, str], tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def add ( x , y ) : return x + y"}])
    # Layer-skip at a fixed k: the cost policy cannot profile a drafter that shares the target's cache yet.
    report = run_bench(BenchOptions(model=pair[0], draft=pair[1], methods="layerskip:layers=1,policy=fixed,hybrid",
                                    dataset=f"jsonl:{data}", max_tokens=8, dtype="float32", max_len=MAX_LEN,
                                    out=str(tmp_path / "out"), progress=False, plots=False, stability=True,
                                    stability_max_tokens=4))
    mem = {m["method"]: m for m in report["memory"]["methods"]}
    # Layer-skip drafts with the target's own layers and cache: nothing extra to count.
    assert mem["layerskip:layers=1,policy=fixed"]["draft_increment_bytes"] == 0
    # The hybrid falls back to the draft model, whose weights and cache it holds.
    assert mem["hybrid"]["draft_model_bytes"] > 0 and mem["hybrid"]["draft_cache_bytes"] > 0
    assert all(c["exact_match"] == 1.0 for c in report["consistency"])
    assert report["stability"]["passed"] == report["stability"]["total"]


def test_cli_refuses_bad_settings_before_loading(pair: tuple[str, str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "--model", pair[0], "--out", str(tmp_path), "--dataset", "humaneval", "--n", "1"]
    assert main([*base, "--methods", "draft:k=banana"]) == 2
    assert main([*base, "--peers", "vllm"]) == 2
    assert main([*base, "--repeats", "0"]) == 2
    sb = _spec_bench_file(tmp_path / "question.jsonl")
    assert main([*base[:-4], "--dataset", "spec_bench", "--spec-bench", str(sb), "--categories", "qa,rug"]) == 2
    err = capsys.readouterr().err
    assert "k must be int" in err and "unknown peer" in err and "unknown Spec-Bench categories rug" in err


def test_predictions_in_datasets_and_methods(pair: tuple[str, str], tmp_path: Path) -> None:
    assert parse_method("hybrid:predict=1").predict == "own" and parse_method("hybrid:k=3,predict=other").spec.k == 3
    plain_predicted = parse_method("none:predict=1")
    assert plain_predicted.spec == PLAIN and plain_predicted.predict == "own" and not plain_predicted.is_baseline
    assert parse_method("hybrid:predict=0").predict == ""
    for bad in ("hybrid:predict=yes", "none:predict=1,k=2"):
        with pytest.raises(VerispecError):
            parse_method(bad)
    edits = datasets.load("code_edit,code_edit_polyglot")
    assert len(edits) == 51 and all(p.prediction and p.prediction in p.text for p in edits)
    # The tune split of edits: HumanEval 0-19, quoted as the report split quotes its functions, none of them shared.
    tune = datasets.load("code_edit_tune")
    assert len(tune) == 12 and tune[0].id == "edit_tune-00" and all(p.chat and p.prediction in p.text for p in tune)
    assert not any(t.prediction in e.text for t in tune for e in edits)
    assert [p.id for p in datasets.load("code_edit_tune", n=2)] == ["edit_tune-00", "edit_tune-01"]
    with pytest.raises(VerispecError, match="prediction"):
        datasets.jsonl(_write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "prediction": 3}]))

    data = _write_jsonl(tmp_path / "edits.jsonl", [
        {"id": "e1", "category": "edit", "prompt": "def add ( x , y ) : return x + y", "prediction": "x + y"},
        {"id": "e2", "category": "edit", "prompt": "write code to print hello world", "prediction": "print ( 1 )"},
    ])
    out = tmp_path / "out"
    assert main(["bench", "--model", pair[0], "--draft", pair[1], "--dataset", f"jsonl:{data}", "--methods",
                 "none,hybrid,hybrid:predict=1,hybrid:predict=other,none:predict=1", "--max-tokens", "12",
                 "--dtype", "float32", "--max-len", str(MAX_LEN), "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert {m["label"]: m["predict"] for m in report["methods"]} == {
        BASELINE: "", "hybrid": "", "hybrid:predict=1": "own", "hybrid:predict=other": "other",
        "none:predict=1": "own"}
    tokens = {}
    for r in report["records"]:
        tokens.setdefault(r["item"], set()).add(tuple(r["token_ids"]))
    assert all(len(outputs) == 1 for outputs in tokens.values())  # greedy: every method the same tokens


# -- the axes of a run: kernels, sampling, repeats ------------------------------------------------------------

@pytest.mark.skipif(not kernels.available(), reason="needs verispec's fast kernels on this CPU")
def test_kernels_axis_runs_each_method_on_an_engine_of_its_kernels(pair: tuple[str, str], tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def add ( x , y ) : return x + y"},
                                               {"prompt": "write code to print hello world"}])
    methods = "none,none:kernels=stock,hybrid:kernels=stock"
    report = run_bench(BenchOptions(model=pair[0], draft=pair[1], methods=methods, dataset=f"jsonl:{data}",
                                    max_tokens=8, dtype="float32", weights="int8", draft_weights="int8",
                                    max_len=MAX_LEN, out=str(tmp_path / "out"), progress=False, plots=False))
    ran = {m["label"]: m for m in report["methods"]}
    # The run's kernels (auto: verispec's) for plain decoding, PyTorch's for the methods that ask for them.
    assert (ran[BASELINE]["kernels"], ran[BASELINE]["matmul_kernels"]) == ("auto", "verispec")
    for label in ("none:kernels=stock", "hybrid:kernels=stock"):
        assert (ran[label]["kernels"], ran[label]["matmul_kernels"]) == ("stock", "stock")
    assert report["models"]["kernels"] == "verispec"
    # Speculation on the stock kernels is checked against plain decoding on the same kernels, and is lossless.
    cons = {c["method"]: c for c in report["consistency"]}
    assert ran["hybrid:kernels=stock"]["reference"] == cons["hybrid:kernels=stock"]["reference"] == \
        "none:kernels=stock"
    assert cons["hybrid:kernels=stock"]["exact_match"] == 1.0
    assert cons["none:kernels=stock"]["reference"] == BASELINE
    assert "against" in (tmp_path / "out" / "report.md").read_text()


def test_sampling_axis_and_repeats_side_by_side(pair: tuple[str, str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy and sampled methods in one run: each call gets its method's sampling and the (item, repeat) seed,
    repeats alternate the order of the methods, and each repeat's ratio to plain decoding gives the spread."""
    calls: list[tuple[int, str, float, float, int | None]] = []
    generate = Engine.generate

    def spy(self: Engine, prompts: Any, params: Any = None, spec: Any = None, **kw: Any) -> Any:
        calls.append((len(calls), spec.method if spec is not None and spec.enabled else "none", params.temperature,
                      params.top_p, params.seed))
        return generate(self, prompts, params, spec, **kw)

    monkeypatch.setattr(Engine, "generate", spy)
    data = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "category": "x", "prompt": "what is the cat ?"},
                                               {"id": "b", "category": "y", "prompt": "say 3 things"}])
    out = tmp_path / "out"
    methods = "none,none:temperature=0.8,top_p=0.9,hybrid:temperature=0.8,top_p=0.9,hybrid:policy=fixed,k=3"
    assert main(["bench", "--model", pair[0], "--draft", pair[1], "--methods", methods, "--dataset", f"jsonl:{data}",
                 "--max-tokens", "8", "--repeats", "3", "--dtype", "float32", "--max-len", str(MAX_LEN),
                 "--out", str(out), "--no-progress", "--no-plots"]) == 0
    report = json.loads((out / "report.json").read_text())
    labels = [BASELINE, "none:temperature=0.8,top_p=0.9", "hybrid:temperature=0.8,top_p=0.9", "hybrid:policy=fixed,k=3"]
    assert [r["method"] for r in report["summary"]] == labels
    timed = calls[4:]  # after the warm-up, one call per method
    assert len(timed) == 2 * 3 * 4
    sampling = [(t, p) for _, _, t, p, _ in timed]
    # Repeat 1 in the order asked for, repeat 2 reversed, repeat 3 as asked again.
    greedy, hot = (0.0, 1.0), (0.8, 0.9)
    assert sampling[:12] == [greedy, hot, hot, greedy, greedy, hot, hot, greedy, greedy, hot, hot, greedy]
    assert [m for _, m, *_ in timed[:8]] == ["none", "none", "hybrid", "hybrid", "hybrid", "hybrid", "none", "none"]
    # Every method of one repeat of one prompt draws with the same seed; each repeat with another.
    seeds = [s for *_, s in timed]
    assert len({*seeds[:4]}) == 1 and len({seeds[0], seeds[4], seeds[8]}) == 3
    ran = {m["label"]: m for m in report["methods"]}
    assert ran["hybrid:temperature=0.8,top_p=0.9"]["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}
    assert ran[BASELINE]["sampling"]["temperature"] == 0.0
    cons = {c["method"]: c for c in report["consistency"]}
    # Sampled speculation against sampled plain decoding (a distribution check); greedy against greedy (exact).
    hot_cons = cons["hybrid:temperature=0.8,top_p=0.9"]
    assert hot_cons["reference"] == "none:temperature=0.8,top_p=0.9" and hot_cons["exact_match"] is None
    assert hot_cons["distribution"]["baseline_tokens"] > 0
    assert cons["hybrid:policy=fixed,k=3"]["exact_match"] == 1.0 and cons["hybrid:policy=fixed,k=3"]["reference"] == \
        BASELINE
    assert not report["warnings"]  # sampled repeats differ by design: no warning about them
    # The spread: per method and category, each repeat's tokens/s over plain decoding's in that repeat.
    spread = report["repeat_ratios"][BASELINE]
    assert set(spread) == set(labels[1:]) and set(spread["hybrid:policy=fixed,k=3"]) == {"x", "y", "overall"}
    recs = {(r["method"], r["item"]): r for r in report["records"]}

    def rate(label: str, rep: int) -> float:
        rs = [recs[label, i] for i in (0, 1)]
        return sum(r["tokens"] for r in rs) / sum(r["wall_s"][rep] for r in rs)

    label = "hybrid:policy=fixed,k=3"  # greedy: every repeat has the median record's tokens
    assert spread[label]["overall"] == pytest.approx([rate(label, i) / rate(BASELINE, i) for i in range(3)])
    assert "## Spread over repeats" in (out / "report.md").read_text()


def test_policy_ablation_runs_its_method_with_those_rules_off(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``off=`` switches cost-policy rules off while its method generates, and only then; the output stays exact."""
    from verispec.bench.harness import Item, engine_generate

    method = parse_method("draft:policy=cost,off=probes+lookup_cut")
    assert method.policy_off == {"probes", "lookup_cut"}
    with pytest.raises(VerispecError, match="unknown policy rule"):
        parse_method("draft:off=nonsense")
    with pytest.raises(VerispecError, match="cost policy"):
        parse_method("draft:policy=fixed,off=probes")
    seen: list[frozenset[str]] = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: seen.append(engine.policy.off) or step())
    item = Item(0, "p", "code", 1, "def add ( x , y ) :", chat=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ablated = engine_generate(engine, method.spec, policy_off=method.policy_off)(item, params)
    assert seen and set(seen) == {frozenset({"probes", "lookup_cut"})}
    seen.clear()
    full = engine_generate(engine, method.spec)(item, params)
    assert seen and set(seen) == {frozenset()}
    plain = engine_generate(engine, PLAIN)(item, params)
    assert ablated.token_ids == full.token_ids == plain.token_ids
