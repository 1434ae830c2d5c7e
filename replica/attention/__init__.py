"""Paged attention backends, plugged into transformers through AttentionInterface.

Four backends share one signature (transformers' attention function) and one metadata
object; they differ in cache layout and in whether a decode step can be captured in a
CUDA graph. `select.py` decides which one runs; `load_backend` imports only that one,
so a missing kernel package never breaks the others.
"""

from collections.abc import Callable
from dataclasses import dataclass

from transformers import AttentionInterface

from replica.attention.context import ForwardContext, forward_context
from replica.attention.metadata import AttentionMetadata, build_metadata
from replica.attention.select import choose_backend, effective_block_size, installed_kernel_packages
from replica.attention.torch_backend import kv_cache_shape, torch_paged_attention


@dataclass(frozen=True)
class Backend:
    name: str
    attention: Callable  # transformers' attention-function signature
    kv_cache_shape: Callable[[int, int, int, int], tuple[int, ...]]  # (blocks, block_size, Hkv, D)
    # Decode reads only metadata tensors (no host-built masks, no Python lists), so a
    # decode step can be captured once and replayed with new tensor contents.
    graph_safe: bool
    # Sampling kernels for the backend's device, None where torch's ops serve (see
    # replica/sampler.py): logits [B, V] -> tokens [B], and sampler.FusedSample.
    argmax: Callable | None = None
    fused_sample: Callable | None = None


def load_backend(name: str) -> Backend:
    if name == "torch":
        # Its decode mask is built on the host and it gathers whole block tables: not graphed.
        return Backend("torch", torch_paged_attention, kv_cache_shape, graph_safe=False)
    if name == "cpu":
        from replica.attention import cpu_backend

        return Backend(
            "cpu",
            cpu_backend.cpu_paged_attention,
            kv_cache_shape,
            graph_safe=False,
            argmax=cpu_backend.argmax,
            fused_sample=cpu_backend.fused_sample,
        )
    if name == "triton":
        from replica.attention.triton_backend import triton_paged_attention

        return Backend("triton", triton_paged_attention, kv_cache_shape, graph_safe=True)
    if name == "flash_attn":
        from replica.attention import flash_attn_backend as fa

        if fa.flash_attn_with_kvcache is None:
            raise ValueError("attention backend 'flash_attn' is unavailable: flash-attn failed to import")
        return Backend("flash_attn", fa.flash_attn_paged_attention, fa.kv_cache_shape, graph_safe=True)
    raise ValueError(f"unknown attention backend {name!r}")


def register_backend(backend: Backend | str) -> str:
    """Register the backend (or backend name) with transformers; returns the
    attn_implementation key."""
    if isinstance(backend, str):
        backend = load_backend(backend)
    key = f"kvserve_{backend.name}"
    AttentionInterface.register(key, backend.attention)
    return key


__all__ = [
    "AttentionMetadata",
    "Backend",
    "ForwardContext",
    "build_metadata",
    "choose_backend",
    "effective_block_size",
    "forward_context",
    "installed_kernel_packages",
    "kv_cache_shape",
    "load_backend",
    "register_backend",
]
