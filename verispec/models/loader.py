"""Load weights and tokenizers from a Hugging Face folder or a GGUF file.

Both sources are exposed as tensors under Hugging Face parameter names, so the decoder has
one construction path. GGUF tensors are dequantized with the ``gguf`` package (Q4_K, Q6_K,
Q8_0, Q4_1, F16/BF16/F32, ...) one at a time, straight into the requested dtype.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec import hub
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.args import ModelArgs
from verispec.models.llama import Transformer

CONVERT_VERSION = 1

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def hf_to_gguf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m or m.group(2) not in _GGUF_NAMES:
        raise KeyError(name)
    return f"blk.{m.group(1)}.{_GGUF_NAMES[m.group(2)]}.{m.group(3)}"


@dataclass
class ModelSource:
    """A model on disk: its architecture, a tensor getter and where its tokenizer comes from."""

    path: Path
    args: ModelArgs
    tensor_names: list[str]
    eos_token_ids: set[int] = field(default_factory=set)
    _get: Any = None

    def get(self, name: str) -> torch.Tensor | None:
        return self._get(name)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def open_gguf(path: Path) -> ModelSource:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise VerispecError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise VerispecError(f"{path}: unsupported GGUF architecture '{arch}'")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise VerispecError(f"{path}: GGUF file has no token embedding")
    n_heads = _gguf_field(reader, f"{arch}.attention.head_count")
    args = ModelArgs(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        dim=_gguf_field(reader, f"{arch}.embedding_length"),
        n_layers=_gguf_field(reader, f"{arch}.block_count"),
        n_heads=n_heads,
        n_kv_heads=_gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads),
        intermediate_size=_gguf_field(reader, f"{arch}.feed_forward_length"),
        head_dim=_gguf_field(reader, f"{arch}.attention.key_length", 0),
        norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=_gguf_field(reader, f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
    )

    def get(name: str) -> torch.Tensor | None:
        t = tensors.get(hf_to_gguf_name(name))
        if t is None:
            return None
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise VerispecError(f"{path}: cannot decode tensor {t.name} ({e})") from None
        w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(tuple(reversed(t.shape.tolist())))
        if arch == "llama" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            # llama.cpp's converter interleaves q/k rows for its rope; undo it for rotate-half.
            heads = args.n_heads if "q_proj" in name else args.n_kv_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        return w

    eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    hf_names = [n for n in (gguf_to_hf_name(t) for t in tensors) if n is not None]
    return ModelSource(path, args, hf_names, set() if eos_id is None else {int(eos_id)}, get)


def gguf_to_hf_name(name: str) -> str | None:
    inverse = {v: k for k, v in _TOP_NAMES.items()}
    if name in inverse:
        return inverse[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    hf = {v: k for k, v in _GGUF_NAMES.items()}.get(m.group(2)) if m else None
    return None if hf is None else f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"


def converted(src: ModelSource, dtype: torch.dtype, progress: bool = True) -> ModelSource:
    """A GGUF source, dequantized once into ``dtype`` and cached as safetensors next to the models.

    Dequantizing a 1.5B Q4_K_M file takes tens of seconds; reading the cached copy takes a few.
    Hugging Face folders are returned unchanged.
    """
    if src.path.is_dir():
        return src
    from safetensors.torch import save_file
    from tqdm import tqdm

    short = str(dtype).removeprefix("torch.")
    # The version tag invalidates old caches whenever the conversion itself changes.
    folder = hub.home() / "converted" / f"{src.path.stem}-{src.path.stat().st_size}-{short}-v{CONVERT_VERSION}"
    if not (folder / "model.safetensors").is_file():
        logger.info("converting %s to %s (once; cached in %s)", src.path.name, short, folder)
        tensors = {}
        for name in tqdm(src.tensor_names, desc=f"dequantizing {src.path.name}", disable=not progress or None,
                         leave=False):
            tensors[name] = src.get(name).to(dtype)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "model.safetensors.partial"
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / "model.safetensors")
        del tensors
    cached = open_safetensors(folder, src.args)
    return ModelSource(src.path, src.args, cached.tensor_names, src.eos_token_ids, cached._get)


def open_hf_folder(path: Path) -> ModelSource:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise VerispecError(f"{path}: no config.json (expected a Hugging Face model folder or a .gguf file)")
    cfg = json.loads(cfg_file.read_text())
    src = open_safetensors(path, ModelArgs.from_hf_config(cfg))
    eos = cfg.get("eos_token_id")
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
    src.eos_token_ids = set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
    return src


def open_safetensors(path: Path, args: ModelArgs) -> ModelSource:
    """The ``*.safetensors`` files of a folder as a source (tensors read lazily, by name)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise VerispecError(f"{path}: no *.safetensors weights")
    where: dict[str, Any] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:
            raise VerispecError(f"{f}: unreadable safetensors file ({e})") from None
        for k in handle.keys():
            where[k] = handle

    def get(name: str) -> torch.Tensor | None:
        h = where.get(name)
        return None if h is None else h.get_tensor(name)

    return ModelSource(path, args, list(where), set(), get)


def open_source(name_or_path: str | Path) -> ModelSource:
    """Open a registry name, a GGUF file or a Hugging Face folder."""
    path = hub.resolve(name_or_path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        return open_gguf(ggufs[0]) if ggufs and not (path / "config.json").exists() else open_hf_folder(path)
    if path.suffix != ".gguf":
        raise VerispecError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    return open_gguf(path)


def build_model(src: ModelSource, dtype: torch.dtype, weight_format: str = "dense", progress: bool = True,
                cache: bool = True) -> Transformer:
    """Materialise the decoder from ``src``, showing progress while tensors load.

    With ``cache`` a GGUF source is first converted once to ``dtype`` (see :func:`converted`).
    """
    from tqdm import tqdm

    if cache:
        src = converted(src, dtype, progress)
    bar = tqdm(total=len(src.tensor_names), desc=f"loading {src.path.name}", unit="tensor",
               disable=not progress or None, leave=False)

    def get(name: str) -> torch.Tensor | None:
        t = src.get(name)
        bar.update(1 if t is not None else 0)
        return t

    try:
        with torch.inference_mode():
            return Transformer.from_state_dict(src.args, get, dtype, weight_format).eval()
    except KeyError as e:
        raise VerispecError(f"{src.path}: incomplete checkpoint ({e.args[0]})") from None
    finally:
        bar.close()


def load_tokenizer(src: ModelSource) -> Any | None:
    """The tokenizer that comes with the model (with its chat template), or None if it has none.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached under
    ``$VERISPEC_HOME/tokenizers``.
    """
    from transformers import AutoTokenizer

    if src.path.is_dir():
        has_tok = any((src.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
        return AutoTokenizer.from_pretrained(str(src.path)) if has_tok else None
    cached = hub.home() / "tokenizers" / f"{src.path.stem}-{src.path.stat().st_size}"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("converting the GGUF tokenizer of %s (once)", src.path.name)
    tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    try:
        tok.save_pretrained(str(cached))
    except OSError as e:
        logger.warning("could not cache the tokenizer at %s: %s", cached, e)
    return tok
