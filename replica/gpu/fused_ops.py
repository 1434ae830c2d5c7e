"""The GPU decoder's element-wise work in one Triton launch each, where transformers' modules
take several torch ops: the skip connection with the next RMSNorm, SiLU(gate) * up, and
rotary with the KV-cache write. Each has its torch reference beside it (the same math as
transformers' modules, op by op), which the tests hold the kernel to and which runs where
Triton does not.

Rounding follows transformers' modules in the model's dtype: the residual sum and the
normalised row round to the dtype before the weight multiplies them, and SiLU's output
rounds before the product. Rotary computes each rotated element in float32 and rounds once,
where transformers rounds its two products and their sum: within the dtype's rounding.
"""

import struct

import torch
import triton
import triton.language as tl

from replica.attention.triton_write import fp8_format, kernel_view, quantize_fp8, write_kv_triton
from replica.kv_quant import FP8_MAX, UNIT_SCALE, KVScale


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    N,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (
            x.to(tl.float32) + tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        ).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * N + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [T, N]; with `residual`: residual += x in place first, then the norm of
    the sum, as replica/cpu/ops.rms_norm does on CPU."""
    x = x.contiguous()
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
        raise ValueError("residual must be contiguous and shaped like x")
    out = torch.empty_like(x)
    rows, n = x.shape
    if rows:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, eps, n, BLOCK=block,
            HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out


def add_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' `residual + x`, then LlamaRMSNorm, op by op."""
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_up_ptr + row * 2 * N + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * N + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [T, 2n] (gate first) -> [T, n]."""
    gate_up = gate_up.contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, n))
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _head_norm(
    lo, hi, weight_ptr, dims, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr
):
    """A token's heads as their halves lo, hi [heads, BLOCK_HALF] float32: Qwen3's RMSNorm
    over each head, rounded to the dtype of its weight (the model's) as its module rounds,
    or lo, hi as they are."""
    DTYPE = weight_ptr.dtype.element_ty
    if HAS_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / HEAD_DIM + eps)
        w_lo = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w_hi = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        lo = (w_lo[None, :] * (lo * inv[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        hi = (w_hi[None, :] * (hi * inv[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return lo, hi


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    k_scale,
    v_scale,
    stride_t,  # qkv's row stride
    stride_cos,
    stride_cb,
    stride_ch,
    stride_ct,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
):
    """One program per token: its query heads rotated into q_out [T, H, D]; its key heads
    rotated and its value heads as they are, into the cache at the token's slot (none where
    the slot is negative: a padded row of a graph batch). Rotary pairs each head's first
    half with its second: (lo, hi) -> (lo cos - hi sin, hi cos + lo sin)."""
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, BLOCK_HALF)
    in_half = dims < HALF
    cos_lo = tl.load(cos_ptr + token * stride_cos + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + token * stride_cos + HALF + dims, mask=in_half, other=0.0).to(tl.float32)[
        None, :
    ]
    sin_lo = tl.load(sin_ptr + token * stride_cos + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + token * stride_cos + HALF + dims, mask=in_half, other=0.0).to(tl.float32)[
        None, :
    ]
    dtype = q_out_ptr.dtype.element_ty
    row = qkv_ptr + token * stride_t

    heads = tl.arange(0, BLOCK_H)
    offsets = heads[:, None] * HEAD_DIM + dims[None, :]
    mask = (heads[:, None] < NUM_HEADS) & in_half[None, :]
    lo = tl.load(row + offsets, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(row + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    lo, hi = _head_norm(lo, hi, q_norm_ptr, dims, eps, HEAD_DIM, HALF, HAS_NORM)
    out = q_out_ptr + token * NUM_HEADS * HEAD_DIM + offsets
    tl.store(out, (lo * cos_lo - hi * sin_lo).to(dtype), mask=mask)
    tl.store(out + HALF, (hi * cos_hi + lo * sin_hi).to(dtype), mask=mask)

    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kv_heads = tl.arange(0, BLOCK_KV)
        kv_offsets = kv_heads[:, None] * HEAD_DIM + dims[None, :]
        kv_mask = (kv_heads[:, None] < NUM_KV_HEADS) & in_half[None, :]
        dst = block * stride_cb + kv_heads[:, None] * stride_ch + offset * stride_ct + dims[None, :]
        k_row = row + NUM_HEADS * HEAD_DIM
        lo = tl.load(k_row + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        hi = tl.load(k_row + kv_offsets + HALF, mask=kv_mask, other=0.0).to(tl.float32)
        lo, hi = _head_norm(lo, hi, k_norm_ptr, dims, eps, HEAD_DIM, HALF, HAS_NORM)
        k_lo = (lo * cos_lo - hi * sin_lo).to(dtype)
        k_hi = (hi * cos_hi + lo * sin_hi).to(dtype)
        v_row = k_row + NUM_KV_HEADS * HEAD_DIM
        v_lo = tl.load(v_row + kv_offsets, mask=kv_mask, other=0.0)
        v_hi = tl.load(v_row + kv_offsets + HALF, mask=kv_mask, other=0.0)
        if FP8_MANT > 0:
            k_lo = quantize_fp8(k_lo, k_scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
            k_hi = quantize_fp8(k_hi, k_scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
            v_lo = quantize_fp8(v_lo, v_scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
            v_hi = quantize_fp8(v_hi, v_scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
        cache_ty = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, k_lo.to(cache_ty), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, k_hi.to(cache_ty), mask=kv_mask)
        tl.store(v_cache_ptr + dst, v_lo.to(cache_ty), mask=kv_mask)
        tl.store(v_cache_ptr + dst + HALF, v_hi.to(cache_ty), mask=kv_mask)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]: q, k, v side by side, as the packed GEMM gives them
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    num_heads: int,
    num_kv_heads: int,
    kv_scale: KVScale = UNIT_SCALE,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotary on q and k, k and v written into the cache; returns q [T, H, D]. norms: Qwen3's
    per-head (q weight, k weight, eps), applied before rotary."""
    num_tokens = qkv.shape[0]
    head_dim = cos.shape[-1]
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, not {head_dim}")
    q = qkv.new_empty((num_tokens, num_heads, head_dim))
    if not num_tokens:
        return q
    mant, bias = fp8_format(k_cache.dtype)
    max_bits = struct.unpack("<i", struct.pack("<f", FP8_MAX[k_cache.dtype]))[0] if mant else 0
    q_norm, k_norm, eps = norms if norms is not None else (cos, cos, 0.0)
    _rope_write_kv_kernel[(num_tokens,)](
        qkv, cos, sin, q, kernel_view(k_cache), kernel_view(v_cache), slot_mapping, q_norm, k_norm, eps,
        kv_scale.k, kv_scale.v, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=k_cache.shape[2], HAS_NORM=norms is not None,
        FP8_MANT=mant, FP8_BIAS=bias, FP8_MAX_BITS=max_bits,
    )  # fmt: skip
    return q


def rotary_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, norms=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' rotary (apply_rotary_pos_emb) on the packed q and k, after Qwen3's
    per-head norms: q, k, v [T, heads, D]."""
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    if norms is not None:
        q_w, k_w, eps = norms
        q, k = add_rms_norm_reference(q, q_w, eps), add_rms_norm_reference(k, k_w, eps)

    def rotate(x):
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    return rotate(q), rotate(k), v


def rope_write_kv_reference(
    qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, kv_scale=UNIT_SCALE, norms=None,
    rotary=rotary_reference,
) -> torch.Tensor:  # fmt: skip
    """rotary_reference (or `rotary`: the same, compiled), then the Triton backend's cache
    write, whose kernel stays out of any compiled region."""
    q, k, v = rotary(qkv, cos, sin, num_heads, num_kv_heads, norms)
    write_kv_triton(k_cache, v_cache, k, v, slot_mapping, kv_scale)
    return q.contiguous()
