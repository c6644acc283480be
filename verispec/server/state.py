"""What the endpoints share: the engine, the settings, the worker, metrics and routing (``app.state.verispec``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.engine.engine import Engine
from verispec.server.canary import CanaryRouter
from verispec.server.config import ServerConfig
from verispec.server.metrics import ServerMetrics
from verispec.server.readiness import Readiness
from verispec.server.worker import Worker


@dataclass
class ServerState:
    """Everything the endpoints share, kept on ``app.state.verispec`` (no module globals)."""

    engine: Engine
    config: ServerConfig
    worker: Worker
    metrics: ServerMetrics
    router: CanaryRouter
    started: int
    prompt_byte_limit: int | None = None  # longer prompts cannot fit the context (None: no bound known)
    readiness: Readiness = field(default_factory=Readiness)
    closing: bool = False
