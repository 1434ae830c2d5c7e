"""kvserve's offline API, as `from vllm import LLM, SamplingParams` reads in vLLM.

The ingress never imports this package: it loads torch and the engine."""

from replica.config import EngineConfig
from replica.engine import Engine
from replica.llm import LLM
from wire.outputs import CompletionOutput, RequestDelta, RequestOutput
from wire.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
]
