"""The device and dtype an engine config names, resolved once for every rank: rank 0's
runner, the tensor-parallel workers and the code that places them all read these."""

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where it is fast (GPUs, and CPUs with AVX512-BF16 or AMX); else fp32,
    since a CPU without them emulates bf16 matmuls at 2-5x fp32's cost (AVX2 EPYC)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type != "cpu" or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return torch.bfloat16
    return torch.float32
