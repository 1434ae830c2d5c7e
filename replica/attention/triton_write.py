"""Scatter this step's keys and values into the paged cache, one program per token.

The cache is [num_blocks, Hkv, block_size, D]; a token's slot is block * block_size + offset.
One launch per layer and step, all KV heads of a token in one program; k and v are read
through their strides, so transformers' [1, Hkv, T, D] views need no copy. A negative slot
means "padding, don't write" (for batches padded to a captured CUDA-graph size).

An fp8 cache (replica/kv_quant.py) reaches every kernel as its raw bytes, and the kernels
encode and decode fp8 with integer ops instead of Triton's fp8 casts: the interpreter's
fp32 -> fp8 cast rounds wrongly (ties away from zero, a mantissa carry lost, no
saturation, subnormals truncated), and compiled e4m3 casts need compute capability 8.9.
The same code then runs, and is tested, everywhere.
"""

import struct

import torch
import triton
import triton.language as tl

from replica.kv_quant import FP8_MAX, UNIT_SCALE, KVScale, is_fp8

# (mantissa bits, exponent bias) of each fp8 cache dtype.
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


def fp8_format(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, exponent bias) for the kernels' FP8_MANT / FP8_BIAS; (0, 0): not fp8."""
    return _FP8_FORMATS[dtype] if is_fp8(dtype) else (0, 0)


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels are handed: an fp8 cache's bytes, any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def read_scales(dtype: torch.dtype, kv_scale: KVScale) -> tuple[float, float]:
    """What the attention kernels multiply scores and outputs by, for keys and values: an fp8
    page decodes (fp8_to_fp16) to value * 2**(bias - 15) / scale, a float page to itself."""
    if not is_fp8(dtype):
        return 1.0, 1.0
    factor = 2.0 ** (15 - fp8_format(dtype)[1])
    return kv_scale.k * factor, kv_scale.v * factor


@triton.jit
def fp8_to_fp16(byte, FP8_MANT: tl.constexpr):
    """fp8 bytes -> fp16 holding value * 2**(bias - 15), exactly, subnormals included: the
    sign, exponent and mantissa fields move up into fp16's, whose bias (15) is at least the
    fp8 one. e5m2 is fp16's top byte; e4m3's NaN encoding decodes as a finite number, which
    the writer never stores from finite input."""
    b = byte.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << (10 - FP8_MANT))
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def quantize_fp8(x, scale, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX_BITS: tl.constexpr):
    """x / scale as fp8 bytes, as replica/kv_quant.quantize_kv: IEEE division (Triton's plain
    `/` is approximate), clamped to +-max, rounded to nearest even; NaN is 0x7F with x's
    sign (the GPU's division drops a NaN's sign)."""
    x = x.to(tl.float32)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    mag = tl.math.div_rn(x, scale).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nan = mag > 0x7F800000
    mag = tl.minimum(mag, FP8_MAX_BITS)  # positive floats order as their bits do
    # Normal: round the mantissa to FP8_MANT bits (a carry moves into the exponent, as it
    # should), then rebias the exponent.
    shift: tl.constexpr = 23 - FP8_MANT
    rounded = mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)
    normal = (rounded - ((127 - FP8_BIAS) << 23)) >> shift
    # Subnormal: adding 2**(24 - bias - mant), whose fp32 ulp is the fp8 subnormal step,
    # rounds to nearest even in the float add and leaves the step count in the low bits.
    magic_bits: tl.constexpr = (24 - FP8_BIAS - FP8_MANT + 127) << 23
    magic = tl.full(x.shape, magic_bits, tl.int32).to(tl.float32, bitcast=True)
    subnormal = (mag.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - magic_bits
    out = tl.where(mag < ((1 - FP8_BIAS + 127) << 23), subnormal, normal)
    out = tl.where(nan, 0x7F, out) | sign
    return out.to(tl.uint8)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,  # an fp8 cache holds k / k_scale, v / v_scale
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_ct,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MANT: tl.constexpr,  # 0: the cache is in a float dtype, stored by a plain cast
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    dst = block * stride_cb + heads[:, None] * stride_ch + offset * stride_ct + dims[None, :]

    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    if FP8_MANT > 0:
        k = quantize_fp8(k, k_scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8_MANT > 0:
        v = quantize_fp8(v, v_scale, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D], any strides with a contiguous last dim
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    mant, bias = fp8_format(k_cache.dtype)
    max_bits = struct.unpack("<i", struct.pack("<f", FP8_MAX[k_cache.dtype]))[0] if mant else 0
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kernel_view(k_cache),
        kernel_view(v_cache),
        slot_mapping,
        kv_scale.k,
        kv_scale.v,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[2],
        FP8_MANT=mant,
        FP8_BIAS=bias,
        FP8_MAX_BITS=max_bits,
    )
