"""Paged attention through the flash-attn 2 package (CUDA only, fp16/bf16).

Its paged kernels take their own cache layout: a layer's cache is a pair of
[num_blocks, block_size, Hkv, D] tensors with block_size a multiple of 256 (select.py
picks 256). Decode rows go through `flash_attn_with_kvcache` (one query per sequence,
split-KV over the context), prefill chunks through one `flash_attn_varlen_func` call with
cu_seqlens and a block table; both causal masks align bottom-right, which is exactly "the
chunk's queries are the last tokens of their context". K/V are written first, with an
index copy on the flat slot view, so padded CUDA-graph rows can target the scratch block.
Decode reads only tensors, so CUDA graphs can capture it.
"""

import torch
import torch.nn.functional as F

from replica.attention.context import get_forward_context

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # CUDA-only package; select.py never picks this backend without it
    flash_attn_varlen_func = flash_attn_with_kvcache = None


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [T, Hkv, D]; block-major pages make slot s row s of the flat [N * bs, Hkv, D] view."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def flash_attn_paged_attention(
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
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5

    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        decoded = flash_attn_with_kvcache(
            q[:nd].unsqueeze(1),  # [B, 1, H, D]
            k_cache,
            v_cache,
            cache_seqlens=meta.decode_context_lens,
            block_table=meta.decode_block_tables.to(torch.int32),
            softmax_scale=scale,
            causal=True,
        )
        out[:nd] = decoded.squeeze(1)
    if meta.prefills:
        cu_seqlens_k = F.pad(meta.prefill_context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        out[nd:] = flash_attn_varlen_func(
            q[nd:],
            k_cache,
            v_cache,
            cu_seqlens_q=meta.prefill_query_starts - nd,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_prefill_query_len,
            max_seqlen_k=max(c.context_len for c in meta.prefills),
            softmax_scale=scale,
            causal=True,
            block_table=meta.prefill_block_tables,
        )
    return out.unsqueeze(0), None  # transformers expects [B, T, H, D]
