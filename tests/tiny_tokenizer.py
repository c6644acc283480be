"""A tiny word-level tokenizer (with a chat template) for the tiny random models, so text paths can be tested."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# Ids 0 and 1 match make_tiny's bos_token_id and eos_token_id.
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "be", "by",
         "this", "def", "return", "print", "(", ")", ":", ",", ".", "?", "!", "=", "+", "-", "1", "2", "3",
         "x", "y", "code", "write", "story", "about", "cat", "dog", "what", "how", "why", "translate", "summarize",
         "question", "answer", "hello", "world"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_tiny_tokenizer(folder: Path, vocab: int = 96) -> PreTrainedTokenizerFast:
    """Save a word-level tokenizer of exactly ``vocab`` tokens into ``folder`` and return it.

    Words outside the vocabulary map to ``<unk>``; decoding joins tokens with spaces. Use it with
    ``make_tiny(..., arch="llama")`` folders: for a ``qwen2`` config, transformers' AutoTokenizer
    forces its own Qwen2Tokenizer class, which rebuilds a BPE model and ignores this word-level one.
    """
    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(vocab - len(words))]
    if len(words) != vocab:
        raise ValueError(f"vocab must be at least {len(SPECIALS) + len(WORDS)}")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast
