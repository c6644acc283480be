"""Running the app under uvicorn, with a shutdown that cancels requests instead of waiting for them."""

from __future__ import annotations

import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from verispec.engine.engine import Engine
from verispec.server.config import ServerConfig
from verispec.server.limits import h11_protocol


class VerispecServer(uvicorn.Server):
    """uvicorn's server; on shutdown it first cancels queued and running requests.

    uvicorn waits for open connections before the app's lifespan ends, so a long stream
    would hold shutdown up; cancelling through the worker first ends every stream promptly
    (streaming clients get an error event, waiting ones a 503).

    Connections are bounded by ``config``: ``limit_concurrency`` (uvicorn answers 503 past it),
    ``timeout_keep_alive_s`` for idle keep-alive connections, and ``read_timeout_s`` for each
    request's head (h11 with a head deadline; uvicorn caps the head at 16 KiB).
    """

    def __init__(self, app: FastAPI, config: ServerConfig, log_level: str = "info", access_log: bool = True) -> None:
        super().__init__(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                        access_log=access_log, lifespan="on",
                                        timeout_graceful_shutdown=int(config.shutdown_timeout_s),
                                        http=h11_protocol(config.read_timeout_s),
                                        limit_concurrency=config.limit_concurrency,
                                        timeout_keep_alive=config.timeout_keep_alive_s))
        self.app = app
        self.interrupted = False  # a SIGINT (Ctrl-C) ended the server

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises a captured SIGINT after shutting down, but inside asyncio.run, whose own
        # handler may find the main task already finished and return normally: record it here so
        # the exit status says "interrupted" either way.
        self.interrupted |= sig == signal.SIGINT
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.app.state.verispec.readiness.listening(f"http://[{host}]:{port}" if ":" in host
                                                        else f"http://{host}:{port}")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = self.app.state.verispec
        state.closing = True
        state.worker.close()
        await super().shutdown(sockets=sockets)


def serve(engine: Engine, config: ServerConfig, log_level: str = "info") -> bool:
    """Serve ``engine`` until interrupted (Ctrl-C or SIGTERM shut down gracefully); True after a Ctrl-C."""
    from verispec.server.app import create_app

    server = VerispecServer(create_app(engine, config), config, log_level=log_level)
    server.run()
    return server.interrupted
