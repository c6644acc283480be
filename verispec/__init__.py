"""verispec: lossless speculative decoding for Llama-family models."""

from verispec.config import EngineConfig, SpecConfig
from verispec.constraints import Constraint
from verispec.engine.engine import Engine, GenerationResult
from verispec.errors import VerispecError
from verispec.sampling import SamplingParams

__all__ = ["Constraint", "Engine", "EngineConfig", "GenerationResult", "SamplingParams", "SpecConfig", "VerispecError"]
__version__ = "0.1.0"
