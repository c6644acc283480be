"""Spec-Bench ships inside the package: a clone (or an installed wheel) needs no data folder beside it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from verispec.bench import datasets

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "verispec" / "bench" / "data"
SPEC_BENCH_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
# The old location of the data, beside the checkout; assembled here so this file never matches itself.
OUTSIDE = ("../" + "shared", "shared" + "/data")


def test_packaged_spec_bench_is_the_published_file_and_ships_as_package_data() -> None:
    path = datasets.default_spec_bench()
    assert path == DATA / "spec_bench.jsonl" and "VERISPEC_SPEC_BENCH" not in os.environ
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == SPEC_BENCH_SHA256
    assert raw.count(b"\n") == 480
    sources = (DATA / "SOURCES.md").read_text()
    assert SPEC_BENCH_SHA256 in sources and "hemingkx/Spec-Bench" in sources and "Apache-2.0" in sources
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["verispec.bench"]
    for shipped in ("data/spec_bench.jsonl", "data/SOURCES.md"):
        assert any(fnmatch(shipped, p) for p in patterns), shipped


def test_spec_bench_override_still_wins(tmp_path: Path, monkeypatch) -> None:
    mine = tmp_path / "q.jsonl"
    mine.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["why?"]}) + "\n")
    monkeypatch.setenv("VERISPEC_SPEC_BENCH", str(mine))
    assert [p.text for p in datasets.spec_bench()] == ["why?"]


def _clone(tmp_path: Path) -> Path:
    """The package and the bench scripts alone, far from any checkout."""
    clone = tmp_path / "clone"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "verispec", clone / "verispec", ignore=ignore)
    shutil.copytree(ROOT / "bench", clone / "bench", ignore=ignore)
    for parent in clone.parents:  # nothing like the old data folder anywhere above the copy
        assert not (parent / "shared" / "data" / "spec_bench").exists(), parent
    return clone


def _env(clone: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VERISPEC_SPEC_BENCH"}
    env["PYTHONPATH"] = str(clone)
    return env


LOADER = """
import json, sys
import verispec
from verispec.bench import datasets
every = datasets.spec_bench()
sample = datasets.spec_bench(per_category=2, seed=3)
print(json.dumps({"package": verispec.__file__, "rows": len(every), "categories": sorted({p.category for p in every}),
                  "sample": [p.id for p in sample]}))
"""


def test_a_copy_of_the_package_loads_spec_bench_on_its_own(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    r = subprocess.run([sys.executable, "-c", LOADER], cwd=clone, env=_env(clone), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert Path(got["package"]).is_relative_to(clone)  # the copy ran, not the checkout
    assert got["rows"] == 480
    assert got["categories"] == sorted(datasets.SPEC_BENCH_CATEGORIES)
    expected = datasets.spec_bench(DATA / "spec_bench.jsonl", per_category=2, seed=3)
    assert got["sample"] == [p.id for p in expected] and len(expected) == 12



def test_nothing_refers_to_a_data_folder_outside_the_repository() -> None:
    files = [ROOT / "Makefile"]
    for folder in ("verispec", "bench", "tests", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) > 50
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert not found, found
