"""Paged attention through kvserve's compiled CPU kernel (replica/cpu/attention.c): the
KV write and attention for decode rows and prefill chunks in one call per layer, over
the torch backend's [num_blocks, Hkv, block_size, D] cache layout.

This is the AttentionInterface entry, for models whose attention module is not replaced
by replica/cpu/layers.py; the replaced ones call the same kernel with the rotary
embedding fused in.
"""

import torch

from replica.attention.context import get_forward_context
from replica.cpu import ops

# The sampling kernels the engine takes from this backend: they read bf16 logits without
# widening them to fp32 first.
argmax = ops.argmax
fused_sample = ops.sample


def cpu_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = get_forward_context()
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D] views; the kernel takes strides
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ops.paged_attention(
        q, k, v, k_cache, v_cache, ctx.metadata, scale, kv_scale=ctx.kv_scale(module.layer_idx)
    )
    return out.unsqueeze(0), None  # transformers expects [B, T, H, D]
