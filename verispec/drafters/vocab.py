"""A draft head over part of the vocabulary (after FR-Spec, Zhao et al. 2025).

A draft token of a small model reads its whole lm_head: for Qwen2.5-Coder-0.5B that is 151936
rows of 896, about 28% of the bytes of a draft step in the ``int4-all`` format. Yet most tokens a
target emits are frequent ones, and Qwen's BPE ids roughly follow merge rank, i.e. frequency. So
the draft scores only

- the first ``n`` token ids (a prefix of the head's output rows, held in the head's own weight
  format and sharing its storage: every format of :mod:`verispec.models.linear` keeps rows in
  order, in blocks of 16 (or 32/64 for PyTorch's CPU int4 layout));
- plus "extra" rows scored with ``F.linear`` in the model's dtype: the special tokens (end of
  turn must stay proposable) and the ids of the request's prompt outside the prefix (answers
  quote their prompts: identifiers, rare words).

Everything else gets logit -inf. The draft only proposes and the target verifies, so this stays
lossless: greedy verification never looks at the draft's scores, and sampled verification
accepts any proper q (here zero outside the subset).

The extra rows are taken from the head module itself (its 16-row blocks that hold them,
dequantized), not from the embedding, so they are the weights the full head uses, for tied and
untied heads alike, and nothing big is ever dequantized.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from verispec import kernels as fast_kernels
from verispec.config import check_draft_vocab
from verispec.errors import VerispecError
from verispec.models.linear import DenseLinear, Int4Linear, Int4Weight, Int8Linear, Int8Weight

if TYPE_CHECKING:
    from verispec.models.llama import Transformer

# Rows of a 16-row block (verispec's vs16 layouts, int8 and int4, and packed dense bf16).
BLOCK = 16
# PyTorch's CPU int4 layout packs rows in blocks of 32 or 64 (the CPU's vector width); slabs of 64
# rows starting at a multiple of 64 are whole blocks either way (the last slab may be a partial tail).
CPU_INT4_SLAB = 64


def prefix_linear(module: nn.Module, n: int, dtype: torch.dtype) -> nn.Module:
    """The first ``n`` output rows of a linear layer: a module of the same class and weight format.

    Nothing is dequantized: the quantized (or packed) rows are sliced, and where the layout allows
    (vs16 blocks; PyTorch's CPU int4 blocks; plain rows) the new module's buffers are views of the
    old ones, so it costs no memory. Its outputs equal the first ``n`` outputs of ``module``.
    ``dtype`` is the model's compute dtype (used for a bias, as :func:`make_linear` does).
    """
    check_draft_vocab(n)
    out, k = module.out_features, module.in_features
    if n >= out:
        return module
    # Keep the layer's kernel path, 8-bit activations included.
    kernels = "q8" if getattr(module, "q8", False) else "auto" if getattr(module, "fast", False) else "stock"
    bias = None if module.bias is None else module.bias[:n]
    head: nn.Module
    if isinstance(module, DenseLinear):
        if module.fast:
            head = DenseLinear(fast_kernels.bf16_unpack(module.packed[: n // BLOCK].contiguous(), n, k), bias,
                               kernels)
            if head.fast:  # the same bytes: keep a view of the original instead of the repacked copy
                head.packed = module.packed[: n // BLOCK]
        else:
            head = DenseLinear(module.weight[:n], bias, kernels)
    elif isinstance(module, Int8Linear):
        q = module.int8_weight()
        if q.layout == "vs16":
            sub = Int8Weight(q.qweight[: n // BLOCK], q.scale[:n], "vs16")
        else:
            sub = Int8Weight(q.qweight[:n], q.scale[:n])
        head = Int8Linear(sub, bias, dtype, kernels)
    elif isinstance(module, Int4Linear):
        head = Int4Linear(_int4_prefix(_int4_weight(module), n), bias, dtype, kernels)
    else:
        raise VerispecError(f"a reduced draft vocabulary needs a verispec linear head, not {type(module).__name__}")
    return head


def _int4_weight(module: Int4Linear) -> Int4Weight:
    if module.qweight.is_cuda:
        raise VerispecError("a reduced draft vocabulary cannot slice an int4 head packed for CUDA; use int8 or "
                            "dense draft weights on a GPU")
    return module.int4_weight()


def _int4_prefix(w: Int4Weight, n: int) -> Int4Weight:
    if w.layout == "vs16":
        return Int4Weight(w.packed[: n // BLOCK], w.scales_and_zeros[: n // BLOCK], w.group_size, "vs16")
    sz = w.scales_and_zeros[:, :n].contiguous()
    if n % CPU_INT4_SLAB == 0:  # whole packing blocks: their bytes are the first n rows of packed
        return Int4Weight(w.packed[:n], sz, w.group_size)
    # n ends inside a packing block: unpack the slabs covering it and pack the n rows again.
    m = min(w.shape[0], -(-n // CPU_INT4_SLAB) * CPU_INT4_SLAB)
    codes = Int4Weight(w.packed[:m], w.scales_and_zeros[:, :m], w.group_size).codes()[:n]
    return Int4Weight(torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1), sz,
                      w.group_size)


def linear_rows(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a linear layer's weight, dequantized to fp32: ``[len(ids), in_features]``.

    Only the blocks holding those rows are unpacked, so a few hundred rows of a 151936-row head
    cost milliseconds. The values are those the layer's own kernel multiplies by.
    """
    ids = ids.to(torch.long).cpu()
    k = module.in_features
    if ids.numel() == 0:
        return torch.zeros(0, k)
    blocks, where = torch.unique(torch.div(ids, BLOCK, rounding_mode="floor"), return_inverse=True)
    at = where * BLOCK + ids % BLOCK  # each id's row within the unpacked blocks
    if isinstance(module, DenseLinear):
        if module.fast:
            packed = module.packed[blocks.to(module.packed.device)]
            return fast_kernels.bf16_unpack(packed, len(blocks) * BLOCK, k).float()[at]
        return module.weight[ids.to(module.weight.device)].float().cpu()
    if isinstance(module, Int8Linear):
        q = module.int8_weight()
        scale = q.scale.float().cpu()[ids]
        if q.layout == "vs16":
            nb = len(blocks)
            codes = Int8Weight(q.qweight[blocks], torch.zeros(nb * BLOCK), "vs16").rows()[at]
        else:
            codes = q.qweight[ids.to(q.qweight.device)].cpu()
        return codes.float() * scale[:, None]
    if isinstance(module, Int4Linear):
        w = _int4_weight(module)
        if w.layout == "vs16":
            sub = Int4Weight(w.packed[blocks], w.scales_and_zeros[blocks], w.group_size, "vs16")
            return sub.dequantize()[at]
        return _int4_cpu_rows(w, ids)
    raise VerispecError(f"a reduced draft vocabulary needs a verispec linear head, not {type(module).__name__}")


def _int4_cpu_rows(w: Int4Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an int4 weight in PyTorch's CPU layout, unpacked slab by slab (kernels="stock" only)."""
    n = w.shape[0]
    out = torch.empty(len(ids), w.shape[1])
    slabs = torch.div(ids, CPU_INT4_SLAB, rounding_mode="floor")
    for s in torch.unique(slabs).tolist():
        a, b = s * CPU_INT4_SLAB, min(n, (s + 1) * CPU_INT4_SLAB)
        mine = (slabs == s).nonzero()[:, 0]
        rows = Int4Weight(w.packed[a:b], w.scales_and_zeros[:, a:b], w.group_size).dequantize()
        out[mine] = rows[ids[mine] - a]
    return out


class SubsetHead(nn.Module):
    """An lm_head scoring the first ``n`` ids (``prefix``) plus ``extra_ids``; -inf everywhere else.

    Returns fp32 logits over the full ``vocab``, so sampling, verification and everything after
    the draft's forward stay as they are. Pass it as ``head=`` to :meth:`Transformer.forward`.
    """

    def __init__(self, prefix: nn.Module, n: int, vocab: int, extra_ids: torch.Tensor, extra_weight: torch.Tensor,
                 extra_bias: torch.Tensor | None = None, round_to_bf16: bool = False) -> None:
        super().__init__()
        self.prefix, self.n, self.vocab = prefix, n, vocab
        self.register_buffer("extra_ids", extra_ids.to(torch.long))
        self.register_buffer("extra_weight", extra_weight)
        self.register_buffer("extra_bias", extra_bias)
        # An int4 head's kernel rounds activations to bf16 first: do the same, so the extra rows
        # score as the full head would (up to the order of the sums).
        self.round_to_bf16 = round_to_bf16

    @property
    def size(self) -> int:
        """How many ids get a finite logit."""
        return self.n + int(self.extra_ids.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.full((*x.shape[:-1], self.vocab), float("-inf"), dtype=torch.float32, device=x.device)
        out[..., : self.n] = self.prefix(x)
        if self.extra_ids.numel():
            xe = x.to(torch.bfloat16) if self.round_to_bf16 else x
            out[..., self.extra_ids] = F.linear(xe.to(self.extra_weight.dtype), self.extra_weight,
                                                self.extra_bias).float()
        return out


class DraftVocab:
    """Reduced heads for one draft ``model``: its first ``n`` ids plus special and prompt tokens.

    The prefix module is built once per DraftVocab (mostly views of the head's own buffers);
    :meth:`head` adds a request's extra rows.
    """

    def __init__(self, model: Transformer, n: int, special_ids: Iterable[int] = ()) -> None:
        check_draft_vocab(n)
        self.model, self.n = model, n
        self.vocab = model.args.vocab_size
        if n >= self.vocab:
            raise VerispecError(f"draft vocab {n} is not smaller than the draft's vocabulary ({self.vocab}): "
                                "use the full head")
        self.prefix = prefix_linear(model.lm_head, n, model.dtype)
        self.special_ids = sorted({int(i) for i in special_ids if n <= int(i) < self.vocab})

    def extra_ids(self, prompt: Iterable[int] = ()) -> list[int]:
        """The ids scored besides the prefix: special tokens and ``prompt``'s ids outside the prefix."""
        return sorted(set(self.special_ids).union(t for t in prompt if self.n <= t < self.vocab))

    def head(self, prompt: Iterable[int] = ()) -> SubsetHead:
        """The head for a request whose prompt is ``prompt``."""
        return self.head_for(self.extra_ids(prompt))

    def head_for(self, extra_ids: list[int]) -> SubsetHead:
        """The head scoring the prefix plus exactly ``extra_ids`` (ids >= n)."""
        full = self.model.lm_head
        device = self.model.device
        ids = torch.tensor(extra_ids, dtype=torch.long)
        weight = linear_rows(full, ids).to(device=device, dtype=self.model.dtype)
        bias = None if full.bias is None else full.bias[ids.to(full.bias.device)].to(device, self.model.dtype)
        return SubsetHead(self.prefix, self.n, self.vocab, ids.to(device), weight, bias,
                          round_to_bf16=isinstance(full, Int4Linear))


def special_token_ids(tokenizer: Any | None, eos_ids: Iterable[int]) -> set[int]:
    """Ids a reduced draft head always scores: end-of-sequence ids and the tokenizer's special tokens.

    A Hugging Face tokenizer's regular vocabulary is ``tokenizer.vocab_size`` ids; the ids from
    there up to ``len(tokenizer)`` are added tokens (for Qwen2.5 <|endoftext|>, <|im_start|>,
    <|im_end|>, the FIM and tool-call markers). Without a tokenizer only the EOS ids are known.
    """
    ids = set(eos_ids)
    tok = tokenizer
    if tok is not None:
        base, total = getattr(tok, "vocab_size", None), len(tok)
        if isinstance(base, int) and base < total:
            ids.update(range(base, total))
        ids.update(i for i in getattr(tok, "all_special_ids", ()) if i is not None)
        ids.update(getattr(tok, "added_tokens_decoder", {}).keys())
    return ids
