"""Load weights and tokenizers from a Hugging Face folder or a GGUF file.

Both sources are exposed as tensors under Hugging Face parameter names, so the decoder has
one construction path. GGUF tensors are dequantized with the ``gguf`` package (Q4_K, Q6_K,
Q8_0, Q4_1, F16/BF16/F32, ...) one at a time, straight into the requested dtype.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec import hub
from verispec import kernels as fast_kernels
from verispec.errors import VerispecError
from verispec.log import logger
from verispec.models.args import ModelArgs
from verispec.models.linear import Int4Weight, Int8Weight, QuantizedTensor, int4_supported
from verispec.models.llama import Transformer

CONVERT_VERSION = 1
INT4_VERSION = 2  # bump when the int4 conversion or its cache layout changes (2: layout in the folder name)
# GGUF types with more than ~4.5 bits a weight: under ``int4`` these go to int8 instead, so the
# tensors llama.cpp chose to keep more precise (Q4_K_M's Q6_K ffn_down/attn_v/output) stay so.
_INT8_TYPES = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}  # GGUF tensor types that are not quantized
_FUSED = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]
QuantizedWeight = Int4Weight | Int8Weight  # what get_int4 returns for a projection (or a float tensor)
_Q4_K_BLOCK = 144  # bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of 4-bit codes

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

    _get_int4: Any = None
    quantized: bool = False  # a GGUF whose projections are stored quantized (Q4_K, Q6_K, Q8_0, ...)

    def get(self, name: str) -> torch.Tensor | None:
        return self._get(name)

    def get_int4(self, name: str, dtype: torch.dtype, keep_int8: bool = True
                 ) -> torch.Tensor | Int4Weight | Int8Weight | None:
        """``name`` as the int4 format wants it; plain ``get`` if not GGUF. ``keep_int8`` keeps tensors
        the GGUF stores with more than ~4.5 bits in int8 (``int4``); False requantizes them (``int4-all``)."""
        return self._get(name) if self._get_int4 is None else self._get_int4(name, dtype, keep_int8)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _header_file(path: Path) -> Path:
    return hub.home() / "converted" / f"{file_key(path)}-header-v{CONVERT_VERSION}.json"


def file_key(path: Path) -> str:
    """A cheap fingerprint of a model file (name, size, modification time) naming its caches."""
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"


def open_gguf(path: Path) -> ModelSource:
    """A GGUF file as a source. Parsing a GGUF header (with its whole vocabulary) takes seconds, so
    the architecture is cached beside the converted weights and the file itself is only parsed
    when a tensor is actually read (never, once the converted weights are cached)."""
    header = _header_file(path)
    info = json.loads(header.read_text()) if header.is_file() else {}
    if "quantized" in info:  # a header cached before tensor types were recorded is parsed again
        parsed: list[ModelSource] = []

        def lazy(attr: str) -> Any:
            def call(*a: Any) -> Any:
                if not parsed:
                    parsed.append(_parse_gguf(path))
                return getattr(parsed[0], attr)(*a)
            return call

        return ModelSource(path, ModelArgs(**info["args"]), info["tensor_names"], set(info["eos_token_ids"]),
                           lazy("get"), lazy("get_int4"), bool(info["quantized"]))
    src = _parse_gguf(path)
    try:
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text(json.dumps({"args": asdict(src.args), "tensor_names": src.tensor_names,
                                      "eos_token_ids": sorted(src.eos_token_ids), "quantized": src.quantized}))
    except OSError as e:
        logger.warning("could not cache the GGUF header at %s: %s", header, e)
    return src


def _parse_gguf(path: Path) -> ModelSource:
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

    def unpermute(name: str) -> torch.Tensor | None:
        """Row order that undoes llama.cpp's q/k interleave (llama only), or None."""
        if arch != "llama" or not (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            return None
        heads = args.n_heads if "q_proj" in name else args.n_kv_heads
        n = int(tensors[hf_to_gguf_name(name)].shape[1])
        return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)

    def fused_siblings(name: str) -> list[str]:
        for group in _FUSED:
            for part in group:
                if name.endswith(f".{part}.weight"):
                    stem = name.removesuffix(f"{part}.weight")
                    found = (hf_to_gguf_name(f"{stem}{p}.weight") for p in group if p != part)
                    return [g for g in found if g in tensors]
        return []

    def get_int4(name: str, dtype: torch.dtype, keep_int8: bool = True) -> torch.Tensor | QuantizedWeight | None:
        t = tensors.get(hf_to_gguf_name(name))
        if t is None or not _is_projection(name):
            return get(name)
        kind = t.tensor_type.name
        if keep_int8 and (kind in _INT8_TYPES
                          or any(tensors[s].tensor_type.name in _INT8_TYPES for s in fused_siblings(name))):
            # A fused layer has one format: q/k next to a Q6_K v_proj go int8 with it.
            return Int8Weight.quantize(get(name), dtype)
        rows, cols = int(t.shape[1]), int(t.shape[0])
        if not int4_supported(rows, cols):
            return get(name)
        if kind == "Q4_K":
            qt = decode_q4_k(np.asarray(t.data), (rows, cols))
            idx = unpermute(name)
            return Int4Weight.from_quantized(qt if idx is None else qt.permute_rows(idx))
        return Int4Weight.quantize(get(name).to(dtype))

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
    quantized = any(tensors[hf_to_gguf_name(n)].tensor_type.name not in _FLOAT_TYPES
                    for n in hf_names if _is_projection(n) and n != "lm_head.weight")
    return ModelSource(path, args, hf_names, set() if eos_id is None else {int(eos_id)}, get, get_int4, quantized)


def _is_projection(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith("_proj.weight")


def decode_q4_k(data: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    """Codes, scales and mins of a GGUF Q4_K tensor [rows, cols], straight from its block bytes.

    A 256-weight super-block holds fp16 ``d`` and ``dmin`` and, per sub-block of 32, a 6-bit
    scale ``sc`` and min ``m``: ``w = (d * sc) * q - (dmin * m)``, which is exactly
    :class:`QuantizedTensor`'s ``scales * codes - mins`` with groups of 32 (fp32 products, as
    ``gguf.quants.dequantize`` computes them, so the two agree bit for bit).
    """
    rows, cols = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, _Q4_K_BLOCK)
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[:, 4:16].reshape(n, 3, 4)
    # bytes 0-3: low 6 bits = scales 0-3 (top 2 bits: high bits of scales 4-7); bytes 4-7: the
    # same for mins; bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = of mins 4-7.
    sc = np.concatenate([s[:, 0] & 0x3F, (s[:, 2] & 0x0F) | ((s[:, 0] >> 2) & 0x30)], axis=1)
    mn = np.concatenate([s[:, 1] & 0x3F, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 0x30)], axis=1)
    # 128 bytes = 4 chunks of 32; sub-block 2j is chunk j's low nibbles, 2j+1 its high nibbles.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(rows, cols)
    scales = (d * sc.astype(np.float32)).reshape(rows, cols // 32)
    mins = (dmin * mn.astype(np.float32)).reshape(rows, cols // 32)
    return QuantizedTensor(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins), 32)


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
    folder = hub.home() / "converted" / f"{file_key(src.path)}-{short}-v{CONVERT_VERSION}"
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
    return ModelSource(src.path, src.args, cached.tensor_names, src.eos_token_ids, cached._get,
                       quantized=src.quantized)


def converted_int4(src: ModelSource, dtype: torch.dtype, progress: bool = True, layout: str = "cpu",
                   keep_int8: bool = True) -> ModelSource:
    """A GGUF source converted once for ``--weights int4`` (or ``int4-all``: ``keep_int8=False``)
    and cached as safetensors.

    Per Hugging Face name the cache holds what :meth:`ModelSource.get_int4` returns: packed
    int4 codes and bf16 scales/zeros (``NAME.int4_packed``, ``NAME.int4_sz``), int8 codes and
    scales (``NAME.int8_q``, ``NAME.int8_scale``) or a plain ``dtype`` tensor. ``layout`` is the
    kernels' byte layout the packed tensors are stored in, so loading needs no repacking:
    ``"cpu"`` (PyTorch's CPU kernels; depends on the CPU's vector width, which is then part of
    the folder name) or ``"vs16"`` (:mod:`verispec.kernels`, CPU-independent).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    short = str(dtype).removeprefix("torch.")
    cpu_layout = torch.backends.cpu.get_cpu_capability()
    tag = "vs16" if layout == "vs16" else cpu_layout
    int8_layout = "vs16" if layout == "vs16" else "rows"
    folder = (hub.home() / "converted"
              / f"{file_key(src.path)}-int4{'' if keep_int8 else 'all'}-{short}-{tag}-v{INT4_VERSION}")
    file = folder / "model.safetensors"
    if not file.is_file():
        logger.info("converting %s to int4 (once; cached in %s)", src.path.name, folder)
        tensors: dict[str, torch.Tensor] = {}
        for name in tqdm(src.tensor_names, desc=f"quantizing {src.path.name}", disable=not progress or None,
                         leave=False):
            t = src.get_int4(name, dtype, keep_int8)
            if isinstance(t, Int4Weight):
                t = t.to_layout(layout)
                tensors[name + ".int4_packed"], tensors[name + ".int4_sz"] = t.packed, t.scales_and_zeros
            elif isinstance(t, Int8Weight):
                t = t.to_layout(int8_layout)
                tensors[name + ".int8_q"], tensors[name + ".int8_scale"] = t.qweight, t.scale
            else:
                tensors[name] = t.to(dtype)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "model.safetensors.partial"
        save_file(tensors, str(tmp), metadata={"group_size": "32", "cpu_layout": cpu_layout, "layout": layout})
        os.replace(tmp, file)
        del tensors
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:
        raise VerispecError(f"{file}: unreadable safetensors file ({e}); delete it to convert again") from None
    keys = set(handle.keys())
    meta = handle.metadata() or {}
    group = int(meta.get("group_size", 32))
    if meta.get("layout", "cpu") != layout:
        raise VerispecError(f"{file}: holds layout '{meta.get('layout', 'cpu')}', expected '{layout}'; delete it")

    def get(name: str) -> torch.Tensor | None:
        return handle.get_tensor(name) if name in keys else None

    def get_int4(name: str, dtype: torch.dtype, keep_int8: bool = True) -> torch.Tensor | QuantizedWeight | None:
        if name + ".int4_packed" in keys:
            return Int4Weight(get(name + ".int4_packed"), get(name + ".int4_sz"), group, layout)
        if name + ".int8_q" in keys:
            return Int8Weight(get(name + ".int8_q"), get(name + ".int8_scale"), int8_layout)
        return get(name)

    return ModelSource(src.path, src.args, src.tensor_names, src.eos_token_ids, get, get_int4, src.quantized)


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


def resolve_weights(src: ModelSource, requested: str, draft: bool = False, tp: int = 1) -> str:
    """The weight format a model loads as: ``requested`` itself, or for ``"auto"`` its source's own precision.

    A GGUF whose projections are quantized runs ``int4`` (Q4_K blocks as they are, more precise
    types such as Q6_K/Q8_0 as int8, anything else requantized to int4), or as a draft model
    ``int4-all`` (every projection in 4 bits: the cheapest draft tokens). A GGUF of F16/BF16/F32
    tensors and a Hugging Face folder run ``dense``, as does a target sharded by tensor
    parallelism (``tp > 1`` splits dense weights only).
    """
    if requested != "auto":
        return requested
    if not src.quantized or (tp > 1 and not draft):
        return "dense"
    return "int4-all" if draft else "int4"


def build_model(src: ModelSource, dtype: torch.dtype, weight_format: str = "dense", progress: bool = True,
                cache: bool = True, kernels: str = "auto") -> Transformer:
    """Materialise the decoder from ``src``, showing progress while tensors load.

    With ``cache`` a GGUF source is first converted once to ``dtype`` (see :func:`converted`),
    or for ``int4`` to packed int4/int8 weights (see :func:`converted_int4`). ``kernels`` picks
    the int4/int8 matmuls: ``"auto"`` (verispec's AVX-512 BF16 kernels where the CPU runs them)
    or ``"stock"`` (PyTorch's); the int4 cache is kept in the chosen kernels' layout, so a model
    loads without repacking (other sources are repacked as their tensors load).
    """
    from tqdm import tqdm

    int4 = weight_format in ("int4", "int4-all") and src._get_int4 is not None
    keep_int8 = weight_format == "int4"
    if cache and int4:
        layout = "vs16" if fast_kernels.quantized_path(kernels)[0] else "cpu"  # what the layers will hold
        src = converted_int4(src, dtype, progress, layout, keep_int8)
    elif cache:
        src = converted(src, dtype, progress)
    bar = tqdm(total=len(src.tensor_names), desc=f"loading {src.path.name}", unit="tensor",
               disable=not progress or None, leave=False)

    def get(name: str) -> torch.Tensor | Int4Weight | Int8Weight | None:
        t = src.get_int4(name, dtype, keep_int8) if int4 else src.get(name)
        bar.update(1 if t is not None else 0)
        return t

    try:
        with torch.inference_mode():
            return Transformer.from_state_dict(src.args, get, dtype, weight_format, kernels).eval()
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
    cached = hub.home() / "tokenizers" / file_key(src.path)
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("converting the GGUF tokenizer of %s (once)", src.path.name)
    tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    try:
        tok.save_pretrained(str(cached))
    except OSError as e:
        logger.warning("could not cache the tokenizer at %s: %s", cached, e)
    return tok
