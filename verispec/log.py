"""The package logger (the only module-level state verispec keeps)."""

import logging

logger = logging.getLogger("verispec")
