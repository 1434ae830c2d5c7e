"""One model replica: engine, offline API, attention backends.

The names below load on first use: importing `replica.wire` or
`replica.sampling_params` (as the ingress does) must not load torch and the engine."""

import importlib

_EXPORTS = {
    "LLM": "replica.llm",
    "CompletionOutput": "replica.outputs",
    "Engine": "replica.engine",
    "EngineConfig": "replica.config",
    "RequestDelta": "replica.outputs",
    "RequestOutput": "replica.outputs",
    "SamplingParams": "replica.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'replica' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
