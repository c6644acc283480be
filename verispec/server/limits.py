"""What keeps one client from tying the server up: a prompt byte bound, a body limit, read timeouts, a Host check.

- :func:`prompt_byte_limit`: the most UTF-8 bytes a prompt can have and still fit the context, from
  the tokenizer's vocabulary and pipeline; a longer prompt is refused without tokenizing it.
- :class:`RequestLimits`: an ASGI middleware that refuses a body over ``max_body_bytes`` with 413
  (a declared ``Content-Length`` at once, a chunked body as soon as it passes the limit) and a body
  that does not arrive within the read timeout with 408.
- :func:`h11_protocol`: uvicorn's h11 protocol with a deadline for each request's head (request line
  and headers), which uvicorn itself does not bound.
- :class:`HostCheck`: an ASGI middleware that refuses requests whose ``Host`` header names no
  allowed host (a defence against DNS rebinding when the server listens on loopback).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterable
from typing import Any

import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from verispec.server.errors import error_body

# A Unicode normalization or case mapping turns a code point of at most 4 bytes into at least 1 byte
# (NFKC maps 4-byte mathematical letters to ASCII; Hangul composition turns 9 bytes into 3).
_UNICODE_SHRINK = 4
_UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
# Pre-tokenizers that split text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
_UNKNOWN_CHAR_BYTES = 4  # an unknown-token placeholder stands for one code point


# -- the prompt byte bound ---------------------------------------------------------------------


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many times fewer bytes the normalizer may leave than it gets (None: unbounded, e.g. it strips)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _UNICODE_NORMALIZERS:
        return _UNICODE_SHRINK
    if kind in ("Prepend", "ByteLevel"):
        return 1
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        if "String" in pattern and len(normalizer.get("content", "").encode()) >= len(pattern["String"].encode()):
            return 1
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, regex replacements: may drop text


def _pre_tokenizer_keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(p) for p in pre.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _has_type(component: dict[str, Any] | None, kind: str) -> bool:
    if component is None:
        return False
    if component.get("type") == kind:
        return True
    parts = component.get("normalizers") or component.get("pretokenizers") or []
    return any(_has_type(p, kind) for p in parts)


def token_bytes_bound(tokenizer: Any) -> int | None:
    """The most bytes of prompt text one token can stand for, or None where no bound can be shown.

    A prompt of B UTF-8 bytes then has at least ``B / bound`` tokens. The bound is the longest token
    (in bytes of the text it matches: characters for byte-level vocabularies, UTF-8 bytes otherwise,
    added tokens included) times the most a normalizer may shrink the text (4 for Unicode
    normalization and lowercasing). None for tokenizers that may drop or fuse text: a normalizer
    that strips or removes characters, a pre-tokenizer that drops whitespace, an added token that
    swallows the spaces around it, unknown characters fused into one token or dropped, truncation,
    a vocabulary other than BPE or Unigram, or a tokenizer without a ``tokenizers`` pipeline.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 (an unreadable pipeline: no bound)
        return None
    if spec.get("truncation"):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    if shrink is None or not _pre_tokenizer_keeps_text(pre):
        return None
    model = spec.get("model") or {}
    byte_level = _has_type(pre, "ByteLevel") or _has_type(spec.get("normalizer"), "ByteLevel")
    if model.get("type") == "BPE":
        tokens: Iterable[str] = model.get("vocab", {})
        if not (byte_level or model.get("byte_fallback")):
            if model.get("unk_token") is None or model.get("fuse_unk"):
                return None  # an unknown character is dropped, or a run of them is one token
            tokens = [*tokens, "x" * _UNKNOWN_CHAR_BYTES]
    elif model.get("type") == "Unigram" and model.get("byte_fallback"):
        tokens = [piece for piece, _ in model.get("vocab", [])]
    else:
        return None
    # In a byte-level vocabulary each character stands for one byte.
    longest = max((len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")) for t in tokens), default=1)
    for added in spec.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip"):
            return None
        longest = max(longest, len(added.get("content", "").encode("utf-8", "surrogatepass")))
    return max(1, longest) * shrink


def prompt_byte_limit(tokenizer: Any, context_len: int) -> int | None:
    """The most UTF-8 bytes a prompt can have and still fit ``context_len`` (None: no bound is known).

    A prompt fits when it leaves at least one position to generate: ``context_len - 1`` tokens at
    most. With every token standing for at most ``bound`` bytes (:func:`token_bytes_bound`), a
    prompt over ``bound * (context_len - 1)`` bytes has more tokens than that, so refusing it
    never refuses a prompt that would fit.
    """
    bound = token_bytes_bound(tokenizer)
    return None if bound is None else bound * max(1, context_len - 1)


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counts its three bytes)."""
    return len(text.encode("utf-8", "surrogatepass"))


# -- the body limit and the body read timeout --------------------------------------------------


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    # The body may be unread: the connection cannot carry another request.
    response = JSONResponse(error_body(message, status, code=code), status, headers={"Connection": "close"})
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover (a JSONResponse never reads)
    return {"type": "http.disconnect"}


# The most of a refused body read (and dropped) before the refusal is sent. Closing a connection
# whose client is still sending makes its kernel answer with a reset, which can discard the
# refusal before the client reads it; past this bound (or the read timeout) the client may see
# that reset instead of the 413.
DRAIN_BYTES = 64 * 2**20


async def _drain(receive: Receive, more: bool, timeout_s: float) -> None:
    """Read and drop what is left of a refused body, up to :data:`DRAIN_BYTES` and ``timeout_s``."""
    dropped = 0
    try:
        async with asyncio.timeout(timeout_s):
            while more and dropped <= DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                dropped += len(message.get("body", b""))
                more = message.get("more_body", False)
    except TimeoutError:
        return


class RequestLimits:
    """Reads each request's body before the app sees it: 413 past ``max_body_bytes``, 408 past ``timeout_s``.

    A ``Content-Length`` over the limit is refused without passing any of the body on; a chunked
    body is counted as it arrives and refused once it passes the limit. Before the refusal the rest
    of the body is read and dropped, within bounds (:func:`_drain`). The whole body must arrive within
    ``timeout_s`` of the request's head. The body is then handed to the app as it came (later
    ``receive`` calls, which report a disconnect, go to the server as usual).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout_s: float) -> None:
        self.app, self.max_body_bytes, self.timeout_s = app, max_body_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"the request body is larger than this server accepts ({self.max_body_bytes} bytes)"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _drain(receive, True, self.timeout_s)
            await _refuse(send, 413, too_large, "request_too_large")
            return
        messages: list[Message] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request":
                        break
                    size += len(message.get("body", b""))
                    if size > self.max_body_bytes:
                        await _drain(receive, message.get("more_body", False), self.timeout_s)
                        await _refuse(send, 413, too_large, "request_too_large")
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                          "request_timeout")
            return
        replay = iter(messages)

        async def replaying_receive() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replaying_receive, send)


# -- the request head deadline -----------------------------------------------------------------


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head is not complete in time.

    The deadline runs from the connection's opening and from each response's end; it is met once
    h11 has parsed the request line and headers (a client trickling them in a byte at a time does
    not restart it).
    """

    head_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        self._head_deadline = None
        # IDLE: the current request's head has not been parsed yet (h11 moves on once it has).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)


def h11_protocol(head_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``head_timeout_s`` deadline for each request's head."""
    return type("HeadTimeoutH11", (_HeadTimeoutH11,), {"head_timeout_s": head_timeout_s})


# -- the Host check ----------------------------------------------------------------------------


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    ip = _ip(name)
    if ip is None:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches only this machine (localhost, 127.0.0.0/8, ::1)."""
    return _loopback_name(host.strip().strip("[]").lower().rstrip("."))


def host_name(header: str) -> str:
    """The host in a ``Host`` header value, without the port or IPv6 brackets, lower-cased."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``name`` (see :func:`host_name`) is a loopback name or address, or matches ``allowed``.

    An entry is a host name, an IP address, or ``*.domain`` for any name under ``domain``.
    """
    if not name:
        return False
    if _loopback_name(name):
        return True
    ip = _ip(name)
    for entry in allowed:
        entry = entry.strip("[]").rstrip(".")
        if entry.startswith("*."):
            if name.endswith(entry[1:]):
                return True
        elif entry == name or (ip is not None and _ip(entry) == ip):
            return True
    return False


class HostCheck:
    """Refuses with 400 a request whose ``Host`` header names neither loopback nor an ``allowed`` host.

    A web page on another site that resolves its own name to 127.0.0.1 (DNS rebinding) reaches a
    loopback server with its own name in ``Host``; this refuses it.
    """

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not host_allowed(host_name(header), self.allowed):
            shown = header[:100] or "(none)"
            await _refuse(send, 400, f"invalid Host header {shown!r}: this server answers only to localhost "
                          "names, loopback addresses and the hosts given with --allowed-hosts", "invalid_host")
            return
        await self.app(scope, receive, send)

