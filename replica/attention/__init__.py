"""Paged attention backends, plugged into transformers through AttentionInterface.

Only the torch reference exists so far; Triton and flash-attn backends slot in here as
further entries of BACKENDS, each with the same signature.
"""

from transformers import AttentionInterface

from replica.attention.context import ForwardContext, forward_context
from replica.attention.metadata import AttentionMetadata, build_metadata
from replica.attention.torch_backend import kv_cache_shape, torch_paged_attention

BACKENDS = {"torch": torch_paged_attention}


def register_backend(name: str) -> str:
    """Register backend `name` with transformers; returns the attn_implementation key."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    key = f"kvserve_{name}"
    AttentionInterface.register(key, BACKENDS[name])
    return key


__all__ = [
    "AttentionMetadata",
    "ForwardContext",
    "build_metadata",
    "forward_context",
    "kv_cache_shape",
    "register_backend",
]
