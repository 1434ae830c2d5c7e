"""One model replica: engine, offline API, attention backends."""

from replica.config import EngineConfig
from replica.engine import Engine
from replica.llm import LLM
from replica.outputs import CompletionOutput, RequestDelta, RequestOutput
from replica.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]
