"""Triton paged attention: the torch backend's contract (same cache layout, same metadata,
same transformers signature) on three kernels, so the two backends are interchangeable.

Per layer: write this step's K/V into the cache, then decode rows (split-K kernel), then
every prefill chunk in one launch. Prefill reads its own new keys back from the cache too,
which is why the write comes first (and why, with an fp8 cache, a fresh prompt attends the
quantized keys and values, as the torch backend does).
"""

import torch

from replica.attention.context import get_forward_context
from replica.attention.metadata import AttentionMetadata
from replica.attention.triton_decode import paged_decode
from replica.attention.triton_prefill import paged_prefill
from replica.attention.triton_write import write_kv_triton
from replica.kv_quant import UNIT_SCALE, KVScale


def triton_paged_attention(
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
    meta = ctx.metadata
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    # [T, H, D] views; the kernels take strides, so nothing is copied.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kv_scale = ctx.kv_scale(module.layer_idx)
    write_kv_triton(k_cache, v_cache, k, v, meta.slot_mapping, kv_scale)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return attend(q, k_cache, v_cache, meta, scale, kv_scale).unsqueeze(0), None  # [B, T, H, D]


def attend(
    q: torch.Tensor,  # [T, H, D], any strides with a contiguous last dim
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Every packed row's attention over the cache, which already holds this step's keys and
    values: the decode rows in one launch, every prefill chunk in another. -> [T, H, D]"""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        paged_decode(
            q[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            out=out[:nd],
            kv_scale=kv_scale,
        )
    if meta.prefill_query_starts is not None:
        paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.prefill_query_starts,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            meta.max_prefill_query_len,
            scale,
            out,
            kv_scale,
        )
    return out
