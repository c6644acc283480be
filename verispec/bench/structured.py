"""Structured outputs in a benchmark: how many answers are JSON valid under their prompt's schema, what
constraining costs next to the same method unconstrained, and the grammar's time per token.

An answer counts as valid only if its whole text parses as JSON and validates (``jsonschema``) against
the schema its prompt carries (the ``json_extract`` dataset); an unconstrained answer in a Markdown fence
therefore counts as invalid, which is what a client parsing the answer meets.
"""

from __future__ import annotations

import json
from typing import Any

from verispec.bench.datasets import BenchPrompt
from verispec.bench.harness import Item, Record


def _valid(text: str | None, schema: dict[str, Any]) -> tuple[bool, bool]:
    """(the text parses as JSON, and the JSON follows ``schema``)."""
    import jsonschema

    try:
        value = json.loads(text or "")
    except json.JSONDecodeError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def structured(prompts: list[BenchPrompt], items: list[Item], records: dict[str, list[Record]],
               constrained: set[str]) -> list[dict[str, Any]] | None:
    """Per method: answers, the share that is JSON and schema-valid, and the constraint's microseconds per
    generated token (``constrained``: the methods that constrain); None where no prompt has a schema."""
    schemas = {p.id: p.schema for p in prompts if p.schema is not None}
    if not schemas:
        return None
    rows = []
    for label, recs in records.items():
        checked = [(_valid(r.text, schemas[items[r.item].prompt_id]), r) for r in recs
                   if items[r.item].prompt_id in schemas]
        if not checked:
            continue
        tokens = sum(r.metrics.generated_tokens for _, r in checked)
        seconds = sum(r.metrics.constrain_s for _, r in checked)
        rows.append({"method": label, "constrained": label in constrained, "answers": len(checked),
                     "json_valid": sum(j for (j, _), _ in checked) / len(checked),
                     "schema_valid": sum(s for (_, s), _ in checked) / len(checked),
                     "finished": sum(r.finish_reason == "stop" for _, r in checked) / len(checked),
                     "constrain_us_per_token": 1e6 * seconds / tokens if tokens else 0.0})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of :func:`structured`'s rows."""
    out = ["| method | answers | ended by itself | JSON | schema-valid | constraint µs per token |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        us = f"{r['constrain_us_per_token']:.0f}" if r["constrained"] else "–"
        out.append(f"| {r['method']} | {r['answers']} | {r['finished']:.0%} | {r['json_valid']:.0%} | "
                   f"{r['schema_valid']:.0%} | {us} |")
    return "\n".join(out)
