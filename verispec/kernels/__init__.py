"""Fast weight-only int4/int8 (and dense bf16) matmuls for a few activation rows (AVX-512 BF16 CPUs;
int4/int8 on 8-bit activations also on AVX2 CPUs).

Speculative decoding verifies M = k + 1 tokens per target forward, so the projections should
cost about the same for M = 1..8 while their weights stream from memory.
``wo_gemm.cpp`` does that (see the comment at its top and docs/quantization.md): weights in
its own packed layout, unpacked once per call into bf16 tiles that every activation row
reuses through ``vdpbf16ps``. Dense bf16 weights use the same layout and loop without the unpack
(PyTorch's oneDNN bf16 GEMV for one row reads well under the machine's bandwidth).
For a prefill (hundreds of rows, compute-bound) :func:`int4_dequant`, :func:`int8_dequant` and
:func:`bf16_unpack` expand a weight to bf16 [N, K] for oneDNN's GEMM instead (the layers choose:
``verispec.models.linear.large_m``). They are plain functions, not operators: torch.compile'd
forwards keep the kernels.

``small_ops.cpp``, built into the same extension, fuses the small ops around those matmuls in a
decode / verification step (RMSNorm, residual add + RMSNorm, RoPE + K/V cache write + few-query
attention, silu * up): :func:`rms_norm`, :func:`add_rms_norm`, :func:`attend`, :func:`silu_mul`.
The row-wise ones (all but :func:`attend`) also serve prefill, parallel over rows.

The C++ extension is compiled once with ``torch.utils.cpp_extension`` (g++ and ninja) into
``$VERISPEC_HOME/kernels/`` (``make setup`` runs ``python -m verispec.kernels``) and loaded
from there afterwards. Every AVX-512 or AVX2 function has a target attribute, so the library itself
loads on any x86-64 CPU; :func:`available` is true only when it built and the CPU has
AVX-512 F/BW/VL/DQ/BF16. A CPU with AVX2 but without those runs the int4/int8 matmuls on 8-bit
activations (:func:`q8_available`, :func:`quantized_path`), the fused small ops in fp32
(:func:`small_ops_dtypes`) and PyTorch's ops for the rest; without
AVX2 one warning is logged and the layers keep PyTorch's stock kernels.
``VERISPEC_KERNELS=stock`` in the environment forces the stock kernels everywhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from verispec import hub
from verispec.log import logger

# auto: verispec's kernels where the CPU runs them (else PyTorch's), their activation path chosen per model at
# load (verispec.engine.kernel_choice); bf16: int4 and int8 layers multiplying bf16 activations (AVX-512 BF16);
# q8: the same on activations quantized to 8 bits per group of 32 (AVX-512 VNNI, or AVX2); stock: PyTorch's.
KERNEL_CHOICES = ("auto", "bf16", "q8", "stock")
# wo_gemm.cpp: the module (PYBIND11_MODULE) and the matmuls; small_ops.cpp: the fused small ops it registers.
_SOURCES = (Path(__file__).with_name("wo_gemm.cpp"), Path(__file__).with_name("small_ops.cpp"))
_CFLAGS = ["-O3", "-fopenmp"]  # plus -DVS_NS=<op namespace>
_lock = threading.Lock()
_state: dict[str, object] = {}
_EXT: ModuleType | None = None  # the loaded extension (pybind functions: the cheapest eager call)
_OPS = None  # the same matmuls as torch operators (what torch.compile sees)
# Resolved once, at import: tests and tools that point VERISPEC_HOME elsewhere later (for
# converted-model caches) keep using the one compiled library instead of building another.
_HOME = hub.home()


def _tag() -> str:
    h = hashlib.sha256()
    for source in _SOURCES:
        h.update(source.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{' '.join(_CFLAGS)}".encode())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """Where the extension is built and cached (one folder per source/torch/Python version)."""
    return _HOME / "kernels" / f"wo_gemm-{_tag()}"


def _cpu_flags() -> set[str] | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _import(name: str, so: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(verbose: bool) -> tuple[ModuleType | None, str]:
    if os.environ.get("VERISPEC_KERNELS", "auto").lower() == "stock":
        return None, "VERISPEC_KERNELS=stock"
    flags = _cpu_flags()
    if flags is not None and not {"avx2", "fma"} <= flags:
        return None, "this CPU lacks AVX2"
    folder = build_dir()
    name = f"verispec_wo_gemm_{_tag()}"
    so = folder / f"{name}.so"
    ext = None
    if so.is_file():
        try:
            ext = _import(name, so)
        except Exception as e:  # a half-written or foreign library: build it again
            logger.debug("cannot import %s (%s); rebuilding", so, e)
    if ext is None:
        try:
            from torch.utils.cpp_extension import load

            folder.mkdir(parents=True, exist_ok=True)
            logger.info("building the verispec int4/int8/bf16 kernels (once; cached in %s)", folder)
            # The ninja that pip installed with verispec sits next to this interpreter, which is
            # not on PATH when a virtual environment's python runs without being activated.
            path = os.environ.get("PATH", "")
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
            try:
                ext = load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=[*_CFLAGS, f"-DVS_NS={name}"],
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=verbose)
            finally:
                os.environ["PATH"] = path
        except Exception as e:  # compiler missing, build error, ...
            _state["detail"] = str(e)
            return None, f"build failed ({type(e).__name__}; `python -m verispec.kernels` shows the compiler output)"
    if not ext.q8_isa():
        return None, "this CPU lacks AVX2"
    _register_fakes(name)
    return ext, "" if ext.cpu_supported() else "this CPU lacks AVX-512 BF16"


def _register_fakes(namespace: str) -> None:
    """Shapes and dtypes of the operators for torch.compile's tracing (no data touched)."""

    def out(x: torch.Tensor, n: int, out_fp32: bool, rows: int) -> torch.Tensor:
        return x.new_empty((rows, n), dtype=torch.float32 if out_fp32 else torch.bfloat16)

    @torch.library.register_fake(f"{namespace}::int4_mm")
    def _int4(x, w, sz, n, bias, out_fp32, q8=False):  # noqa: ANN001, ANN202 - the schema's arguments
        return out(x, n, out_fp32, x.shape[0])

    @torch.library.register_fake(f"{namespace}::int8_mm")
    def _int8(x, w, scale, n, splits, bias, out_fp32, q8=False):  # noqa: ANN001, ANN202
        return out(x, n, out_fp32, x.shape[0] // splits)

    @torch.library.register_fake(f"{namespace}::bf16_mm")
    def _bf16(x, w, n, bias, out_fp32):  # noqa: ANN001, ANN202
        return out(x, n, out_fp32, x.shape[0])

    global _OPS
    _OPS = getattr(torch.ops, namespace)


def extension(verbose: bool = False) -> ModuleType | None:
    """The compiled extension, built on first use; None (after one warning) when it cannot run here."""
    global _EXT
    if _EXT is not None:
        return _EXT
    with _lock:
        if "ext" not in _state:
            ext, why = _load(verbose)
            _state["ext"], _state["why"] = ext, why
            _state["full"] = ext is not None and bool(ext.cpu_supported())
            if ext is None and why != "VERISPEC_KERNELS=stock":
                logger.warning("verispec int4/int8/bf16 kernels unavailable (%s); using PyTorch's stock kernels", why)
            elif ext is not None and why:
                logger.info("verispec kernels: %s, so int4/int8 layers run the AVX2 kernels with 8-bit activations, "
                            "fp32 models the AVX2 fused small ops, and everything else PyTorch's", why)
            _EXT = ext
        return _state["ext"]


def available() -> bool:
    """Whether all the fast kernels run on this machine (AVX-512 BF16; builds them on first call)."""
    return extension() is not None and bool(_state["full"])


def why_unavailable() -> str:
    extension()
    return str(_state.get("why", ""))


def use_fast(kernels: str) -> bool:
    """Whether a layer built with ``kernels`` (see :data:`KERNEL_CHOICES`) should use the fast kernels.

    ``q8`` where this CPU cannot run 8-bit activations is an error, not a silent fallback: it changes
    the numbers a model computes, so it runs exactly where it was asked for.
    """
    from verispec.errors import VerispecError

    if kernels not in KERNEL_CHOICES:
        raise VerispecError(f"unknown kernels '{kernels}' (choose from {', '.join(KERNEL_CHOICES)})")
    if kernels == "q8" and not q8_available():
        why = why_unavailable() or "this CPU lacks AVX-512 VNNI"
        raise VerispecError(f"--kernels q8 needs verispec's kernels and AVX-512 VNNI or AVX2 ({why}); "
                            "use auto or stock")
    if kernels == "bf16" and not available():
        raise VerispecError(f"--kernels bf16 needs verispec's AVX-512 BF16 kernels ({why_unavailable()}); "
                            "use auto or stock")
    return kernels != "stock" and available()


def q8_available() -> bool:
    """Whether int4/int8 layers can multiply 8-bit activations here: the kernels built and the CPU has
    AVX-512 BF16 and VNNI, or (without those) AVX2, where they are the only kernels that run."""
    ext = extension()
    return ext is not None and (not available() or bool(ext.cpu_supports_vnni()))


def quantized_path(kernels: str) -> tuple[bool, bool]:
    """``(fast, q8)`` for an int4/int8 layer built with ``kernels``: whether it runs verispec's kernels
    and whether with 8-bit activations. Where the CPU lacks AVX-512 BF16 but has AVX2, the 8-bit
    kernels are verispec's only ones, so ``auto`` takes them too."""
    if use_fast(kernels):
        return True, kernels == "q8"
    if kernels != "stock" and q8_available():
        return True, True
    return False, False


def quantized_label(kernels: str) -> str:
    """What int4/int8 layers built with ``kernels`` run here: ``stock``, ``verispec`` or ``verispec q8``."""
    fast, q8 = quantized_path(kernels)
    return "verispec q8" if q8 else "verispec" if fast else "stock"


def layouts_available() -> bool:
    """Whether the packing functions (:func:`int4_pack`, :func:`int8_pack`, ...) run here."""
    return extension() is not None


def _ext() -> ModuleType:
    ext = extension()
    if ext is None:
        raise RuntimeError(f"verispec kernels unavailable: {why_unavailable()}")
    return ext


def ext() -> ModuleType:
    """The loaded extension itself, for the hottest calls (the decode path's projections, see
    ``verispec.models.linear.small_m_call``): its functions take bf16/fp32 tensors exactly as the
    wrappers here pass them, with no casts or checks in Python. Raises where :func:`available` is false."""
    return _EXT or _ext()


# -- int4 -------------------------------------------------------------------------------------


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, K] (0..15; N % 16 == 0, K % 32 == 0) -> the kernel's layout, uint8 [N/16, 8K]."""
    return _ext().int4_pack(codes.to(torch.uint8))


def int4_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return _ext().int4_unpack(packed, n, k)


def int4_from_stock(packed: torch.Tensor, n: int, k: int, rows_of_nibble: torch.Tensor) -> torch.Tensor:
    """From ``_convert_weight_to_int4pack_for_cpu``'s layout (whole blocks of len(rows_of_nibble) rows)."""
    return _ext().int4_from_stock(packed, n, k, rows_of_nibble.to(torch.int64))


def int4_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, n: int, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.bfloat16, q8: bool = False) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x [M, K] (cast to bf16, as the stock kernel does); fp32 accumulation,
    output in ``out_dtype`` (fp32, or rounded once to bf16). ``q8``: each row of x quantized to 8 bits
    per group of 32 (scale max|x| / 127) and multiplied in integers (AVX-512 VNNI, see
    :func:`q8_available`)."""
    x = x.to(torch.bfloat16).contiguous()
    if torch.compiler.is_compiling():
        return _OPS.int4_mm(x, packed, sz, n, bias, out_dtype == torch.float32, q8)
    return (_EXT or _ext()).int4_mm(x, packed, sz, n, bias, out_dtype == torch.float32, q8)


def int4_dequant(packed: torch.Tensor, sz: torch.Tensor, n: int, k: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as bf16 [N, K]: ``(q - 8) * scale + zero`` in fp32, rounded once to bf16 (equal to
    ``Int4Weight.dequantize().to(torch.bfloat16)``); for the large-M path (oneDNN's GEMM) of prefill.
    Written into ``out`` (contiguous bf16 [N, K]) when given, else into a new tensor."""
    return (_EXT or _ext()).int4_dequant(packed, sz, n, k, out)


# -- int8 -------------------------------------------------------------------------------------


def int8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (K even) -> the kernel's layout [ceil(N/16), K/2, 16, 2], padded rows zero."""
    return _ext().int8_pack(qweight)


def int8_unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return _ext().int8_unpack(packed, n, k)


def int8_dequant(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as bf16 [N, K]: ``q * scale`` (scale fp32 or bf16) in fp32, rounded once to bf16 (equal
    to ``Int8Weight.dequantize().to(torch.bfloat16)``); for the large-M path of prefill. Written into
    ``out`` (contiguous bf16 [N, K]) when given, else into a new tensor."""
    return (_EXT or _ext()).int8_dequant(packed, scale, n, k, out)


def bf16_split(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] as three bf16 parts stacked [3M, K] whose sum is x exactly (normal numbers):
    8 + 8 + 8 significant bits cover fp32's 24, and each difference is exact in fp32."""
    hi = x.to(torch.bfloat16)
    r = x - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo])


def int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, q8: bool = False) -> torch.Tensor:
    """``x @ (q * scale).T (+ bias)`` for x [M, K]. bf16 x is used as it is; fp32 x is split into three
    bf16 parts (:func:`bf16_split`), so every product is the exact fp32 one, as in the stock kernel.
    ``q8`` (K a multiple of 32): x cast to bf16 and quantized to 8 bits per group of 32 instead, as
    :func:`int4_mm`'s."""
    out_dtype = out_dtype or x.dtype
    if x.dtype == torch.float32 and not q8:
        xb, splits = bf16_split(x.contiguous()), 3
    else:
        xb, splits = x.to(torch.bfloat16).contiguous(), 1
    if torch.compiler.is_compiling():
        return _OPS.int8_mm(xb, packed, scale, n, splits, bias, out_dtype == torch.float32, q8)
    return (_EXT or _ext()).int8_mm(xb, packed, scale, n, splits, bias, out_dtype == torch.float32, q8)


# -- bf16 -------------------------------------------------------------------------------------


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (K even) -> the kernel's layout [ceil(N/16), K/2, 16, 2], padded rows zero."""
    return _ext().bf16_pack(weight)


def bf16_unpack(packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 [N, K] weight back (a copy; into ``out``, contiguous bf16 [N, K], when given)."""
    return (_EXT or _ext()).bf16_unpack(packed, n, k, out)


def bf16_mm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for x [M, K] (cast to bf16) and a weight packed by :func:`bf16_pack`;
    fp32 accumulation, output in ``out_dtype`` (fp32, or rounded once to bf16, bias included)."""
    x = x.to(torch.bfloat16).contiguous()
    if torch.compiler.is_compiling():
        return _OPS.bf16_mm(x, packed, n, bias, out_dtype == torch.float32)
    return (_EXT or _ext()).bf16_mm(x, packed, n, bias, out_dtype == torch.float32)


# -- fused small ops (small_ops.cpp) ----------------------------------------------------------------


ATTEND_MAX_HEAD_DIM = 256


def small_ops_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the fused small ops take here: fp32 and bf16 with AVX-512 BF16, fp32 alone with AVX2
    (such CPUs run fp32 models), none without the kernels."""
    if available():
        return torch.float32, torch.bfloat16
    return (torch.float32,) if extension() is not None else ()


def use_small_ops(kernels: str) -> bool:
    """Whether a model built with ``kernels`` runs its norms, attention and silu * up through the fused
    small ops (in the dtypes of :func:`small_ops_dtypes`): everywhere but ``stock`` where they run."""
    use_fast(kernels)  # validates the choice
    return kernels != "stock" and bool(small_ops_dtypes())


def attend_applies(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether :func:`attend` (and the other fused ops) take a model with this head size and dtype:
    one of :func:`small_ops_dtypes`, ``head_dim`` a multiple of 16 up to 256. Otherwise the model keeps
    its Python path."""
    return dtype in small_ops_dtypes() and head_dim % 16 == 0 and 16 <= head_dim <= ATTEND_MAX_HEAD_DIM


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x ``[R, D]`` (fp32 or bf16, contiguous) with weight ``w [D]`` (x's dtype):
    in fp32 ``x * rsqrt(mean(x^2) + eps)``, rounded to x's dtype, times w, rounded again (as
    :class:`~verispec.models.llama.RMSNorm`). A new tensor."""
    return (_EXT or _ext()).rms_norm(x, w, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add and the next norm: ``x += delta`` IN PLACE (rounded to x's dtype, as torch's
    add), then returns :func:`rms_norm` of the new x. x, delta: contiguous ``[R, D]`` of one dtype."""
    return (_EXT or _ext()).add_rms_norm(x, delta, w, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up ``[R, 2F]`` (gate = first half of each row) -> ``[R, F]``;
    fp32 math, silu rounded to the dtype before the product (as ``F.silu(gate) * up``)."""
    return (_EXT or _ext()).silu_mul(gate_up)


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, kv_len: int, n_heads: int, n_kv_heads: int,
           ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE, K/V cache write and grouped-query attention of a few queries per row, in one call.

    ``qkv`` ``[B, m, (H + 2 KV) * D]`` (the fused projection's output: q heads, k heads, v heads),
    ``cos``/``sin`` ``[B, m, D]`` (the rope tables at the positions), ``positions`` int64 ``[B, m]``,
    ``k_cache``/``v_cache`` ``[B, KV, L, D]`` (views are fine, e.g. rows of a bigger cache, as long
    as the last dim is contiguous). Rotate-half RoPE goes to q and k; the rotated k and v of query
    (b, i) are written at ``[b, :, positions[b, i]]`` (all of them before any query attends); query
    head h attends with KV head ``h // (H / KV)`` to keys ``j < kv_len`` and ``j <= positions[b, i]``,
    scores scaled by ``D ** -0.5`` and softmax in fp32. Returns ``[B, m, H * D]`` in qkv's dtype.
    A query's result does not depend on the other rows or queries in the call (bit for bit).
    ``ancestors`` int64 ``[B, m]`` (m <= 63) makes each row's new tokens a token tree: they take the
    consecutive slots ``positions[b, 0] + i``, and query i sees keys before ``positions[b, 0]`` and,
    of the new tokens, those whose bit is set in ``ancestors[b, i]`` (bit i and only bits below it).
    Raises ValueError where :func:`attend_applies` is false (the caller keeps its Python path).
    """
    d = k_cache.shape[-1]
    if not attend_applies(d, qkv.dtype):
        dtypes = " or ".join(str(t).removeprefix("torch.") for t in small_ops_dtypes()) or "no dtype on this CPU"
        raise ValueError(f"attend does not apply to head_dim {d} / {qkv.dtype} (needs a multiple of 16 up to "
                         f"{ATTEND_MAX_HEAD_DIM}, {dtypes})")
    return (_EXT or _ext()).attend(qkv, cos, sin, positions, k_cache, v_cache, kv_len, n_heads, n_kv_heads,
                                   ancestors)


def main() -> None:
    """``python -m verispec.kernels``: build (or find) the extension and say what the layers will use."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if available():
        print(f"verispec kernels: AVX-512 BF16 int4/int8/bf16 kernels ready ({build_dir()})")
    elif q8_available():
        print(f"verispec kernels: AVX2 int4/int8 kernels with 8-bit activations and fp32 fused small ops ready "
              f"({build_dir()}); PyTorch's for the rest ({why_unavailable()})")
    else:
        print(f"verispec kernels: using PyTorch's stock int4/int8/bf16 kernels ({why_unavailable()})")
        if _state.get("detail"):
            print(_state["detail"])


if __name__ == "__main__":
    main()
