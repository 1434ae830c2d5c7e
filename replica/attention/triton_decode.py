"""Paged decode attention: one query token per sequence, K/V read through block tables.

FlashAttention's online softmax over key tiles, never a full score row in memory.
- GQA: one program serves every query head of a KV head group, so each K/V tile is
  loaded once per group instead of once per query head.
- Split-K: a decode batch is small (B * Hkv programs can leave most SMs idle), so each
  sequence's context is cut into `num_splits` ranges, each program writes a partial
  (normalised acc, log-sum-exp) and a second small kernel merges them.
- CUDA graphs: nothing here reads a device value on the host; the split count comes from
  shapes only, and each program finds its own range from the context length on device.
"""

import functools

import torch
import triton
import triton.language as tl

from replica.attention.triton_write import fp8_format, fp8_to_fp16, kernel_view, read_scales
from replica.kv_quant import UNIT_SCALE, KVScale

LOG2E = 1.4426950408889634
BLOCK_N = 32  # keys per tile; tl.dot needs at least 16
MIN_SPLIT_TOKENS = 256  # below this a split costs more in the merge than it saves
MAX_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,  # [B, H, D], written directly when NUM_SPLITS == 1
    part_acc_ptr,  # [B, H, NUM_SPLITS, D] fp32, normalised partial outputs
    part_lse_ptr,  # [B, H, NUM_SPLITS] fp32, log2-sum-exp2 of each split's scores
    qk_scale,  # softmax scale * log2(e), so exp2 replaces exp; an fp8 cache's key scale too
    v_scale,  # an fp8 cache's value scale, applied to the output
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_MANT: tl.constexpr,  # 0: a float cache; else the fp8 cache's mantissa bits
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    # Splits are whole tiles; trailing splits of a short sequence are empty.
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    head_mask = g < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        # Per-token gather: a tile may span several small cache blocks.
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + kv_head * stride_ch + (pos % BLOCK_SIZE) * stride_ct
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_MANT > 0:
            k = fp8_to_fp16(k, FP8_MANT)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_MANT > 0:
            v = fp8_to_fp16(v, FP8_MANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m = m_new

    # An empty split (or a zero-length padding row) leaves l_sum == 0 and m == -inf:
    # output zeros, lse -inf.
    l_sum = tl.where(l_sum > 0, l_sum, 1.0)
    acc = acc / l_sum[:, None]
    if FP8_MANT > 0:
        acc = acc * v_scale
    out_mask = head_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        tl.store(part_lse_ptr + row, m + tl.log2(l_sum), mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    dim_mask = dims < HEAD_DIM

    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + splits, mask=split_mask, other=float("-inf"))
    acc = tl.load(
        part_acc_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: weights 0, output 0
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter; any small number does


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, but no split shorter than MIN_SPLIT_TOKENS.
    From shapes only, so a captured CUDA graph keeps its split count."""
    by_length = triton.cdiv(max_tokens, MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(2 * _num_sms(device), batch * num_kv_heads)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, n], int32 or int64
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, H, D]; given, the result is written there
    kv_scale: KVScale = UNIT_SCALE,  # an fp8 cache's scales (replica/kv_quant.py)
    block_n: int = BLOCK_N,  # keys per tile, and warps per program: bench.gpu's tuning sweep
    num_warps: int = 4,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and block_tables.stride(-1) == 1
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)

    if num_splits == 1:
        part_acc = part_lse = out  # unused
    else:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    k_scale, v_scale = read_scales(k_cache.dtype, kv_scale)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        kernel_view(k_cache),
        kernel_view(v_cache),
        block_tables,
        context_lens,
        out,
        part_acc,
        part_lse,
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
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8_MANT=fp8_format(k_cache.dtype)[0],
        num_warps=num_warps,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_acc,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim > 64 else 2,
        )
    return out
