"""Products with group-quantized weights on GPUs (a GGUF file's blocks, GPTQ, AWQ and
compressed-tensors W4A16): the candidates group_linear.py measures per row count.

- `group_gemm`: kvserve's Triton kernel. It reads the integers as replica/cpu/group_quant.py
  lays them out (4 bits: each 32-block's byte i holds q[i] low and q[i + 16] high; 8 bits:
  int8), dequantizes each tile in registers (w = scale * q + min, in fp32, rounded once to
  x's dtype) and multiplies it with tl.dot, fp32 sums. A decode step reads a quarter of
  bf16's bytes; no dense copy exists at any time.
- `mm_dequantized`: the weight dequantized into x's dtype for the call, then F.linear
  (cuBLAS): for prefills, where the GEMM's arithmetic dwarfs the dequantization.
- `mm_tinygemm`: torch's own int4 GEMM (`_weight_int4pack_mm`, "tinygemm"), the library's
  candidate, for 4-bit weights in its group sizes, bf16, on CUDA. It takes w = (q - 8) *
  scale + zero, so zero = min + 8 * scale.
"""

import os

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from replica.cpu.group_quant import TORCH_INT4_GROUPS, GroupQuantWeight

# The interpreter multiplies bf16 tiles wrongly; in fp32 the products of the same bf16
# values are exact, so its sums differ from a bf16 dot's only in order.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _group_gemm_kernel(
    x_ptr,
    qs_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        if BITS == 4:
            byte = (ks // 32) * 16 + ks % 16
            raw = tl.load(qs_ptr + cols[:, None] * (K // 2) + byte[None, :], mask=w_mask, other=0)
            q = ((raw.to(tl.int32) >> (((ks % 32) // 16) * 4)[None, :]) & 0xF).to(tl.float32)
        else:
            q = tl.load(qs_ptr + cols[:, None] * K + ks[None, :], mask=w_mask, other=0).to(tl.float32)
        at = cols[:, None] * groups + (ks // GROUP)[None, :]
        w = q * tl.load(scales_ptr + at, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_MINS:
            w += tl.load(mins_ptr + at, mask=w_mask, other=0.0).to(tl.float32)
        w = w.to(x_ptr.dtype.element_ty)  # rounded as the dequantized weight would be
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def group_gemm(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] times w [n, k] transposed, plus bias: [rows, n] in x's dtype."""
    x = x.contiguous()
    rows, k = x.shape
    n = w.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    # A decode's few rows take narrow column tiles, so that a layer's columns spread over
    # every SM; a prefill's take wide ones, which reuse each dequantized tile across rows.
    block_m = 16 if rows <= 16 else 64
    block_n = 32 if rows <= 16 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _group_gemm_kernel[grid](
        x, w.qs, w.scales, w.mins if w.mins is not None else w.scales, bias if bias is not None else y, y,
        rows, n, k, GROUP=w.group, BITS=w.bits, HAS_MINS=w.mins is not None, HAS_BIAS=bias is not None,
        FP32_DOT=x.dtype == torch.float32 or INTERPRETED, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32,
    )  # fmt: skip
    return y


def mm_dequantized(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference and the prefills' candidate: w dequantized into x's dtype, then F.linear."""
    return F.linear(x, w.dequantize(x.dtype), bias)


def tinygemm_runs(w: GroupQuantWeight, dtype: torch.dtype, device: torch.device) -> bool:
    """torch's int4 GEMM takes 4-bit weights with mins in its group sizes, bf16, on CUDA,
    n in eights and k in whole 128-wide tiles."""
    n, k = w.shape
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and w.bits == 4
        and w.mins is not None
        and w.group in TORCH_INT4_GROUPS
        and n % 8 == 0
        and k % 128 == 0
    )


def pack_tinygemm(w: GroupQuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed integers, [k / group, n, 2] bf16 scales and zeros) for `mm_tinygemm`, on w's
    device: pairs of integers in a byte, first one high, as torch's packing takes them."""
    q = w.integers().to(torch.uint8)
    packed = torch._convert_weight_to_int4pack((q[:, 0::2] << 4) | q[:, 1::2], 8)
    scales = w.scales.float()
    zeros = w.mins.float() + 8 * scales
    return packed, torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()


def mm_tinygemm(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int, bias: torch.Tensor | None
) -> torch.Tensor:
    y = torch._weight_int4pack_mm(x.contiguous(), packed, group, scales_zeros)
    return y if bias is None else y + bias
