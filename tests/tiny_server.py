"""Test helpers for the HTTP server: tiny models with a byte-level tokenizer, and a server on a loopback port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from tiny import make_tiny
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Two special tokens (ids 0 and 1: the tiny models' BOS and EOS) plus one token per byte.
BYTE_VOCAB = 2 + 256


def save_byte_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """Save a byte-level tokenizer (no merges) with a chat template into ``folder``.

    Every byte is its own token, so multi-byte characters span several tokens: exactly the
    case streaming must not split.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)
    return fast


def make_tiny_pair(root: Path, layers: int = 2, dim: int = 64, max_positions: int | None = None) -> tuple[Path, Path]:
    """A tiny Llama target with a tokenizer and a draft that is the target plus noise (often agrees).

    Llama, not Qwen2: for a Qwen2 config transformers swaps in its own Qwen2 tokenizer class,
    while a Llama config keeps the saved tokenizer as it is. ``max_positions`` raises the models'
    context (512) for long prompts.
    """
    target, draft = root / "target", root / "draft"
    shape = dict(arch="llama", vocab=BYTE_VOCAB, layers=layers, dim=dim, heads=4, kv_heads=2, seed=11)
    ref = make_tiny(target, **shape)
    save_byte_tokenizer(target)
    noisy = make_tiny(draft, **shape)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for (_, p), (_, r) in zip(noisy.named_parameters(), ref.named_parameters(), strict=True):
            p.copy_(r + 0.06 * r.std() * torch.randn(p.shape, generator=gen))
    noisy.save_pretrained(draft)
    save_byte_tokenizer(draft)
    if max_positions is not None:
        for folder in (target, draft):
            config = json.loads((folder / "config.json").read_text())
            config["max_position_embeddings"] = max_positions
            (folder / "config.json").write_text(json.dumps(config))
    return target, draft


@contextmanager
def running_server(app: Any, config: Any, timeout: float = 30.0, wait_ready: bool = True) -> Iterator[Any]:
    """Run ``app`` under :class:`VerispecServer` in a thread on a free loopback port; yields the server.

    The socket is bound here first, so there is no race for the port. With ``wait_ready`` it
    yields once the warm-up has ended (``/health`` answers 200).
    """
    from verispec.server.runner import VerispecServer

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = VerispecServer(app, config, log_level="warning", access_log=False)
    server.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        readiness = app.state.verispec.readiness
        while wait_ready and readiness.state == "loading":
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not finish its warm-up")
            time.sleep(0.02)
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def metric_value(client: httpx.Client, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``, from GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
