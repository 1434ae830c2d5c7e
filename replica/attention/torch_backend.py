"""Reference paged attention in plain torch: any device, the CPU default, and the oracle
the other backends are tested against."""

import torch
import torch.nn.functional as F

from replica.attention.context import get_forward_context


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
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta.decode_slots, meta.decode_mask, scaling)
    for chunk in meta.prefills:
        if chunk.context_slots is None:
            keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:
            keys, values = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
        out[chunk.start : chunk.end] = prefill_attention(q[chunk.start : chunk.end], keys, values, scaling)
    return out.unsqueeze(0), None  # transformers expects [B, T, H, D]


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B, L]
    mask: torch.Tensor,  # [B, 1, 1, L]
    scaling: float | None,
) -> torch.Tensor:
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    # Query heads sharing a KV head become that head's "query length": GQA without copying K/V.
    q = q.view(b, hkv, h // hkv, d)
    keys = k_cache[slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    values = v_cache[slots].permute(0, 2, 1, 3)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, d)


def prefill_attention(
    q: torch.Tensor,  # [Tq, H, D], the last Tq positions of the context
    keys: torch.Tensor,  # [Tk, Hkv, D]
    values: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    tq, tk = q.shape[0], keys.shape[0]
    q, keys, values = (x.transpose(0, 1)[None] for x in (q, keys, values))
    if tq == tk:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        rows = torch.arange(tk - tq, tk, device=q.device)[:, None]
        mask = torch.arange(tk, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)
