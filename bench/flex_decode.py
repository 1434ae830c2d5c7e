"""FlexAttention (torch.nn.attention.flex_attention) as a library candidate for paged
decode attention, on kvserve's own cache with no copy: bench.gpu times it, compiled,
against the Triton decode kernel (replica/attention/triton_decode.py) at several shapes,
so that a GPU draw says whether it should run anywhere.

The cache is [num_blocks, Hkv, block_size, D]. Viewed as one head of num_blocks * Hkv
pages of block_size tokens, page block * Hkv + h holds kv head h of that block; each query
head's block mask lists the pages of its own kv head in its sequence's block table
(torch's PagedAttention does the same with a page table), and the mask_mod keeps a
sequence's positions below its context length and a query head on its own kv head's pages.
"""

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def paged_block_mask(
    block_tables: torch.Tensor,  # [B, W]
    context_lens: torch.Tensor,  # [B]
    num_blocks: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
) -> BlockMask:
    """The mask of decode rows (one query token each) over the cache's pages."""
    batch, width = block_tables.shape
    device = block_tables.device
    group = num_heads // num_kv_heads
    used = -(-context_lens.long() // block_size)  # [B] blocks each sequence reads
    columns = torch.arange(width, device=device)
    in_use = columns[None, :] < used[:, None]
    # logical[b, block]: the block's place in sequence b's table, -1 where it has none.
    tables = torch.where(in_use, block_tables.long(), num_blocks)
    logical = torch.full((batch, num_blocks + 1), -1, dtype=torch.long, device=device)
    logical.scatter_(1, tables, columns.expand(batch, width).clone())
    logical = logical[:, :num_blocks]
    heads = torch.arange(num_heads, device=device) // group
    kv_indices = (block_tables.long()[:, None, None, :] * num_kv_heads + heads[None, :, None, None]).int()
    kv_num_blocks = used.int()[:, None, None].expand(batch, num_heads, 1).contiguous()
    lens = context_lens.long()

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // block_size
        block = page // num_kv_heads
        place = logical[b, block]
        position = place * block_size + kv_idx % block_size
        return (page % num_kv_heads == h // group) & (place >= 0) & (position < lens[b])

    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(1, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * num_kv_heads * block_size),
        compute_q_blocks=False,  # the transposed mask serves backward passes only
    )


def flex_paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    flex: Callable = flex_attention,
    kernel_options: dict | None = None,
) -> torch.Tensor:
    """paged_decode's result through FlexAttention (`flex`: flex_attention, or compiled;
    kernel_options: its tile sizes, where the defaults do not fit the page size)."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    pages = (1, 1, num_blocks * num_kv_heads * block_size, head_dim)
    out = flex(
        q.unsqueeze(2), k_cache.view(pages), v_cache.view(pages), block_mask=block_mask, scale=scale,
        enable_gqa=True, kernel_options=kernel_options,
    )  # fmt: skip
    return out.squeeze(2)
