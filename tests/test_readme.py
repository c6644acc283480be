"""README.md's Quick use, run as written, on the small model.

Every fenced ``bash`` and ``python`` block between ``<!-- quick-use:begin`` and
``<!-- quick-use:end -->`` is taken from the README. The Qwen pair becomes smollm2-135m-instruct (it
has no draft partner, so ``--draft auto`` / ``draft="auto"`` runs it without a draft), answers get a
few tokens and benchmarks one prompt per dataset. Then:

- ``verispec`` commands run (``generate``, ``models``, ``bench``, ...), except the two that do not
  return, ``serve`` and the interactive ``chat``: those are parsed by the CLI's own parser, so
  their flags must exist (tests/test_server*.py and the chat tests run them);
- ``make``, ``pip`` and ``curl`` lines are skipped (set-up, and a request to a running server);
- python blocks run in a fresh interpreter.

Running needs the real model (``real``); parsing does not. One more test checks that README's
results table and docs/results.md are what ``python -m verispec.bench.render`` renders from docs/results/
(tests/test_render.py tests the renderer itself).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from verispec import hub

ROOT = Path(__file__).resolve().parents[1]
SMOL = "smollm2-135m-instruct"
BIG = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
MAX_TOKENS = 8
SMALLER = {"--max-tokens": str(MAX_TOKENS), "--per-category": "1", "--n": "1"}  # flag: value in the test
NOT_RUN = {"serve", "chat"}  # never return: parsed, not run
SKIPPED = {"make", "pip", "curl"}


def quick_use() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = text.find("<!-- quick-use:begin"), text.find("<!-- quick-use:end -->")
    assert 0 <= start < end, "README.md has no <!-- quick-use:begin ... --> ... <!-- quick-use:end --> section"
    return text[start:end]


def blocks(lang: str) -> list[str]:
    return [body for kind, body in re.findall(r"```(\w+)\n(.*?)```", quick_use(), re.S) if kind == lang]


def commands() -> list[list[str]]:
    """Every command of the bash blocks as argv, backslash continuations joined and comments dropped."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def small(text: str) -> str:
    for name in BIG:
        text = text.replace(name, SMOL)
    return text


def smaller(argv: list[str]) -> list[str]:
    """The small model, a few tokens and a few prompts; --max-tokens added to generate if it has none."""
    argv = [small(a) for a in argv]
    for i, a in enumerate(argv[:-1]):
        if a in SMALLER:
            argv[i + 1] = SMALLER[a]
    if argv[1] == "generate" and "--max-tokens" not in argv:
        argv += ["--max-tokens", str(MAX_TOKENS)]
    if argv[1] == "bench" and "spec_bench" in argv and "--categories" not in argv:
        argv += ["--categories", "qa"]  # one Spec-Bench category of the six
    return argv


def verispec_commands() -> list[list[str]]:
    cmds = commands()
    unknown = [c for c in cmds if c[0] != "verispec" and c[0] not in SKIPPED]
    assert not unknown, f"Quick use has commands this test does not know how to check: {unknown}"
    return [c for c in cmds if c[0] == "verispec"]


def _ids(cmds: list[list[str]]) -> list[str]:
    return [" ".join(c[1:3]) + f" #{i}" for i, c in enumerate(cmds)]


def env() -> dict[str, str]:
    """This checkout's verispec first, whichever checkout the environment installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


RUN = [c for c in verispec_commands() if c[1] not in NOT_RUN]
PARSE = [c for c in verispec_commands() if c[1] in NOT_RUN]


@pytest.fixture(scope="module")
def installed() -> None:
    if not hub.is_installed(SMOL):
        pytest.fail(f"{SMOL} is not installed; run: make models")


def test_the_quick_use_section_has_what_this_test_checks() -> None:
    subcommands = {c[1] for c in verispec_commands()}
    assert {"generate", "bench", "serve", "chat"} <= subcommands
    assert any(c[1] == "generate" and "--json" in c for c in verispec_commands())
    assert blocks("python"), "Quick use has no python block"


@pytest.mark.real
@pytest.mark.parametrize("argv", RUN, ids=_ids(RUN))
def test_command_runs(argv: list[str], tmp_path: Path, installed: None) -> None:
    argv = smaller(argv)
    done = subprocess.run([sys.executable, "-m", "verispec.cli", *argv[1:]], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    if argv[1] == "generate" and "--json" in argv:
        out = json.loads(done.stdout)
        assert {"text", "metrics", "config"} <= set(out), sorted(out)
        tokens = out.get("token_ids", out.get("tokens"))
        assert tokens is not None and 0 < len(tokens) <= MAX_TOKENS, sorted(out)
    elif argv[1] == "generate":
        assert done.stdout.strip(), "generate printed no text"
    elif argv[1] == "bench":
        assert (tmp_path / "bench_out" / "report.json").is_file()


@pytest.mark.parametrize("argv", PARSE, ids=_ids(PARSE))
def test_command_parses(argv: list[str]) -> None:
    from verispec.cli import build_parser

    args = build_parser().parse_args(smaller(argv)[1:])  # SystemExit (a failure) on an unknown flag or value
    assert args.command == argv[1]


@pytest.mark.real
@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[0][:40])
def test_python_block_runs(code: str, tmp_path: Path, installed: None) -> None:
    code = re.sub(r"max_tokens=\d+", f"max_tokens={MAX_TOKENS}", small(code))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"the README's python block failed:\n{code}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), "the python block printed nothing"


def test_the_results_are_rendered_from_the_reports() -> None:
    done = subprocess.run([sys.executable, "-m", "verispec.bench.render", "--check"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + "\nrun: python -m verispec.bench.render"
