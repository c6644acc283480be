"""Log-probabilities in OpenAI's two shapes: chat's ``content`` list and completions' parallel lists.

The values are the target model's own (log-softmax of its logits before temperature, penalties, bias and
constraints, as vLLM reports by default), the same whether a token was drafted or not.
"""

from __future__ import annotations

from typing import Any

from verispec.sampling import TokenLogprob


def _text(tok: Any, token: int) -> str:
    return tok.decode([token]) if tok is not None else str(token)


def _entry(tok: Any, token: int, logprob: float) -> dict[str, Any]:
    text = _text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(logprobs: list[TokenLogprob], tok: Any) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    return {"content": [{**_entry(tok, lp.token, lp.logprob),
                         "top_logprobs": [_entry(tok, t, v) for t, v in lp.top]} for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob], tok: Any, offset: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of a completion: tokens, their log-probabilities, the top alternatives and
    each token's character offset in the choice's text (``offset``: text before the first token, e.g. echo)."""
    tokens = [_text(tok, lp.token) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_text(tok, t): v for t, v in lp.top} for lp in logprobs], "text_offset": offsets}
