"""Punica-style BGMV for a batch that mixes LoRA adapters: each token gathers its own
slot's A and B, so one launch serves every adapter and no token pays for another's.

Two kernels, as Punica splits it, because the two halves have opposite shapes:
- shrink, h[t] = x[t] @ A[slot].T: a long reduction over `in` down to a few P*R outputs,
  kept in fp32 (h is tiny, and rounding it to bf16 would cost accuracy for nothing);
- expand, delta[t] = h[t] @ B[slot]: a short reduction over P*R up to a wide `out`,
  tiled over output columns so a wide projection fills the GPU even at batch 1.
Both grids are (token, output tile). A base-model token (slot -1) does no work in the
shrink and stores zeros in the expand, so the result needs no zero-initialised buffer
and its base rows are exactly zero, as in lora_delta_torch.

The products are elementwise multiplies and tl.sum, not tl.dot: a row at a time is a
matrix-vector product (tl.dot would need 16 rows, and each token's rows are its own
slot's), it keeps fp32 in IEEE fp32 instead of TF32, and it runs the same under
TRITON_INTERPRET=1, whose tl.dot mishandles bf16. Nothing reads a device value on the
host, so the launch can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

SHRINK_BLOCK_N = 16  # rows of A (h's columns) per program
SHRINK_BLOCK_K = 128  # of `in` per loop step
EXPAND_BLOCK_R = 16  # of P*R per loop step
EXPAND_BLOCK_N = 128  # output columns per program


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [S, P*R, in]
    h_ptr,  # [T, P*R] fp32
    slots_ptr,  # [T]
    in_features,
    width,  # P*R
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return  # the base model's row: the expand kernel writes its zeros, h is not read

    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < width
    x_row = x_ptr + token.to(tl.int64) * stride_xt
    a_rows = a_ptr + slot * stride_as + rows[:, None] * stride_ar
    # Partial sums stay 2-D until the end: one cross-lane reduction per program, not per step.
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, in_features, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_mask = cols < in_features
        x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x[None, :]
    tl.store(h_ptr + token.to(tl.int64) * stride_ht + rows, tl.sum(acc, 1), mask=row_mask)


@triton.jit
def _expand_kernel(
    h_ptr,  # [T, P*R] fp32
    b_ptr,  # [S, P*R, out]
    out_ptr,  # [T, out], x's dtype
    slots_ptr,  # [T]
    width,  # P*R
    out_features,
    stride_ht,
    stride_bs,
    stride_br,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)

    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    if slot >= 0:  # else the base model's row: zeros
        h_row = h_ptr + token.to(tl.int64) * stride_ht
        b_cols = b_ptr + slot * stride_bs + cols[None, :]
        for r in range(0, width, BLOCK_R):
            ranks = r + tl.arange(0, BLOCK_R)
            rank_mask = ranks < width
            h = tl.load(h_row + ranks, mask=rank_mask, other=0.0)
            b = tl.load(
                b_cols + ranks[:, None] * stride_br, mask=rank_mask[:, None] & col_mask[None, :], other=0.0
            )
            acc += h[:, None] * b.to(tl.float32)
    out = out_ptr + token.to(tl.int64) * stride_ot + cols
    tl.store(out, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=col_mask)


def lora_delta_triton(
    x: torch.Tensor,  # [T, in]; rows may be strided
    a: torch.Tensor,  # [S, P*R, in]
    b: torch.Tensor,  # [S, P*R, out]
    token_slots: torch.Tensor,  # [T] int32 or int64, -1 for the base model
) -> torch.Tensor:
    """lora_delta_torch's result, [T, out] in x's dtype, from each token's own slot only."""
    tokens, in_features = x.shape
    slots, width, a_in = a.shape
    out_features = b.shape[2]
    assert a_in == in_features and b.shape[:2] == (slots, width), (x.shape, a.shape, b.shape)
    assert token_slots.shape == (tokens,) and not token_slots.dtype.is_floating_point
    # The kernels index the innermost dimension unstrided; a dimension of size 1 may have
    # any stride (a graph's one-row slot column is a view with its row's stride).
    for tensor in (x, a, b, token_slots):
        assert tensor.shape[-1] <= 1 or tensor.stride(-1) == 1, (tensor.shape, tensor.stride())
    out = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    if tokens == 0 or out_features == 0:
        return out
    h = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    if width > 0:
        _shrink_kernel[(tokens, triton.cdiv(width, SHRINK_BLOCK_N))](
            x,
            a,
            h,
            token_slots,
            in_features,
            width,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            h.stride(0),
            BLOCK_N=SHRINK_BLOCK_N,
            BLOCK_K=SHRINK_BLOCK_K,
            num_warps=4,
        )
    _expand_kernel[(tokens, triton.cdiv(out_features, EXPAND_BLOCK_N))](
        h,
        b,
        out,
        token_slots,
        width,
        out_features,
        h.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_R=EXPAND_BLOCK_R,
        BLOCK_N=EXPAND_BLOCK_N,
        num_warps=4,
    )
    return out
