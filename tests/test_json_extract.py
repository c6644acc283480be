"""The json_extract set: chat prompts carrying JSON schemas that llguidance compiles on the target's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verispec import VerispecError, hub
from verispec.bench import datasets, grammar_engines
from verispec.bench.grammar_engines import example_instance

TARGET = "qwen2.5-coder-1.5b-instruct"

# What a good answer to json_extract-06 (the robot vacuum review) looks like.
REVIEW = {"product": "Kestrel K2 robot vacuum", "rating": 3,
          "pros": ["strong suction", "handles cat fur on rugs", "easy app setup", "reliable scheduled cleaning"],
          "cons": ["battery lasts about 70 minutes", "gets stuck under the sofa", "small bin"],
          "sentiment": "mixed", "mentions_support": True, "would_recommend": False}


@pytest.fixture(scope="module")
def rows() -> list[datasets.BenchPrompt]:
    return datasets.load("json_extract")


def test_rows_are_chat_prompts_each_with_its_schema(rows: list[datasets.BenchPrompt]) -> None:
    assert len(rows) >= 30
    assert len({r.id for r in rows}) == len(rows)
    for r in rows:
        assert r.chat and r.category == "json_extract" and r.id.startswith("json_extract-")
        assert isinstance(r.schema, dict) and r.schema["type"] == "object" and r.schema["properties"], r.id
        assert json.dumps(r.schema, indent=2) in r.text, f"{r.id}: the prompt does not quote its schema"
        assert "JSON" in r.text and len(r.text.split()) > 100, r.id
    assert sum(r.schema.get("additionalProperties") is False for r in rows) > len(rows) // 2


def test_the_schemas_vary(rows: list[datasets.BenchPrompt]) -> None:
    text = " ".join(json.dumps(r.schema) for r in rows)
    for feature in ('"enum"', '"anyOf"', '"const"', '"minItems"', '"maxItems"', '["string", "null"]',
                    '"type": "integer"', '"type": "number"', '"type": "boolean"', '"items": {"type": "object"'):
        assert feature in text, feature


def test_n_takes_the_first_rows() -> None:
    assert [p.id for p in datasets.load("json_extract", n=3)] == [f"json_extract-0{i}" for i in (1, 2, 3)]


def test_a_schema_that_is_not_an_object_names_its_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    rows = [{"id": "a", "prompt": "x", "schema": {"type": "object"}}, {"id": "b", "prompt": "y", "schema": ["no"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(VerispecError, match="row 2: 'schema' is not a JSON object"):
        datasets.load(f"jsonl:{path}")
    assert datasets.load(f"jsonl:{path}", n=1)[0].schema == {"type": "object"}
    assert datasets.jsonl(path, n=1)[0].schema == {"type": "object"}


def test_example_instance_follows_the_schema() -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
        "one": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 1},
        "pay": {"anyOf": [{"type": "object", "properties": {"kind": {"const": "card"}}}, {"type": "null"}]}}}
    assert example_instance(schema) == {"name": "example name", "n": 42, "x": 3.25,
                                        "tags": ["example tags"] * 3, "one": ["a"], "pay": {"kind": "card"}}


def test_an_engine_not_installed_is_listed_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(grammar_engines.SETUPS, "xgrammar", ("no_such_grammar_engine", grammar_engines.xgrammar_engine))
    res = grammar_engines.measure("xgrammar", None, 0, [("s", {"type": "object"})], None).summary()
    assert res["status"] == "not installed" and "not installed" in grammar_engines.table([res])


@pytest.fixture(scope="module")
def llg_tokenizer() -> Any:
    llguidance_hf = pytest.importorskip("llguidance.hf")
    if not hub.is_installed(TARGET):
        pytest.fail(f"{TARGET} is not installed; run: make models")
    from verispec.models.loader import load_tokenizer, open_source

    src = open_source(TARGET)
    tok = load_tokenizer(src)
    return tok, llguidance_hf.from_tokenizer(tok, src.args.vocab_size)


def _walk(llg_tokenizer: Any, schema: dict, text: str) -> bool:
    """Whether llguidance's matcher for ``schema`` takes every token of ``text`` and may stop after them."""
    import llguidance

    tok, lltok = llg_tokenizer
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.real
def test_every_schema_compiles_in_llguidance(rows: list[datasets.BenchPrompt], llg_tokenizer: Any) -> None:
    import llguidance

    for r in rows:
        m = llguidance.LLMatcher(llg_tokenizer[1], llguidance.LLMatcher.grammar_from_json_schema(r.schema))
        assert not m.is_error(), f"{r.id}: {m.get_error()}"


@pytest.mark.real
def test_a_known_answer_walks_to_acceptance(rows: list[datasets.BenchPrompt], llg_tokenizer: Any) -> None:
    schema = next(r.schema for r in rows if r.id == "json_extract-06")
    assert _walk(llg_tokenizer, schema, json.dumps(REVIEW))
    assert _walk(llg_tokenizer, schema, json.dumps(REVIEW, indent=2))
    assert not _walk(llg_tokenizer, schema, json.dumps({**REVIEW, "rating": 6}))
    assert not _walk(llg_tokenizer, schema, json.dumps({**REVIEW, "price": 199}))  # additionalProperties: false
    assert not _walk(llg_tokenizer, schema, json.dumps(REVIEW)[:-1])  # unfinished


@pytest.mark.real
def test_every_schema_accepts_its_example_instance(rows: list[datasets.BenchPrompt], llg_tokenizer: Any) -> None:
    for r in rows:
        assert _walk(llg_tokenizer, r.schema, json.dumps(example_instance(r.schema))), r.id
