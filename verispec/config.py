"""Typed configuration of the engine and of speculation, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import torch

from verispec.errors import VerispecError
from verispec.models.linear import VERIFY_M_MAX, WEIGHT_CHOICES

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
METHODS = ("none", "draft", "ngram", "retrieval", "layerskip", "hybrid", "suffix")
LOOKUPS = ("ngram", "suffix")  # the context lookups of hybrid
K_POLICIES = ("fixed", "heuristic", "confidence", "cost")
K_MAX = VERIFY_M_MAX - 1  # the most draft tokens (chain or tree nodes) one step may score


@cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX-512 BF16 or AMX), where bf16 beats fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """Map a dtype name to torch; ``auto`` picks bf16 where it is fast (CUDA, bf16-capable CPUs), else fp32."""
    if name == "auto":
        if device.startswith("cuda") or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise VerispecError(f"unknown dtype '{name}' (choose auto, float32, bfloat16, float16)") from None


def dtype_name(name: str, device: str = "cpu") -> str:
    """The dtype ``name`` resolves to on ``device`` (``auto`` included): ``float32``, ``bfloat16`` or ``float16``."""
    return str(resolve_dtype(name, device)).removeprefix("torch.")


@dataclass(frozen=True)
class EngineConfig:
    """What to load and how: target and optional draft model, precision, and the engine's slots.

    ``max_batch`` requests run at once, one KV cache row ("slot") each of ``max_len`` tokens;
    ``memory_limit`` (bytes of KV cache, target and draft together) lowers the slot count so the
    caches fit, ``kv_budget_tokens`` caps the tokens running requests reserve (prompt + max_tokens
    each; default: slots x max_len). ``prefill_chunk`` bounds the prompt tokens prefilled per step,
    so a long prompt delays running requests by at most one chunk. ``prefix_reuse`` keeps a
    finished request's KV in its slot for a later request sharing its prefix. ``batch_prefill`` prefills
    the prompts of adjacent slots in one forward where their chunks take the same kernel path.
    """

    model: str
    draft: str | None = None
    dtype: str = "auto"
    draft_dtype: str | None = None  # None: same as dtype
    # "auto": each model in its source's own precision (see verispec.models.loader.resolve_weights):
    # a quantized GGUF target as int4, its draft as int4-all; F16/BF16/F32 GGUFs and HF folders dense.
    weights: str = "auto"
    draft_weights: str = "auto"
    max_len: int = 4096
    device: str = "cpu"  # where both models live unless target_device / draft_device say otherwise
    progress: bool = True
    compile: bool = False  # torch.compile the forwards (static shapes; CUDA graphs on GPUs)
    compile_k: int = 8  # with compile: warm up verification shapes up to k + 1 tokens
    target_device: str | None = None  # None: device
    draft_device: str | None = None  # None: device
    tp: int = 1  # tensor-parallel ranks for the target (see verispec.parallel.tp; launched with torchrun)
    # int4/int8 matmuls: "auto" (verispec's small-M kernels where the CPU runs them), "q8" (the same, int4/int8
    # layers on 8-bit activations: AVX-512 VNNI) or "stock" (PyTorch's); see verispec.kernels.KERNEL_CHOICES
    kernels: str = "auto"
    max_batch: int = 1
    memory_limit: int | None = None
    kv_budget_tokens: int | None = None
    prefill_chunk: int = 512
    prefix_reuse: bool = True
    batch_prefill: bool = True

    def __post_init__(self) -> None:
        if self.target_device is None:
            object.__setattr__(self, "target_device", self.device)
        if self.draft_device is None:
            object.__setattr__(self, "draft_device", self.device)
        resolve_dtype(self.dtype, self.target_device)
        if self.draft_dtype is not None:
            resolve_dtype(self.draft_dtype, self.draft_device)
        if not isinstance(self.tp, int) or self.tp < 1:
            raise VerispecError(f"tp must be an integer >= 1 (got {self.tp!r})")
        if self.tp > 1 and self.weights not in ("dense", "auto"):  # auto resolves to dense under tp
            raise VerispecError(f"tensor parallelism shards dense weights only; the target's '{self.weights}' "
                                "weights (int8/int4) cannot be split (use --weights dense with --tp)")
        if self.tp > 1 and self.compile:
            raise VerispecError("--compile is not supported with tensor parallelism yet")
        for w in (self.weights, self.draft_weights):
            if w not in WEIGHT_CHOICES:
                raise VerispecError(f"unknown weight format '{w}' (choose from {', '.join(WEIGHT_CHOICES)})")
        from verispec.kernels import KERNEL_CHOICES

        if self.kernels not in KERNEL_CHOICES:
            raise VerispecError(f"unknown kernels '{self.kernels}' (choose from {', '.join(KERNEL_CHOICES)})")
        if self.max_len < 2:
            raise VerispecError("max_len must be at least 2")
        for name in ("max_batch", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise VerispecError(f"{name} must be an integer >= 1 (got {value!r})")
        for name in ("memory_limit", "kv_budget_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise VerispecError(f"{name} must be a positive integer or None (got {value!r})")


def check_draft_vocab(n: object) -> None:
    """Raise :class:`VerispecError` unless ``n`` (a reduced draft vocabulary) is None or a positive multiple of 16
    (the row blocks every weight layout keeps, so the first ``n`` rows of a head are whole blocks)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % 16):
        raise VerispecError(f"draft vocab must be a positive multiple of 16 (got {n!r}); e.g. vocab=32768")


def check_draft_window(n: object) -> None:
    """Raise :class:`VerispecError` unless ``n`` (prompt tokens a draft model reads) is None or a positive integer."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
        raise VerispecError(f"draft window must be a positive number of tokens (got {n!r}); e.g. window=256")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


DEFAULT_CONFIDENCE = 0.3  # k_policy "confidence" without a threshold of its own


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate for a request: which drafter proposes and how many tokens per step."""

    method: str = "draft"
    k: int = 5  # the fixed k, or the largest k an adaptive policy may choose
    k_policy: str = "cost"  # k from measured costs and acceptance; "fixed" drafts spec.k every step
    # The draft model stops drafting once its top probability falls below this (a token it doubts
    # is likely rejected, and the forwards after it wasted). None: 0.3 under k_policy "confidence",
    # off under the others; set, it applies under any policy (the cost policy then chooses the most
    # the draft may propose, and confident drafts run to it).
    confidence: float | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    datastore: str | None = None  # retrieval: path of a datastore built by `verispec datastore build`
    layers: int | None = None  # layerskip: how many of the target's layers draft (None: a measured default)
    # draft/hybrid: the draft model scores only its first draft_vocab ids plus special tokens and the prompt's
    # ids (verispec.drafters.vocab); None (or 0, stored as None): its full head. Other drafters ignore it.
    draft_vocab: int | None = None
    # draft/hybrid: the draft model reads only the first few and the last draft_window tokens of a longer
    # prompt (verispec.drafters.window): a cheaper first draft on long prompts. None (or 0): the whole prompt.
    draft_window: int | None = None
    # hybrid: its context lookup, "ngram" (prompt lookup) or "suffix" (the suffix drafter, options below).
    lookup: str = "ngram"
    # suffix: tokens of earlier requests' outputs the engine's shared index holds (least recently used
    # evicted first); requests with equal specs (k aside) share one index. 0: the request's own tokens only.
    suffix_global: int = 65536
    # suffix: a draft stops before its path's empirical probability (the product of each token's share of
    # the occurrences agreeing so far) falls below this, and is at most suffix_factor tokens per matched one.
    suffix_min_prob: float = 0.1
    suffix_factor: float = 1.0
    # suffix: the most continuations a draft offers after each of its tokens; above 1 drafts are token trees
    # (where earlier occurrences disagree, each way is drafted and the target keeps the one it agrees with).
    suffix_width: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise VerispecError(f"unknown speculation method '{self.method}' (choose from {', '.join(METHODS)})")
        if not isinstance(self.k, int) or not 0 <= self.k <= K_MAX:
            raise VerispecError(f"k must be an integer in [0, {K_MAX}] (got {self.k!r})")
        if self.k_policy not in K_POLICIES:
            raise VerispecError(f"unknown k policy '{self.k_policy}' (choose from {', '.join(K_POLICIES)})")
        if self.confidence is not None and (isinstance(self.confidence, bool) or
                                            not isinstance(self.confidence, (int, float)) or
                                            not 0.0 <= self.confidence < 1.0):
            raise VerispecError(f"confidence must be in [0, 1) (got {self.confidence!r})")
        for name in ("draft_vocab", "draft_window"):  # 0 turns the option off, as None does
            if type(getattr(self, name)) is int and getattr(self, name) == 0:
                object.__setattr__(self, name, None)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise VerispecError("n-gram sizes must satisfy 1 <= ngram_min <= ngram_max")
        check_draft_vocab(self.draft_vocab)
        check_draft_window(self.draft_window)
        self._check_suffix()

    def _check_suffix(self) -> None:
        if self.lookup not in LOOKUPS:
            raise VerispecError(f"unknown hybrid lookup '{self.lookup}' (choose from {', '.join(LOOKUPS)})")
        if isinstance(self.suffix_global, bool) or not isinstance(self.suffix_global, int) or \
                not 0 <= self.suffix_global < 2**32:
            raise VerispecError(f"suffix_global must be a number of tokens from 0 (off) to 2**32 - 1 "
                                f"(got {self.suffix_global!r})")
        if not _is_number(self.suffix_min_prob) or not 0.0 <= self.suffix_min_prob <= 1.0:
            raise VerispecError(f"suffix_min_prob must be in [0, 1] (got {self.suffix_min_prob!r})")
        if isinstance(self.suffix_width, bool) or not isinstance(self.suffix_width, int) or \
                not 1 <= self.suffix_width <= 8:
            raise VerispecError(f"suffix_width must be an integer from 1 (a chain) to 8 (got {self.suffix_width!r})")
        if not _is_number(self.suffix_factor) or not 0.0 < self.suffix_factor <= 64:
            raise VerispecError(f"suffix_factor must be in (0, 64] draft tokens per matched token "
                                f"(got {self.suffix_factor!r})")

    @property
    def min_confidence(self) -> float:
        """The top probability below which the draft model stops drafting (0: never stops early)."""
        if self.confidence is not None:
            return float(self.confidence)
        return DEFAULT_CONFIDENCE if self.k_policy == "confidence" else 0.0

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.k > 0

    @property
    def drafter_key(self) -> str:
        """What identifies this spec's drafter: every setting but k (one drafter, and one record of its
        costs and acceptance, per key)."""
        return repr(replace(self, k=0))


PLAIN = SpecConfig(method="none", k=0)


# The speculation verispec runs when a draft model is loaded and the user names no method: generate,
# serve, bench, demo and chat start from it, and each flag (--method, -k, --k-policy, --confidence,
# --draft-vocab, --draft-window) overrides one field. Every default setting lives on this line.
DEFAULT_SPEC = SpecConfig(method="hybrid", k=5, k_policy="cost", confidence=0.3, draft_vocab=32768, draft_window=256)


def default_spec(has_draft: bool) -> SpecConfig:
    """What runs when the user names no method: :data:`DEFAULT_SPEC` with a draft model, else plain decoding."""
    return DEFAULT_SPEC if has_draft else PLAIN


def spec_defaults(**fields: Any) -> SpecConfig:
    """:data:`DEFAULT_SPEC` with ``fields`` replaced; a field given as None keeps its default.

    0 turns off ``draft_vocab``, ``draft_window`` (see :class:`SpecConfig`) and ``confidence``
    (a draft never stops early). The method is :data:`DEFAULT_SPEC`'s unless ``fields`` names one.
    """
    return replace(DEFAULT_SPEC, **{name: value for name, value in fields.items() if value is not None})


def user_spec(method: str | None, has_draft: bool, **fields: Any) -> SpecConfig:
    """The speculation a user's options ask for: ``method`` (None: :func:`default_spec`'s) with every field
    :func:`spec_defaults` does not override left at :data:`DEFAULT_SPEC`'s; ``none`` is plain decoding."""
    method = method or default_spec(has_draft).method
    if method == "none":
        return PLAIN
    return spec_defaults(**fields, method=method)
