"""Peer baselines: what users would otherwise run, on the same weights and prompts.

Hugging Face transformers' ``generate``: plain, assisted generation with the draft model
(``assistant_model=``) and prompt lookup (``prompt_lookup_num_tokens=``). The models load from
the very files the engine loaded (GGUF weights dequantised by transformers) in the engine's
dtype; prompts are the engine's own token ids, so both sides start from identical inputs, and
EOS handling and ``max_new_tokens`` match the engine's.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verispec.bench.harness import Generate, Item
from verispec.engine.engine import Engine, GenerationResult
from verispec.engine.metrics import Metrics
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

PEERS = ("hf",)
HF_PLAIN, HF_ASSISTED, HF_PROMPT_LOOKUP = "hf-plain", "hf-assisted", "hf-prompt-lookup"


def hf_location(name_or_path: str) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for ``from_pretrained``: registry name, .gguf file or HF folder."""
    from verispec import hub

    path = hub.resolve(name_or_path, auto_install=False)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            return path, ggufs[0].name
        return path, None
    return path.parent, path.name


def load_hf_model(name_or_path: str, dtype: torch.dtype) -> Any:
    """A transformers causal LM from the same files the engine loads, in ``dtype``, eval mode.

    Its generation defaults are reset to transformers' own: a folder's generation_config.json may
    carry a repetition penalty or sampling settings the engine would not apply.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder, gguf = hf_location(name_or_path)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:
        raise VerispecError(f"transformers could not load {name_or_path}: {e}") from None
    model.generation_config = GenerationConfig()
    return model.eval()


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class HFPeers:
    """transformers models for the peer rows; call :meth:`close` to free them."""

    engine: Engine
    model: Any
    assistant: Any | None = None
    lookup_tokens: int = 10
    eos: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, engine: Engine, model: str, draft: str | None, lookup_tokens: int) -> HFPeers:
        """Load the target (and the draft, for assisted generation) in the engine's dtype."""
        dtype = engine.target.dtype
        target = load_hf_model(model, dtype)
        assistant = load_hf_model(draft, dtype) if draft else None
        return cls(engine, target, assistant, lookup_tokens, sorted(engine.eos_ids))

    def methods(self) -> dict[str, Generate]:
        """Labelled generate functions: hf-plain, hf-assisted (with a draft), hf-prompt-lookup."""
        out: dict[str, Generate] = {HF_PLAIN: self._gen({})}
        if self.assistant is not None:
            out[HF_ASSISTED] = self._gen({"assistant_model": self.assistant})
        out[HF_PROMPT_LOOKUP] = self._gen({"prompt_lookup_num_tokens": self.lookup_tokens})
        return out

    def _gen(self, extra: dict[str, Any]) -> Generate:
        def gen(item: Item, params: SamplingParams) -> GenerationResult:
            return self.generate(item, params, extra)
        return gen

    @torch.inference_mode()
    def generate(self, item: Item, params: SamplingParams, extra: dict[str, Any]) -> GenerationResult:
        """One timed ``generate`` call; the result mirrors the engine's (EOS not counted as a token)."""
        prompt = self.engine.encode(item.payload, item.chat)
        ids = torch.tensor([prompt], device=self.model.device)
        sampling: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if not params.greedy:
            sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                        "top_k": params.top_k or None}
            if params.seed is not None:
                torch.manual_seed(params.seed)
        eos = [] if params.ignore_eos else self.eos
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                  eos_token_id=eos or None, pad_token_id=(self.eos or [0])[0], streamer=clock,
                                  **sampling, **extra)
        wall = time.perf_counter() - t0
        new = out[0, len(prompt):].tolist()
        finish = "length"
        for i, tok in enumerate(new):
            if tok in eos:
                new, finish = new[:i], "stop"
                break
        new = new[:params.max_tokens]
        m = Metrics(requests=1, prompt_tokens=len(prompt), generated_tokens=len(new), total_s=wall,
                    ttft_s=(clock.first - t0) if clock.first is not None else 0.0)
        return GenerationResult(prompt, new, self.engine.decode(new), finish, m)

    def close(self) -> None:
        """Drop the models and return their memory."""
        self.model = self.assistant = None
        gc.collect()
