"""Architecture hyper-parameters of a Llama-family decoder (Llama, Qwen2/Qwen2.5, SmolLM2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verispec.errors import VerispecError

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    """Shape of the network; validated at construction."""

    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise VerispecError(f"unsupported architecture '{self.arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "head_dim"):
            if getattr(self, field) <= 0:
                raise VerispecError(f"model config: {field} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise VerispecError("model config: n_heads must be a multiple of n_kv_heads")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Build from a Hugging Face ``config.json`` dictionary."""
        model_type = cfg.get("model_type", "")
        arch = "qwen2" if model_type == "qwen2" else "llama" if model_type == "llama" else model_type
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            head_dim=cfg.get("head_dim") or 0,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
