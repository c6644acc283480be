"""The server's settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.config import SpecConfig
from verispec.errors import VerispecError


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server behaves; the engine itself is configured separately.

    ``spec`` is the speculation used for requests routed to the speculative path (a request
    may name another method or k); ``spec_fraction`` is the canary share of requests routed
    there when a request does not choose itself. ``max_batch`` requests share each target forward
    (the engine's slots; 1 serves them in turn). ``admin_token`` guards the admin endpoints,
    which are disabled without one. ``prefix_reuse`` keeps a finished request's KV for later
    requests sharing a prefix with it (multi-turn chats, repeated system prompts; see
    :mod:`verispec.engine.prefix`). ``max_body_bytes``, ``read_timeout_s``, ``timeout_keep_alive_s``,
    ``limit_concurrency`` and ``allowed_hosts`` bound what one client can hold up (see
    :mod:`verispec.server.limits`).
    """

    model_name: str
    spec: SpecConfig = field(default_factory=SpecConfig)
    spec_fraction: float = 1.0
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None
    max_batch: int = 4  # requests generated together (continuous batching); 1 = one at a time
    max_queue: int = 64  # requests waiting for a slot; more are refused with 429
    retry_after_s: int = 1  # the Retry-After a refused client is given
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    stats_window_s: float = 60.0  # the window /stats and the dashboard summarise
    shutdown_timeout_s: float = 10.0  # how long shutdown waits for the worker to stop
    prefix_reuse: bool = True  # reuse the KV a finished request left for requests sharing its prefix
    max_body_bytes: int = 16 * 2**20  # a request body past this is refused with 413
    read_timeout_s: float = 30.0  # a request's head, and then its body, must arrive within this
    timeout_keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    limit_concurrency: int | None = 256  # open connections past this get 503 (None: no limit)
    # Host headers accepted (besides localhost names and loopback addresses); None: the check is on
    # exactly when the server listens on a loopback address; ("*",): no check.
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.model_name:
            raise VerispecError("the served model needs a name")
        if not 0.0 <= self.spec_fraction <= 1.0:
            raise VerispecError(f"spec_fraction must be in [0, 1] (got {self.spec_fraction!r})")
        if not 0 <= self.port <= 65535:
            raise VerispecError(f"port must be in [0, 65535] (got {self.port!r})")
        if self.max_batch < 1:
            raise VerispecError(f"max_batch must be at least 1 (got {self.max_batch!r})")
        if self.max_queue < 1:
            raise VerispecError(f"max_queue must be at least 1 (got {self.max_queue!r})")
        if self.retry_after_s < 0:
            raise VerispecError("retry_after_s must be >= 0")
        if self.default_max_tokens < 1:
            raise VerispecError("default_max_tokens must be at least 1")
        if self.stats_window_s <= 0 or self.shutdown_timeout_s <= 0:
            raise VerispecError("stats_window_s and shutdown_timeout_s must be positive")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise VerispecError("the admin token must have at least 8 characters")
        if self.max_body_bytes < 1:
            raise VerispecError(f"max_body_bytes must be at least 1 (got {self.max_body_bytes!r})")
        if self.read_timeout_s <= 0 or self.timeout_keep_alive_s < 1:
            raise VerispecError("read_timeout_s must be positive and timeout_keep_alive_s at least 1")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise VerispecError(f"limit_concurrency must be at least 1 (got {self.limit_concurrency!r})")
        if self.allowed_hosts is not None:
            hosts = tuple(h.strip().lower() for h in self.allowed_hosts if h.strip())
            if not hosts:
                raise VerispecError("allowed_hosts needs at least one name (\"*\" turns the Host check off)")
            object.__setattr__(self, "allowed_hosts", hosts)

    @property
    def checks_host(self) -> bool:
        """Whether the Host header is checked (see :mod:`verispec.server.limits`)."""
        from verispec.server.limits import is_loopback

        if self.allowed_hosts is None:
            return is_loopback(self.host)
        return "*" not in self.allowed_hosts
