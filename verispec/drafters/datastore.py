"""The on-disk retrieval datastore: a corpus tokenized with the target's tokenizer, plus its suffix array.

A datastore is a folder of three files:

- ``tokens.npy``: int32 token ids of every document, each document followed by ``-1``
  (a separator no continuation crosses);
- ``suffix.npy``: the suffix array of ``tokens.npy`` (int32, int64 past 2**31 tokens);
- ``meta.json``: format version, tokenizer fingerprint, vocabulary size, token and document
  counts, build time. It is written last, so a folder with a meta.json is complete.

Both arrays are opened with ``np.load(mmap_mode="r")``: opening is instant whatever the size
and lookups touch only the pages they read.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from verispec.drafters.suffix_array import suffix_array
from verispec.errors import VerispecError

FORMAT_VERSION = 1
SEPARATOR = -1
TOKENS_FILE, SUFFIX_FILE, META_FILE = "tokens.npy", "suffix.npy", "meta.json"
_BATCH_CHARS = 1 << 20  # tokenize about this many characters per call: fast, yet the progress bar moves


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the vocabulary (token -> id) and the special tokens: equal iff ids mean the same."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(tokenizer.all_special_tokens), ensure_ascii=False).encode())
    return h.hexdigest()


@dataclass
class Datastore:
    """An opened datastore: memory-mapped ``tokens`` and suffix array ``sa``, and its ``meta``."""

    path: Path
    tokens: np.ndarray
    sa: np.ndarray
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path, tokenizer: Any | None = None, vocab_size: int | None = None) -> Datastore:
        """Open the datastore at ``path``; refuse it if it was built with another tokenizer.

        ``tokenizer`` (the target's) is compared by fingerprint. Without one only the vocabulary
        size can be checked against ``vocab_size`` (the target's embedding rows).
        """
        path = Path(path)
        hint = "build one with `verispec datastore build CORPUS... -o STORE --model MODEL`"
        if not path.is_dir():
            raise VerispecError(f"no datastore at {path} ({hint})")
        try:
            meta = json.loads((path / META_FILE).read_text())
        except FileNotFoundError:
            raise VerispecError(f"{path} is not a complete datastore: {META_FILE} is missing ({hint})") from None
        except (OSError, ValueError) as e:
            raise VerispecError(f"{path}: corrupt {META_FILE} ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != "verispec-datastore":
            raise VerispecError(f"{path}: {META_FILE} does not describe a verispec datastore")
        if meta.get("version") != FORMAT_VERSION:
            raise VerispecError(f"{path}: datastore format version {meta.get('version')} is not supported "
                                f"(this verispec reads version {FORMAT_VERSION}; rebuild it)")
        arrays = []
        for name in (TOKENS_FILE, SUFFIX_FILE):
            try:
                arr = np.load(path / name, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                raise VerispecError(f"{path}: {name} is missing (rebuild the datastore)") from None
            except (OSError, ValueError) as e:  # truncated files fail here: the header promises more bytes
                raise VerispecError(f"{path}: corrupt {name} ({e}); rebuild the datastore") from None
            if arr.ndim != 1 or arr.dtype.kind != "i":
                raise VerispecError(f"{path}: {name} is not a 1-D integer array; rebuild the datastore")
            arrays.append(arr)
        tokens, sa = arrays
        if len(tokens) != meta.get("n_tokens") or len(sa) != len(tokens):
            raise VerispecError(f"{path}: sizes disagree ({len(tokens)} tokens, {len(sa)} suffixes, "
                                f"meta says {meta.get('n_tokens')}); rebuild the datastore")
        _check_tokenizer(path, meta, tokenizer, vocab_size)
        return cls(path, tokens, sa, meta)


def _check_tokenizer(path: Path, meta: dict[str, Any], tokenizer: Any | None, vocab_size: int | None) -> None:
    if tokenizer is not None:
        if meta.get("tokenizer_fingerprint") != tokenizer_fingerprint(tokenizer):
            raise VerispecError(f"{path} was built with another tokenizer ({meta.get('tokenizer', '?')}, "
                                f"{meta.get('vocab_size')} tokens) than this model's ({len(tokenizer.get_vocab())} "
                                "tokens); rebuild it with --model set to this model")
    elif vocab_size is not None and int(meta.get("vocab_size", 0)) > vocab_size:
        raise VerispecError(f"{path} was built for a vocabulary of {meta.get('vocab_size')} tokens but the model "
                            f"embeds {vocab_size}")


# -- building ---------------------------------------------------------------------------------

def _expand(paths: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise VerispecError(f"corpus file {p} does not exist")
    if not files:
        raise VerispecError("no corpus files (.txt or .jsonl) given")
    return files


def _record_text(record: Any) -> str | None:
    """The text of a JSONL record: ``text``, else ``prompt`` and/or ``turns`` (a list of strings)."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("text"), str):
        return record["text"]
    parts = [record["prompt"]] if isinstance(record.get("prompt"), str) else []
    turns = record.get("turns")
    if isinstance(turns, list):
        parts += [t for t in turns if isinstance(t, str)]
    return "\n".join(parts) if parts else None


def iter_documents(files: Sequence[Path]) -> Iterator[tuple[str, int]]:
    """(document text, bytes of input it consumed) for every document of ``files``."""
    for f in files:
        if f.suffix == ".jsonl":
            with open(f, "rb") as fh:
                for line_no, raw in enumerate(fh, 1):
                    line = raw.strip()
                    if not line:
                        yield "", len(raw)
                        continue
                    try:
                        text = _record_text(json.loads(line))
                    except ValueError as e:
                        raise VerispecError(f"{f}:{line_no}: invalid JSON ({e})") from None
                    yield text or "", len(raw)  # records without text are skipped, not fatal
        else:
            raw = f.read_bytes()
            try:
                yield raw.decode("utf-8"), len(raw)
            except UnicodeDecodeError as e:
                raise VerispecError(f"{f}: not UTF-8 text ({e})") from None


@dataclass
class BuildSummary:
    """What :func:`build_datastore` wrote."""

    path: Path
    n_tokens: int
    n_documents: int
    bytes_on_disk: int
    build_s: float


def _tokenize_all(files: list[Path], tokenizer: Any, progress: bool) -> tuple[np.ndarray, int]:
    from tqdm import tqdm

    chunks: list[np.ndarray] = []
    n_docs = 0
    batch: list[str] = []
    batch_chars = 0
    sep = np.array([SEPARATOR], dtype=np.int32)

    def flush() -> None:
        nonlocal batch, batch_chars, n_docs
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if ids:  # a document of no tokens would only add a separator
                chunks.append(np.asarray(ids, dtype=np.int32))
                chunks.append(sep)
                n_docs += 1
        batch, batch_chars = [], 0

    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, disable=not progress or None) as bar:
        for text, size in iter_documents(files):
            if text:
                batch.append(text)
                batch_chars += len(text)
            if batch_chars >= _BATCH_CHARS:
                flush()
            bar.update(size)
        if batch:
            flush()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return tokens, n_docs


def build_datastore(corpus_paths: Sequence[str | Path], tokenizer: Any, out_dir: str | Path,
                    progress: bool = True) -> BuildSummary:
    """Tokenize ``corpus_paths`` with ``tokenizer`` and write a datastore to ``out_dir``.

    ``.txt`` files (and any other non-JSONL file) are one document each; ``.jsonl`` files hold
    one document per line in a ``text`` field (else ``prompt`` and/or ``turns``). Folders are
    searched for ``.txt`` and ``.jsonl`` files. No special tokens are added.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    files = _expand(corpus_paths)
    tokens, n_docs = _tokenize_all(files, tokenizer, progress)
    if n_docs == 0 or len(tokens) == 0:
        raise VerispecError("the corpus holds no text")
    if int(tokens.max()) >= 2**31 - 1:
        raise VerispecError("token ids do not fit in int32")
    with tqdm(desc="indexing", unit=" rounds", disable=not progress or None) as bar:
        def advance(h: int) -> None:  # one prefix-doubling round: suffixes now sorted by h tokens
            bar.set_postfix(sorted_by=f"{h} tokens", refresh=False)
            bar.update(1)

        sa = suffix_array(tokens, on_round=advance)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # an interrupted rebuild must not look complete
    np.save(out / TOKENS_FILE, tokens)
    np.save(out / SUFFIX_FILE, sa)
    build_s = time.perf_counter() - t0
    meta = {
        "format": "verispec-datastore",
        "version": FORMAT_VERSION,
        "tokenizer": getattr(tokenizer, "name_or_path", "") or "",
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_size": len(tokenizer.get_vocab()),
        "n_tokens": int(len(tokens)),
        "n_documents": n_docs,
        "separator": SEPARATOR,
        "suffix_dtype": str(sa.dtype),
        "sources": [str(f) for f in files],
        "build_s": round(build_s, 3),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    size = sum((out / f).stat().st_size for f in (TOKENS_FILE, SUFFIX_FILE, META_FILE))
    return BuildSummary(out, int(len(tokens)), n_docs, size, build_s)
