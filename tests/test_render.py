"""verispec.bench.render: published reports kept lean without changing a figure, and the results page
stating one host with the other hosts' runs as one table each."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

from verispec.bench import render
from verispec.bench.report import markdown

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def published(step: str) -> dict:
    return json.loads((RESULTS / step / "report.json").read_text(encoding="utf-8"))


def full_report(lean: dict) -> dict:
    """A published (lean) report with what a fresh `verispec bench` report also holds put back."""
    full = copy.deepcopy(lean)
    for item in full["items"]:
        item["prompt"] = f"prompt {item['index']}"
    for i, r in enumerate(full["records"]):
        r.pop("digest", None)
        r["token_ids"] = [i % 7] * r["tokens"]  # equal outputs for equal (i % 7, length)
        r["text"] = "x" * r["tokens"]
        r["metrics"] = {"generated_tokens": r["tokens"]}
    full["versions"]["git_commit"] = "0" * 40
    return full


def test_a_lean_report_renders_as_the_full_one_and_keeps_a_digest_per_output() -> None:
    full = full_report(published("int4_long"))
    lean = render.lean_report(full)
    assert markdown(lean) == markdown(full)  # report.md, every table of it
    assert "git_commit" not in lean["versions"] and lean["versions"]["torch"] == full["versions"]["torch"]
    assert all("prompt" not in item for item in lean["items"])
    assert {"token_ids", "text", "metrics"}.isdisjoint(set().union(*lean["records"]))
    assert [r["tokens"] for r in lean["records"]] == [r["tokens"] for r in full["records"]]
    by_output = {}
    for r, f in zip(lean["records"], full["records"], strict=True):
        by_output.setdefault(r["digest"], set()).add(tuple(f["token_ids"]))
    assert all(len(outputs) == 1 for outputs in by_output.values())  # one digest, one output
    assert len(by_output) == len({tuple(f["token_ids"]) for f in full["records"]})
    assert render.lean_report(lean) == lean  # tidying again changes nothing
    assert len(json.dumps(lean)) < len(json.dumps(full)) / 2


def test_tidy_leaves_the_page_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "results"
    shutil.copytree(RESULTS / "int4_long", root / "int4_long")
    report = root / "int4_long" / "report.json"
    report.write_text(json.dumps(full_report(published("int4_long")), indent=1), encoding="utf-8")
    before = render.results_page(root, tmp_path)
    render.compact_json(report)
    assert render.results_page(root, tmp_path) == before
    assert report.stat().st_size < 200_000


def test_the_page_states_its_host_once_and_other_hosts_as_one_table_each(tmp_path: Path) -> None:
    root = tmp_path / "results"
    for step in ("int4_long", "report", "trees", "prefix_reuse", "verify_cost"):
        shutil.copytree(RESULTS / step, root / step)
    hosts = {step: render.host(render.step_machine(root / step)) for step in ("int4_long", "trees", "verify_cost")}
    assert len(set(hosts.values())) == 3, "the published reports no longer come from three hosts"
    # The page's host is that of README's table's run (the long answers, then the report split).
    latest = next(step for step in render.README_STEPS if (root / step).is_dir())
    page = render.results_page(root, tmp_path)
    main = hosts[latest]
    assert page.count(main) == 1 and f"**Host**: {main}." in page
    title = next(s.title for s in render.SECTIONS if s.step == latest)
    assert page.count(f"## {title}") == 1
    assert "Host:" not in page  # no section repeats a host
    other = page[page.index("## Other hosts"):]
    elsewhere = [step for step in ("int4_long", "trees", "prefix_reuse", "verify_cost")
                 if render.host(render.step_machine(root / step)) != main]
    for step in elsewhere:
        assert f"\n## {next(s.title for s in render.SECTIONS if s.step == step)}" not in page
        assert other.count(f"(`{step}`)") == 1
    assert other.count("| result | run of | figures | report |") == 2  # one table per other host
    assert all(other.count(h) == 1 for h in set(hosts.values()) - {main})
    assert "[report.md](results/trees/report.md)" in other
    # A headline's figures read from the JSON are those the step's own report shows.
    rows = {(r["spec"], r["prefix reuse"]): r for r in render.md_rows(root / "prefix_reuse" / "prefix_reuse.md")}
    off, on = rows["none", "off"], rows["none", "on"]
    assert f"none: {off['TTFT s']} s to {on['TTFT s']} s ({on['speedup']})" in other


def test_the_results_say_when_llama_cpp_was_built_without_the_hosts_amx() -> None:
    def line(cpu: str, system_info: str) -> str:
        lib = {"version": "0.3.36", "n_threads": 2, "extra_buffer_types": True, "system_info": system_info}
        return render.peers_line({"machine": {"cpu": cpu}, "peers": {"libraries": {"llamacpp": lib}}})

    assert "built without AMX" in line("Xeon (AVX-512 BF16, AMX)", "AVX512 = 1 | REPACK = 1")
    assert "built without AMX" not in line("Xeon (AVX-512 BF16, AMX)", "AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1")
    assert "built without AMX" not in line("EPYC (AVX-512 BF16)", "AVX512 = 1 | REPACK = 1")


def test_docs_stay_small() -> None:
    docs = RESULTS.parent
    size = sum(p.stat().st_size for p in docs.rglob("*") if p.is_file())
    assert size < 3 * 2**20, f"docs/ holds {size / 2**20:.1f} MiB; keep published reports lean (render --tidy)"


def test_every_published_step_renders_as_a_section_and_as_a_row() -> None:
    present = [s for s in render.SECTIONS if (RESULTS / s.step).is_dir()]
    assert {s.step for s in present} == {p.name for p in RESULTS.iterdir() if p.is_dir()}, "a folder no step renders"
    for s in present:
        assert s.render(RESULTS / s.step, RESULTS.parent)
        assert re.search(r"\d\.\d\d?x?\b", s.headline(RESULTS / s.step)), s.step  # a figure, read from the report
        assert (RESULTS / s.step / s.report).is_file()


def clients_report(base: dict) -> dict:
    """A ``verispec bench --clients`` report's shape, rows as verispec.bench.clients.summarize writes them."""
    def row(clients: str, method: str, tps: float, vs: float) -> dict:
        return {"clients": clients, "method": method, "requests": 4, "tokens_per_s": tps, "vs_plain": vs,
                "vs_plain_runs": [vs, vs], "latency_p50_s": 1.0, "latency_p95_s": 1.5, "ttft_p50_s": 0.1,
                "accepted_per_step": 2.0, "policy_k": {"3": 5}, "width": {}, "beyond_prefill_vs_plain": vs,
                "beyond_prefill_vs_plain_runs": [vs, vs]}
    keys = ("title", "date", "settings", "models", "machine", "versions", "methods", "warnings")
    return {**{k: base[k] for k in keys}, "prompts": 4, "plots": [],
            "clients": [row("1", "plain", 10.0, 1.0), row("1", "hybrid", 13.0, 1.3),
                        row("2", "plain", 18.0, 1.0), row("2", "hybrid", 21.6, 1.2)]}


def test_steps_rerun_through_verispec_bench_render_from_their_report_json(tmp_path: Path) -> None:
    """A step that ran as a script renders from its script's files; rerun as `verispec bench` (a report.json,
    or one per subfolder as concurrency's client levels) it renders as a bench report, here or on another host."""
    root = tmp_path / "results"
    shutil.copytree(RESULTS / "int4_long", root / "int4_long")
    shutil.copytree(RESULTS / "report", root / "report")  # README's table: its host is the page's
    shutil.copytree(RESULTS / "report", root / "sampling")  # a bench report where sampling_speed.json was
    for part in ("1-4", "8-16"):
        (root / "concurrency" / part).mkdir(parents=True)
        (root / "concurrency" / part / "report.json").write_text(json.dumps(clients_report(published("report"))))
    shutil.copytree(RESULTS / "trees", root / "q8")  # a bench report from another host
    page = render.results_page(root, tmp_path)
    sampling = page[page.index("## What sampling costs"):page.index("## Other hosts")]
    hybrid = next(r for r in published("report")["summary"] if r["method"] == "hybrid")
    assert f"| hybrid | {hybrid['tokens_per_s']:.2f} | {hybrid['speedup']:.2f}x |" in sampling
    assert "[report.md](results/sampling/report.md)" in sampling
    concurrency = page[page.index("## Concurrency"):page.index("## What sampling costs")]
    assert concurrency.count("| clients | method |") == 2 and "**1-4** ([report](results/concurrency/1-4/report.md))" \
        in concurrency and "| 2 | hybrid | 4 | 21.6 | 1.20x (1.20-1.20) |" in concurrency
    q8 = page[page.index("(`q8`)"):].splitlines()[0]
    assert "over plain decoding: `hybrid:lookup=suffix,global=0` 1.54x" in q8 and "(results/q8/report.md)" in q8
    concurrency_step = next(s for s in render.SECTIONS if s.step == "concurrency")
    headline, report = concurrency_step.row(root / "concurrency")
    assert report == "1-4/report.md"
    assert headline.count("`hybrid` at 1 client 1.30x") == 2 and "`hybrid` at 2 clients 1.20x" in headline


def test_the_page_host_is_the_host_of_readmes_table(tmp_path: Path) -> None:
    """A later run on another host of a step outside README's table goes to that host's rows; the page keeps
    the host of the report split."""
    root = tmp_path / "results"
    shutil.copytree(RESULTS / "report", root / "report")
    shutil.copytree(RESULTS / "trees", root / "structured")  # another host's run
    machine = json.loads((root / "structured" / "machine.json").read_text())
    machine["date"] = "2099-01-01T00:00:00"
    (root / "structured" / "machine.json").write_text(json.dumps(machine))
    page = render.results_page(root, tmp_path)
    report_host = render.host(render.step_machine(root / "report"))
    assert report_host in page.split("## Contents")[0]
    assert "## The report split" in page and "(`structured`) | 2099-01-01" in page
