"""Paged prefill attention: variable-length query chunks, every key read through the block table.

A chunk's queries are the last q positions of its context (earlier keys come from prefix
hits or earlier chunks of a chunked prefill), so one kernel covers fresh prompts, prefix
hits and chunk continuations alike: causal masking is by absolute position.

Grid: (chunk, query tile, query head). Tiles past a chunk's end exit at once, so one launch
sized by the step's longest chunk serves every chunk. Each program runs FlashAttention's
online softmax over key tiles up to its last query's position, never a full score matrix.
"""

import torch
import triton
import triton.language as tl

from replica.attention.triton_write import fp8_format, fp8_to_fp16, kernel_view, read_scales
from replica.kv_quant import UNIT_SCALE, KVScale

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_starts_ptr,  # [P + 1] packed row of each chunk's first query
    context_lens_ptr,  # [P]
    block_tables_ptr,  # [P, n]
    qk_scale,  # softmax scale * log2(e), so exp2 replaces exp; an fp8 cache's key scale too
    v_scale,  # an fp8 cache's value scale, applied to the output
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_M: tl.constexpr,  # queries per tile
    BLOCK_N: tl.constexpr,  # keys per tile
    DOT_PRECISION: tl.constexpr,
    FP8_MANT: tl.constexpr,  # 0: a float cache; else the fp8 cache's mantissa bits
):
    chunk = tl.program_id(0)
    q_tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_starts_ptr + chunk)
    q_len = tl.load(query_starts_ptr + chunk + 1) - q_start
    if q_tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + chunk)

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = context_len - q_len + rows  # absolute position of each query
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=io_mask, other=0.0
    )

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + chunk * stride_bt
    # Causal: this tile's last query sees keys up to its own position, no further.
    kv_end = tl.minimum(context_len, context_len - q_len + (q_tile + 1) * BLOCK_M)
    for tile in range(0, kv_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        # Per-token gather: a tile may span several small cache blocks.
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_rows = block * stride_cb + kv_head * stride_ch + (pos % BLOCK_SIZE) * stride_ct
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_MANT > 0:
            k = fp8_to_fp16(k, FP8_MANT)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        # Key 0 is visible to every query, so no row is ever all -inf after the first tile.
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_MANT > 0:
            v = fp8_to_fp16(v, FP8_MANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m = m_new

    acc = acc / l_sum[:, None]
    if FP8_MANT > 0:
        acc = acc * v_scale
    out = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def _tile_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 64x64 tiles fit shared memory up to head_dim 128
    in 16-bit; fp32 and larger heads halve the key tile."""
    if head_dim <= 128 and dtype != torch.float32:
        return 64, 64, 4
    return 64, 32, 8 if head_dim > 128 else 4


def paged_prefill(
    q: torch.Tensor,  # [T, H, D] packed rows; only the prefill rows are read
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    query_starts: torch.Tensor,  # [P + 1] int32, absolute packed rows
    context_lens: torch.Tensor,  # [P] int32, tokens with KV after this step
    block_tables: torch.Tensor,  # [P, n] covering each whole context
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [T, H, D]; rows query_starts[0]..query_starts[-1] are written
    kv_scale: KVScale = UNIT_SCALE,  # an fp8 cache's scales (replica/kv_quant.py)
) -> None:
    num_chunks = context_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if num_chunks == 0 or max_query_len == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and block_tables.stride(-1) == 1
    block_m, block_n, num_warps = _tile_sizes(head_dim, q.dtype)
    grid = (num_chunks, triton.cdiv(max_query_len, block_m), num_heads)
    k_scale, v_scale = read_scales(k_cache.dtype, kv_scale)
    _prefill_kernel[grid](
        q,
        kernel_view(k_cache),
        kernel_view(v_cache),
        out,
        query_starts,
        context_lens,
        block_tables,
        scale * LOG2E * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_MANT=fp8_format(k_cache.dtype)[0],
        num_warps=num_warps,
        num_stages=2,
    )
