"""verispec's OpenAI-compatible HTTP server: ``create_app`` builds it, ``serve`` runs it."""

from verispec.server.app import create_app
from verispec.server.config import ServerConfig
from verispec.server.runner import VerispecServer, serve

__all__ = ["ServerConfig", "VerispecServer", "create_app", "serve"]
