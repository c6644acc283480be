"""Everything a user can get wrong raises VerispecError with a useful message, never another exception."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from verispec import Engine, EngineConfig, SamplingParams, SpecConfig, VerispecError
from verispec.models.loader import build_model, open_source


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    # Nothing here may install, read or write real models: point the cache somewhere empty.
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "verispec_home"))


def make_engine(target, draft=None, max_len=64) -> Engine:
    cfg = EngineConfig(model="tiny", dtype="float32", max_len=max_len, progress=False)
    return Engine(cfg, target.model, None, {1}, draft=None if draft is None else draft.model)


@pytest.fixture(scope="module")
def engine(qwen2_tiny) -> Engine:
    return make_engine(qwen2_tiny, max_len=16)


# -- model sources ----------------------------------------------------------------------------

def test_unknown_model_name():
    with pytest.raises(VerispecError, match="no-such-model"):
        Engine.from_pretrained("no-such-model")


def test_missing_file():
    with pytest.raises(VerispecError, match="/nonexistent/x.gguf"):
        Engine.from_pretrained("/nonexistent/x.gguf")
    with pytest.raises(VerispecError):
        open_source("/nonexistent/x.gguf")


def test_unknown_draft_name(qwen2_tiny):
    with pytest.raises(VerispecError, match="no-such-draft"):
        Engine.from_pretrained(qwen2_tiny.path, draft="no-such-draft", dtype="float32", progress=False)


@pytest.mark.parametrize("content", [
    pytest.param(np.random.default_rng(0).bytes(4096), id="random-bytes"),
    pytest.param(b"GGUF" + bytes(range(256)) * 8, id="gguf-magic-then-garbage"),
    pytest.param(b"", id="empty"),
])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(VerispecError, match="x.gguf"):
        open_source(path)
    with pytest.raises(VerispecError):
        Engine.from_pretrained(str(path), dtype="float32", progress=False)


def _write_gguf(path, arch: str) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("foo.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_of_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2")
    with pytest.raises(VerispecError, match="gpt2"):
        open_source(path)


def test_gguf_without_weights(tmp_path):
    path = tmp_path / "empty-llama.gguf"
    _write_gguf(path, "llama")
    with pytest.raises(VerispecError):
        open_source(path)


def test_not_a_model_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(VerispecError):
        open_source(path)


def test_folder_without_config(tmp_path):
    with pytest.raises(VerispecError, match="config.json"):
        open_source(tmp_path)


def test_folder_without_weights(tmp_path, qwen2_tiny):
    shutil.copy(qwen2_tiny.folder / "config.json", tmp_path / "config.json")
    with pytest.raises(VerispecError, match="safetensors"):
        open_source(tmp_path)


def test_folder_with_corrupt_weights(tmp_path, qwen2_tiny):
    shutil.copy(qwen2_tiny.folder / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(1000))
    with pytest.raises(VerispecError):
        build_model(open_source(tmp_path), torch.float32, progress=False)


def test_folder_of_unsupported_architecture(tmp_path, qwen2_tiny):
    cfg = json.loads((qwen2_tiny.folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(qwen2_tiny.folder / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(VerispecError, match="gpt2"):
        open_source(tmp_path)


def test_incomplete_checkpoint(tmp_path, qwen2_tiny):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(qwen2_tiny.folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(qwen2_tiny.folder / "config.json", tmp_path / "config.json")
    with pytest.raises(VerispecError, match="down_proj"):
        Engine.from_pretrained(str(tmp_path), dtype="float32", progress=False)


# -- engine configuration ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    pytest.param({"dtype": "float8"}, id="dtype"),
    pytest.param({"draft_dtype": "int4"}, id="draft_dtype"),
    pytest.param({"weights": "int3"}, id="weights"),
    pytest.param({"draft_weights": "nf4"}, id="draft_weights"),
    pytest.param({"max_len": 1}, id="max_len"),
])
def test_bad_engine_config(kwargs):
    with pytest.raises(VerispecError):
        EngineConfig(model="tiny", **kwargs)


def test_draft_target_vocabulary_mismatch(qwen2_tiny, other_vocab_draft):
    assert other_vocab_draft.model.args.vocab_size != qwen2_tiny.model.args.vocab_size
    with pytest.raises(VerispecError, match="vocabular"):
        make_engine(qwen2_tiny, other_vocab_draft)
    with pytest.raises(VerispecError, match="vocabular"):
        Engine.from_pretrained(qwen2_tiny.path, draft=other_vocab_draft.path, dtype="float32", progress=False)


def test_draft_method_without_draft_model(engine):
    with pytest.raises(VerispecError, match="draft"):
        engine.generate([3, 4], SamplingParams(max_tokens=2), SpecConfig(k_policy="fixed", method="draft", k=2))


def test_context_longer_than_the_model_supports(qwen2_tiny):
    # The tiny model has 512 positions: a larger cache is refused up front, not an IndexError mid-way.
    limit = qwen2_tiny.model.args.max_position_embeddings
    with pytest.raises(VerispecError, match="context length"):
        make_engine(qwen2_tiny, max_len=limit + 64)


# -- sampling and speculation settings --------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    pytest.param({"max_tokens": 0}, id="max_tokens=0"),
    pytest.param({"max_tokens": -3}, id="max_tokens<0"),
    pytest.param({"max_tokens": 2.5}, id="max_tokens-float"),
    pytest.param({"temperature": -0.1}, id="temperature<0"),
    pytest.param({"temperature": float("nan")}, id="temperature-nan"),
    pytest.param({"top_p": 0.0}, id="top_p=0"),
    pytest.param({"top_p": 1.5}, id="top_p=1.5"),
    pytest.param({"top_p": -0.5}, id="top_p<0"),
    pytest.param({"top_k": -1}, id="top_k<0"),
    pytest.param({"stop": ("",)}, id="empty-stop"),
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(VerispecError):
        SamplingParams(**kwargs)


def test_good_sampling_params_edges():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=1)


@pytest.mark.parametrize("kwargs", [
    pytest.param({"method": "medusa"}, id="unknown-method"),
    pytest.param({"method": ""}, id="empty-method"),
    pytest.param({"k": -1}, id="k=-1"),
    pytest.param({"k": 65}, id="k=65"),
    pytest.param({"k": 1000}, id="k=1000"),
    pytest.param({"k": 2.0}, id="k-float"),
    pytest.param({"k_policy": "magic"}, id="k_policy"),
    pytest.param({"confidence": 1.0}, id="confidence=1"),
    pytest.param({"confidence": -0.1}, id="confidence<0"),
    pytest.param({"confidence": "high"}, id="confidence-str"),
    pytest.param({"confidence": True}, id="confidence-bool"),
    pytest.param({"ngram_min": 0}, id="ngram_min=0"),
    pytest.param({"ngram_min": 5, "ngram_max": 3}, id="ngram_min>max"),
])
def test_bad_spec_config(kwargs):
    with pytest.raises(VerispecError):
        SpecConfig(**kwargs)


def test_confidence_stop_applies_under_the_policy_that_asks_for_it():
    assert SpecConfig(k_policy="confidence").min_confidence == 0.3
    assert SpecConfig(k_policy="confidence", confidence=0.5).min_confidence == 0.5
    assert SpecConfig(k_policy="cost").min_confidence == 0.0
    assert SpecConfig(k_policy="cost", confidence=0.4).min_confidence == 0.4
    assert SpecConfig(k_policy="fixed", confidence=0).min_confidence == 0.0


def test_k_range_edges():
    assert not SpecConfig(k_policy="fixed", method="draft", k=0).enabled
    assert SpecConfig(k_policy="fixed", method="draft", k=64).enabled


# -- prompts ----------------------------------------------------------------------------------

def test_prompt_longer_than_the_cache(engine):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    max_len = engine.config.max_len
    for n in (max_len, max_len + 1, 5 * max_len):
        with pytest.raises(VerispecError, match="context"):
            engine.generate([[2] * n], params)
    # One position left is enough for one token.
    r = engine.generate([[2] * (max_len - 1)], params)[0]
    assert len(r.token_ids) == 1 and r.finish_reason == "length"


def test_empty_prompt_without_tokenizer(engine):
    with pytest.raises(VerispecError, match="empty"):
        engine.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(VerispecError):
        engine.encode([])


def test_text_prompt_without_tokenizer(engine):
    for prompt in ("hello", ""):
        with pytest.raises(VerispecError, match="tokenizer"):
            engine.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(VerispecError):
        engine.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))


def test_stop_strings_without_tokenizer(engine):
    with pytest.raises(VerispecError, match="tokenizer"):
        engine.generate([3, 4], SamplingParams(max_tokens=2, stop=("x",)))


@pytest.mark.parametrize("bad", [[-1], [96], [3, 10**6]], ids=["negative", "vocab", "huge"])
def test_token_ids_out_of_range(engine, bad):
    with pytest.raises(VerispecError, match="token ids"):
        engine.generate(bad, SamplingParams(max_tokens=2))


def test_a_bad_prompt_fails_the_batch_before_any_work(engine, monkeypatch):
    calls = []
    monkeypatch.setattr(engine, "step", lambda *a, **kw: calls.append(a))
    with pytest.raises(VerispecError):
        engine.generate([[3, 4], [2] * 100], SamplingParams(max_tokens=2))
    assert calls == []
