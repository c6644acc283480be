"""Tiny random-weight models built in code, saved as Hugging Face folders for the loader."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def make_tiny(folder: Path, arch: str = "qwen2", vocab: int = 96, layers: int = 2, dim: int = 64, heads: int = 4,
              kv_heads: int = 2, seed: int = 0, tie: bool = False, scale: float = 1.0):
    """Build, save and return a random ``transformers`` model (fp32, eval mode).

    ``scale`` multiplies every weight after init: transformers' default init (std 0.02) gives
    nearly flat logits, so tests that need decisive distributions scale the weights up.
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if arch == "qwen2":
        cfg = Qwen2Config(rope_theta=10000.0, **common)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(rope_theta=10000.0, **common)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02 * scale * 5)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model
