"""What keeps one client from tying the server up: body limit, read timeouts, connection limit, prompt byte bound,
tokenization off the event loop, and the Host check."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from tiny_server import make_tiny_pair, running_server, save_byte_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verispec import Engine
from verispec.config import SpecConfig
from verispec.errors import VerispecError
from verispec.server import ServerConfig, create_app
from verispec.server.limits import host_allowed, host_name, is_loopback, prompt_byte_limit, token_bytes_bound, utf8_len

MODEL = "tiny"
MAX_LEN = 256
FIXED = SpecConfig(k_policy="fixed", method="draft", k=3)
BODY_LIMIT = 4096
READ_TIMEOUT = 0.6


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("limits_models"))
    return Engine.from_pretrained(str(target), draft=str(draft), dtype="float32", max_len=MAX_LEN, progress=False)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[Any]:
    config = ServerConfig(model_name=MODEL, spec=FIXED, max_body_bytes=BODY_LIMIT, read_timeout_s=READ_TIMEOUT)
    app = create_app(engine, config)
    with running_server(app, config) as srv:
        srv.app_ = app
        yield srv


@pytest.fixture()
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def _raw(server: Any) -> socket.socket:
    port = int(server.base_url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _health(sock: socket.socket) -> bytes:
    """Send GET /health on ``sock`` and read the whole answer."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while not data.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- the body limit --------------------------------------------------------------------------------


def test_a_declared_body_over_the_limit_gets_413(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    err = _error(r, 413, "request_too_large")
    assert str(BODY_LIMIT) in err["message"] and r.headers["connection"] == "close"
    # Just under the limit, the same request goes through (to the context check here).
    _error(http.post("/v1/completions", json={**body, "prompt": "x" * 600}), 400, "context_length_exceeded")


def test_a_chunked_body_is_counted_as_it_arrives(http: httpx.Client) -> None:
    def chunks(sizes: list[int]) -> Iterator[bytes]:
        prompt = b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        yield prompt
        for n in sizes:
            yield b"y" * n
        yield b'"}'

    headers = {"content-type": "application/json"}
    # No Content-Length: only counting the chunks catches it.
    r = http.post("/v1/completions", content=chunks([1500] * 3), headers=headers)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    _error(r, 413, "request_too_large")
    # Chunks under the limit reach the endpoint whole.
    r = http.post("/v1/completions", content=chunks([10, 20, 30]), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 60  # one token per byte: every chunk arrived


def test_a_body_that_does_not_arrive_in_time_gets_408(server: Any) -> None:
    with _raw(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert READ_TIMEOUT * 0.8 < time.monotonic() - t0 < READ_TIMEOUT + 5


# -- the request head deadline and the connection limit ---------------------------------------------


def test_a_request_head_trickled_in_is_cut_off(server: Any) -> None:
    with _raw(server) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed_at = None
        for _ in range(int(4 * READ_TIMEOUT / 0.1)):  # a header byte every 0.1 s never completes the head
            try:
                sock.sendall(b"X")
            except OSError:
                closed_at = time.monotonic()
                break
            sock.settimeout(0.1)
            try:
                if sock.recv(1024) == b"":
                    closed_at = time.monotonic()
                    break
            except TimeoutError:
                pass
    assert closed_at is not None and closed_at - t0 < READ_TIMEOUT + 1


def test_an_idle_connection_is_closed_and_a_prompt_one_served(server: Any) -> None:
    with _raw(server) as idle:
        t0 = time.monotonic()
        assert _read_all(idle) == b""  # nothing sent: closed at the head deadline
        assert READ_TIMEOUT * 0.8 < time.monotonic() - t0 < READ_TIMEOUT + 2
    with _raw(server) as sock:  # a complete head in time is served, and the deadline restarts after it
        assert _health(sock).startswith(b"HTTP/1.1 200")
        for _ in range(3):  # each pause is under the deadline, together they are over it
            time.sleep(READ_TIMEOUT / 2)
            assert _health(sock).startswith(b"HTTP/1.1 200")


def test_connections_past_the_limit_get_503(engine: Engine) -> None:
    config = ServerConfig(model_name=MODEL, spec=FIXED, limit_concurrency=3)
    with running_server(create_app(engine, config), config) as srv:
        url = f"{srv.base_url}/health"
        assert httpx.get(url).status_code == 200
        held = [_raw(srv) for _ in range(3)]
        try:
            time.sleep(0.2)
            assert httpx.get(url).status_code == 503
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        assert httpx.get(url).status_code == 200


# -- the prompt byte bound and tokenizing off the loop ----------------------------------------------


def test_the_prompt_byte_bound_of_the_byte_tokenizer(server: Any, engine: Engine) -> None:
    # One token per byte, and the longest token ("</s>") is 4 bytes: 4 bytes per position at most.
    assert token_bytes_bound(engine.tokenizer) == 4
    assert server.app_.state.verispec.prompt_byte_limit == 4 * (MAX_LEN - 1)
    rng = random.Random(3)
    alphabet = "ab é€😀\n</s>"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert 4 * len(engine.tokenizer.encode(text)) >= utf8_len(text)  # the bound never overstates


def test_a_prompt_over_the_byte_bound_is_refused_without_tokenizing(http: httpx.Client, engine: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 4 * (MAX_LEN - 1)
    calls: list[Any] = []
    original = engine.encode
    monkeypatch.setattr(engine, "encode", lambda *a, **k: calls.append(a) or original(*a, **k))
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    for prompt in ("x" * (limit + 1), "é" * (limit // 2 + 1)):  # bytes, not characters, count
        err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400,
                     "context_length_exceeded")
        assert err["param"] == "prompt" and str(limit) in err["message"]
    messages = [{"role": "user", "content": "z" * limit}]  # the template's own text tips it over
    err = _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400,
                 "context_length_exceeded")
    assert err["param"] == "messages"
    assert calls == []
    # At the bound the prompt is tokenized (and then refused by its token count).
    monkeypatch.undo()
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * limit}), 400, "context_length_exceeded")


def test_tokenizing_does_not_block_the_event_loop(server: Any, http: httpx.Client, engine: Engine,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    entered = threading.Event()
    original = engine.encode

    def slow_encode(*args: Any, **kwargs: Any) -> list[int]:
        entered.set()
        time.sleep(1.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "encode", slow_encode)
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: result.update(r=httpx.post(
        f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "slow", "max_tokens": 2}, timeout=30)))
    sender.start()
    assert entered.wait(10)
    t0 = time.monotonic()
    assert http.get("/health").status_code == 200
    assert time.monotonic() - t0 < 0.5  # answered while the prompt is still being tokenized
    sender.join(30)
    assert result["r"].status_code == 200


def _tokenizer(normalizer: Any = None, pre: Any = None, added: list[AddedToken] | None = None,
               **bpe: Any) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[], **bpe))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre if pre is not None else pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if added:
        tok.add_special_tokens(added)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_the_byte_bound_allows_for_normalization_and_gives_up_where_text_may_vanish(tmp_path: Any) -> None:
    nfkc = _tokenizer(normalizers.NFKC())
    assert token_bytes_bound(nfkc) == 4  # one byte per token, times NFKC's 4
    # The worst case: 4-byte letters that NFKC turns into ASCII, one token each. The bound still holds.
    text = "𝐀" * 50 + "ｆｕｌｌ" * 10
    assert 4 * len(nfkc.encode(text)) >= utf8_len(text)
    assert token_bytes_bound(_tokenizer(added=[AddedToken("<|end_of_turn|>", special=True)])) == 15
    assert prompt_byte_limit(_tokenizer(), 100) == 99
    # Pipelines that may drop text have no bound: the server then tokenizes every prompt.
    vanishing = [
        _tokenizer(normalizers.Strip()),
        _tokenizer(normalizers.Sequence([normalizers.NFC(), normalizers.StripAccents()])),
        _tokenizer(pre=pre_tokenizers.WhitespaceSplit()),
        _tokenizer(added=[AddedToken("<mask>", lstrip=True, special=True)]),
    ]
    for tok in vanishing:
        assert token_bytes_bound(tok) is None
    stripped = vanishing[0]
    assert len(stripped.encode(" " * 1000 + "a")) == 1  # 1001 bytes, one token
    # A vocabulary without byte fallback drops characters it lacks, unless each becomes one unknown token.
    vocab = {"a": 0, "b": 1, "<unk>": 2}
    plain = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False))
    assert token_bytes_bound(PreTrainedTokenizerFast(tokenizer_object=plain)) == 5
    fused = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    assert token_bytes_bound(PreTrainedTokenizerFast(tokenizer_object=fused)) is None
    assert token_bytes_bound(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab,
                                                                                            merges=[])))) is None
    assert token_bytes_bound(object()) is None  # no tokenizers pipeline
    assert token_bytes_bound(save_byte_tokenizer(tmp_path)) == 4


# -- the Host check --------------------------------------------------------------------------------


def test_the_host_header_must_name_loopback_when_listening_there(http: httpx.Client) -> None:
    for host in ("localhost", "localhost:8000", "LOCALHOST.", "app.localhost", "127.0.0.1", "127.8.9.10:1",
                 "[::1]:8000", "[::ffff:127.0.0.1]"):
        assert http.get("/health", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example",
                 "192.168.1.5", "[::2]", ""):
        r = http.get("/health", headers={"Host": host})
        err = _error(r, 400, "invalid_host")
        assert "allowed-hosts" in err["message"], host
    # A refused request never reaches the endpoint, body and all.
    r = http.post("/v1/completions", headers={"Host": "evil.example"}, json={"model": MODEL, "prompt": "x"})
    _error(r, 400, "invalid_host")


def test_allowed_hosts_extend_or_turn_off_the_check(engine: Engine) -> None:
    def status(config: ServerConfig, host: str) -> int:
        with TestClient(create_app(engine, config)) as client:
            client.app.state.verispec.readiness.join(30)
            return client.get("/health", headers={"Host": host}).status_code

    base = dict(model_name=MODEL, spec=FIXED)
    listed = ServerConfig(**base, allowed_hosts=("api.example.com", " *.corp.example ", "10.0.0.7"))
    assert listed.allowed_hosts == ("api.example.com", "*.corp.example", "10.0.0.7")
    assert status(listed, "api.example.com:443") == 200
    assert status(listed, "llm.corp.example") == 200
    assert status(listed, "10.0.0.7:8000") == 200
    assert status(listed, "localhost") == 200
    assert status(listed, "corp.example") == 400  # *.domain: names under it only
    assert status(listed, "example.com") == 400
    assert status(ServerConfig(**base, allowed_hosts=("*",)), "anything.example") == 200
    # Listening on every interface, the check is off unless hosts are given.
    assert status(ServerConfig(**base, host="0.0.0.0"), "my-server.lan") == 200
    assert status(ServerConfig(**base, host="0.0.0.0", allowed_hosts=("my-server.lan",)), "other.lan") == 400
    assert ServerConfig(**base).checks_host and not ServerConfig(**base, host="::").checks_host
    with pytest.raises(VerispecError):
        ServerConfig(**base, allowed_hosts=(" ", ""))


def test_host_parsing() -> None:
    assert host_name("Example.COM:8080") == "example.com"
    assert host_name("[::1]:8000") == "::1" and host_name("::1") == "::1"
    assert host_name("localhost.") == "localhost"
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.0.1", "example.com"))
    assert not host_allowed("", ("*.example.com",))
    assert host_allowed("a.b.example.com", ("*.example.com",))


# -- the command line --------------------------------------------------------------------------------


def test_serve_flags_reach_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import verispec.server
    from verispec.cli import build_parser

    seen: list[ServerConfig] = []
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(verispec.server, "serve", lambda engine, config, **k: seen.append(config) or False)
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.func(args) == 0
    default = seen[-1]
    assert (default.max_body_bytes, default.read_timeout_s, default.timeout_keep_alive_s,
            default.limit_concurrency, default.allowed_hosts) == (16 * 2**20, 30.0, 5, 256, None)
    assert default.checks_host
    args = build_parser().parse_args(["serve", "--model", "m", "--max-body-mb", "0.5", "--read-timeout", "7",
                                      "--timeout-keep-alive", "9", "--limit-concurrency", "0",
                                      "--allowed-hosts", "a.example,*.b.example", "--host", "0.0.0.0"])
    assert args.func(args) == 0
    c = seen[-1]
    assert (c.max_body_bytes, c.read_timeout_s, c.timeout_keep_alive_s, c.limit_concurrency) == (2**19, 7.0, 9, None)
    assert c.allowed_hosts == ("a.example", "*.b.example") and c.checks_host
    with pytest.raises(VerispecError):
        ServerConfig(model_name="m", max_body_bytes=0)
