"""`verispec generate` (chat template, streaming) and its printer, on a tiny model with a tokenizer."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from drafters_common import build_no_template_model, build_tok_model

from verispec import Engine, SamplingParams
from verispec.cli import main
from verispec.console import ACCEPTED, RESET, AnswerPrinter, use_colour
from verispec.engine.stopping import StepTokens

MAX_LEN = 128
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tok_model(tmp_path_factory.mktemp("generate_model"))


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_no_template_model(tmp_path_factory.mktemp("raw_model"))


@pytest.fixture(scope="module")
def engine(tok_model: Path) -> Engine:
    return Engine.from_pretrained(str(tok_model), dtype="float32", max_len=MAX_LEN, progress=False)


def _generate_args(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--dtype", "float32", "--max-len", str(MAX_LEN), "--prompt",
            "hello world", "--max-tokens", "12", *extra]


def _json_run(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- generate ---------------------------------------------------------------------------------

def test_generate_applies_the_chat_template_unless_raw(tok_model, engine, capsys):
    templated = len(engine.encode("hello world", chat=True))
    raw = len(engine.encode("hello world"))
    assert templated != raw
    assert _json_run(capsys, _generate_args(tok_model))["metrics"]["prompt_tokens"] == templated
    assert _json_run(capsys, _generate_args(tok_model, "--chat"))["metrics"]["prompt_tokens"] == templated
    assert _json_run(capsys, _generate_args(tok_model, "--raw"))["metrics"]["prompt_tokens"] == raw


def test_generate_without_a_template_sends_the_prompt_raw(no_template_model, engine, capsys):
    raw = len(engine.encode("hello world"))
    assert _json_run(capsys, _generate_args(no_template_model))["metrics"]["prompt_tokens"] == raw
    assert main(_generate_args(no_template_model, "--chat")) == 2
    assert "no chat template" in capsys.readouterr().err


def test_generate_streams_exactly_the_final_text(tok_model, engine, capsys, monkeypatch):
    """Text is written while generating, and joins to the result's text even where a stop string cuts it."""
    full = engine.generate("hello world", SamplingParams(max_tokens=12, ignore_eos=True), chat=True)[0]
    words = full.text.split()
    stop = f"{words[4]} {words[5]}"  # two tokens: the first must be held back until the second is known
    args = _generate_args(tok_model, "--stop", stop, "--ignore-eos")
    expected = _json_run(capsys, args)
    assert expected["finish_reason"] == "stop" and stop not in expected["text"]

    writes: list[tuple[str, bool]] = []  # (text, whether generation had returned)
    done = [False]
    generate = Engine.generate

    def tracked(self, *a, **kw):
        result = generate(self, *a, **kw)
        done[0] = True
        return result

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            writes.append((s, done[0]))
            return super().write(s)

    monkeypatch.setattr(Engine, "generate", tracked)
    monkeypatch.setattr(sys, "stdout", Recorder())
    assert main(args) == 0
    assert "".join(s for s, _ in writes) == expected["text"] + "\n"
    assert any(s.strip() and not after for s, after in writes)  # streamed, not printed at the end
    assert "tokens/s" in capsys.readouterr().err


# -- the printer --------------------------------------------------------------------------------

def test_printer_colours_accepted_drafts_only(engine):
    ids = engine.tokenizer.convert_tokens_to_ids("the cat is on the dog".split())
    out = io.StringIO()
    printer = AnswerPrinter(engine.tokenizer, (), out, colour=True)
    for chunk in (StepTokens(ids[:3], 2), StepTokens(ids[3:4], 0), StepTokens(ids[4:], 1)):
        printer.push(chunk)
    printer.finish(engine.decode(ids))
    assert out.getvalue() == f"{ACCEPTED}the cat{RESET} is on{ACCEPTED} the{RESET} dog"
    assert printer.shown == ANSI.sub("", out.getvalue()) == "the cat is on the dog"

    plain = io.StringIO()
    printer = AnswerPrinter(engine.tokenizer, (), plain, colour=False)
    printer.push(StepTokens(ids, 5))
    printer.finish(engine.decode(ids))
    assert plain.getvalue() == "the cat is on the dog"


def test_colour_only_on_a_terminal_without_no_color(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_colour(Tty()) and not use_colour(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(Tty())
    monkeypatch.setenv("NO_COLOR", "")
    assert use_colour(Tty())


def test_generate_with_a_prediction_file(tok_model, capsys, tmp_path):
    plain = _json_run(capsys, _generate_args(tok_model, "--ignore-eos"))
    answer = tmp_path / "answer.txt"
    answer.write_text(plain["text"], encoding="utf-8")
    predicted = _json_run(capsys, _generate_args(tok_model, "--ignore-eos", "--prediction", str(answer)))
    assert predicted["token_ids"] == plain["token_ids"]
    assert predicted["metrics"]["accepted_prediction_tokens"] >= 6
    assert predicted["metrics"]["steps"] < plain["metrics"]["steps"]
    assert main(_generate_args(tok_model, "--ignore-eos", "--prediction", str(answer))) == 0
    assert "[prediction: " in capsys.readouterr().err
    assert main(_generate_args(tok_model, "--prediction", str(tmp_path / "missing.txt"))) == 2
    assert "--prediction: cannot read" in capsys.readouterr().err
