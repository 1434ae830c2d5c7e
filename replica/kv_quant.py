"""An 8-bit KV cache (`kv_cache_dtype`, vLLM's argument): K and V are stored as fp8, each
layer's keys and values divided by a scale of their own on the way in and multiplied by
it on the way out, so pages hold twice the tokens of bf16 in the same bytes.

Every backend stores and reads the same bytes: an element is `x / scale`, clamped to the
format's largest finite value (saturation: a value past the calibrated range keeps its
sign and becomes the largest, not inf or NaN) and rounded to nearest even. This module is
the reference the kernels are tested against.
"""

from dataclasses import dataclass

import torch

from replica.config import KV_CACHE_DTYPES

# fp8 is e4m3, as in vLLM.
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_DTYPES = {**_FP8, "bfloat16": torch.bfloat16}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


@dataclass(frozen=True)
class KVScale:
    """One layer's scales: the cache holds key / k and value / v."""

    k: float = 1.0
    v: float = 1.0


UNIT_SCALE = KVScale()


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: unchanged in dtype for a float cache, else x / scale,
    saturated and rounded to nearest even."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = FP8_MAX[dtype]
    # A tensor divisor: CUDA divides by a Python float as a multiply by its reciprocal,
    # which rounds differently from the division every kernel does.
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements back in the compute dtype."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def as_cached(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in its own dtype as a cache of cache_dtype gives it back: what a fresh prompt's
    attention reads, as every later step does (x itself where the dtypes are the same)."""
    return dequantize_kv(quantize_kv(x, scale, cache_dtype), scale, x.dtype)
