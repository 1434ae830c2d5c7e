"""Reference paged attention in plain torch: any device, the CPU default, and the oracle
the other backends are tested against.

A layer's cache is a pair of [num_blocks, Hkv, block_size, D] tensors. Head-major blocks
let decode attention run block by block on contiguous gathered memory: scores per block
with one batched matmul, one softmax across all of a sequence's blocks, and a weighted
sum back, with no permuted copy of K/V as SDPA's layout would need. An fp8 cache is
written and read through replica/kv_quant.py, dequantized to the query's dtype as it is
gathered.
"""

import torch
import torch.nn.functional as F

from replica.attention.context import get_forward_context
from replica.kv_quant import UNIT_SCALE, KVScale, as_cached, dequantize_kv, quantize_kv


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, num_kv_heads, block_size, head_dim)


def torch_paged_attention(
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
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kv_scale = ctx.kv_scale(module.layer_idx)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kv_scale)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5

    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale, kv_scale
        )
    for chunk in meta.prefills:
        if chunk.block_table is None:
            keys = as_cached(k[chunk.start : chunk.end], kv_scale.k, k_cache.dtype).transpose(0, 1)
            values = as_cached(v[chunk.start : chunk.end], kv_scale.v, v_cache.dtype).transpose(0, 1)
        else:
            keys = dequantize_kv(
                gather_context(k_cache, chunk.block_table, chunk.context_len), kv_scale.k, q.dtype
            )
            values = dequantize_kv(
                gather_context(v_cache, chunk.block_table, chunk.context_len), kv_scale.v, q.dtype
            )
        out[chunk.start : chunk.end] = prefill_attention(q[chunk.start : chunk.end], keys, values, scale)
    return out.unsqueeze(0), None  # transformers expects [B, T, H, D]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = quantize_kv(k, kv_scale.k, k_cache.dtype)
    v_cache[blocks, :, offsets] = quantize_kv(v, kv_scale.v, v_cache.dtype)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., n] block ids -> [..., n, Hkv, block_size, D]."""
    # index_select over flat rows copies whole blocks at once, unlike element-wise fancy indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, block_table.flatten())
    return rows.view(*block_table.shape, *cache.shape[1:])


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first context_len keys or values as [Hkv, context_len, D]."""
    blocks = gather_blocks(cache, block_table)  # [n, Hkv, bs, D]
    return blocks.transpose(0, 1).flatten(1, 2)[:, :context_len]


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, n]
    mask: torch.Tensor,  # [B, 1, 1, n * block_size]
    scale: float,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    b, h, d = q.shape
    n = block_tables.shape[1]
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    g = h // hkv  # query heads per KV head (GQA)
    keys = dequantize_kv(gather_blocks(k_cache, block_tables), kv_scale.k, q.dtype)  # [B, n, Hkv, bs, D]
    values = dequantize_kv(gather_blocks(v_cache, block_tables), kv_scale.v, q.dtype)
    q = q.view(b, 1, hkv, g, d)
    scores = torch.matmul(q, keys.transpose(-1, -2))  # [B, n, Hkv, g, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(b, hkv, g, n * bs).float() * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(values.dtype)
    probs = probs.view(b, hkv, g, n, bs).permute(0, 3, 1, 2, 4)  # [B, n, Hkv, g, bs]
    out = torch.matmul(probs, values).sum(dim=1)  # [B, Hkv, g, D]
    return out.reshape(b, h, d)


def prefill_attention(
    q: torch.Tensor,  # [Tq, H, D], the last Tq positions of the context
    keys: torch.Tensor,  # [Hkv, Tk, D]
    values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    tq, tk = q.shape[0], keys.shape[1]
    q = q.transpose(0, 1)[None]
    keys, values = keys[None], values[None]
    if tq == tk:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(tk - tq, tk, device=q.device)[:, None]
        mask = torch.arange(tk, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
