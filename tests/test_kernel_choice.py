"""``--kernels auto``: each model's activation path, chosen on the quality gate and on step times measured here."""

from __future__ import annotations

import pytest
import torch
from tiny import make_tiny

from verispec import hub, kernels
from verispec.engine import kernel_choice
from verispec.engine.kernel_choice import GATE_PPL, activations, choose, gate_passed, set_q8
from verispec.models.loader import build_model, open_source

BOTH = kernel_choice.both_paths()
both_only = pytest.mark.skipif(not BOTH, reason="this CPU runs one int4/int8 activation path only")


@pytest.fixture(autouse=True)
def timings_store(tmp_path, monkeypatch):
    """Each test keeps its own record of timed choices."""
    path = tmp_path / "activations.json"
    monkeypatch.setattr(kernel_choice, "_store", lambda: path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("choice") / "m"
    make_tiny(path, arch="qwen2", vocab=96, layers=2, dim=64, heads=4, kv_heads=2, seed=3)
    return path


def int4(folder, kern: str = "auto"):
    return build_model(open_source(folder), torch.float32, "int4", progress=False, kernels=kern)


@pytest.mark.skipif(not kernels.q8_available(), reason="8-bit activations need verispec's kernels and VNNI or AVX2")
def test_explicit_kernels_are_kept(folder):
    model = int4(folder, "q8")
    assert choose(model, "m", "q8", target=True) == kernel_choice.KernelChoice("q8", "--kernels q8")
    assert activations(model) == "q8"


def test_a_model_without_fast_int4_layers_has_no_activation_path(folder):
    model = build_model(open_source(folder), torch.float32, "dense", progress=False)
    assert activations(model) is None and choose(model, "m", "auto", target=True).activations is None


@both_only
def test_switching_activations_keeps_the_weights_and_moves_the_numbers_a_little(folder):
    model = int4(folder)
    tokens = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17]])
    pos = torch.arange(8)[None]
    set_q8(model, False)
    bf16 = model(tokens, pos, model.new_cache(1, 16))
    set_q8(model, True)
    assert activations(model) == "q8"
    q8 = model(tokens, pos, model.new_cache(1, 16))
    assert not torch.equal(bf16, q8) and torch.allclose(bf16, q8, atol=0.25 * float(bf16.abs().max()))


@both_only
def test_a_target_without_a_gate_measurement_keeps_bf16(folder):
    model = int4(folder)
    set_q8(model, True)
    choice = choose(model, str(folder), "auto", target=True)
    assert choice.activations == "bf16" == activations(model) and "no quality-gate measurement" in choice.reason


@both_only
@pytest.mark.parametrize(("q8_s", "bf16_s", "expect"), [(0.90, 1.0, "q8"), (0.99, 1.0, "bf16"), (1.2, 1.0, "bf16")])
def test_auto_takes_8_bit_activations_only_where_they_are_faster(folder, monkeypatch, q8_s, bf16_s, expect):
    monkeypatch.setattr(kernel_choice, "step_seconds", lambda model: q8_s if activations(model) == "q8" else bf16_s)
    model = int4(folder)
    draft = choose(model, "m", "auto", target=False)  # a draft needs no gate: it cannot change the output
    assert draft.activations == expect == activations(model) and "ms" in draft.reason
    monkeypatch.setitem(hub.REGISTRY, "gated", hub.ModelEntry("gated", "gated.gguf", "", (), 1, "", None, 0.001))
    target = choose(model, "gated", "auto", target=True)
    assert target.activations == expect and "+0.10%" in target.reason


def test_the_gate_reads_the_registry(monkeypatch):
    monkeypatch.setitem(hub.REGISTRY, "near", hub.ModelEntry("near", "near.gguf", "", (), 1, "", None, GATE_PPL / 2))
    monkeypatch.setitem(hub.REGISTRY, "far", hub.ModelEntry("far", "far.gguf", "", (), 1, "", None, 2 * GATE_PPL))
    assert gate_passed("near")[0] and gate_passed("/models/near.gguf")[0]
    assert not gate_passed("far")[0] and "+1.00%" in gate_passed("far")[1]
    assert gate_passed("some/model.gguf") == (False, "no quality-gate measurement for this model")


@both_only
def test_a_timed_choice_is_kept_for_later_loads(folder, monkeypatch, timings_store):
    """The first load times both paths; later loads of the model on this CPU read that outcome, so its numbers
    do not change with how busy the machine was."""
    monkeypatch.setattr(kernel_choice, "step_seconds", lambda model: 0.5 if activations(model) == "q8" else 1.0)
    assert choose(int4(folder), "m", "auto", target=False).activations == "q8"
    assert timings_store.is_file()

    def no_timing(model):
        raise AssertionError("timed again")

    monkeypatch.setattr(kernel_choice, "step_seconds", no_timing)
    model = int4(folder)
    choice = choose(model, "m", "auto", target=False)
    assert choice.activations == "q8" == activations(model) and "500.0 ms" in choice.reason
