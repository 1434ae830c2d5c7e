"""The kernels that can multiply a linear layer on CPU, each with the weight layout it
reads: gemm.c's own kernels (bf16 on AVX512-BF16 CPUs, fp32 on AVX2 CPUs; both apply a
gated MLP projection's silu(gate) * up in their epilogue), oneDNN with the weight
reordered once into its blocked layout (what inductor's weight freezing does; AMX or
AVX512 underneath), and plain F.linear. With quantization="int8", also the two int8
kernels of int8.py, which quantize the weight as they lay it out; with a file's
group-quantized weights (quantization="gguf"), the kernels of group_quant.py, which read
its integers.
Which one runs at which row count is measured on the machine (kernel_choice.py)."""

import torch
from torch.nn import functional as F

from replica.cpu import group_quant, int8, ops
from replica.cpu.group_quant import GroupQuantWeight, TorchInt4Weight

GEMM_C, ONEDNN, TORCH = "gemm.c", "onednn", "torch"
INT8_GEMM_C, INT8_TORCH = "int8 gemm.c", "int8 torch"
# gemm_group.c's exact kernel, its int8-activation one (and that one's 256-bit twin on
# AVX-512 CPUs), torch's int4 kernel, and the weight dequantized at each call for F.linear.
GROUP_GEMM_C, GROUP_Q8_GEMM_C, GROUP_Q8_256_GEMM_C, GROUP_TORCH, GROUP_DEQUANT = (
    "group gemm.c",
    "group q8 gemm.c",
    "group q8 256-bit gemm.c",
    "group torch",
    "group dequant",
)
# group_linear's `kernel` argument (gemm_group.c) for each of gemm_group.c's kernels
GROUP_LINEAR_KERNEL = {GROUP_GEMM_C: 0, GROUP_Q8_GEMM_C: 1, GROUP_Q8_256_GEMM_C: 2}
LINEAR_KERNELS = (GEMM_C, ONEDNN, TORCH)
INT8_KERNELS = (INT8_GEMM_C, INT8_TORCH)
GROUP_GEMM_C_KERNELS = (GROUP_GEMM_C, GROUP_Q8_GEMM_C, GROUP_Q8_256_GEMM_C)
GROUP_KERNELS = (*GROUP_GEMM_C_KERNELS, GROUP_TORCH, GROUP_DEQUANT)
# The kernels whose threads take panels as they come free, so that a thread whose core is
# taken for a moment holds up only its own panels: in an fp32 model gemm.c's fp32 kernel
# and gemm_int8.c, and in any model gemm_group.c's (each thread streams its own share of
# the columns and then takes what is left at the back of the others'). oneDNN and torch
# give each thread a fixed share; so does gemm.c's bf16 kernel (a thread's panels stay in
# its cache between row chunks).
FP32_SHARING_KERNELS = (GEMM_C, INT8_GEMM_C)
GROUP_SHARING_KERNELS = GROUP_GEMM_C_KERNELS
Weight = torch.Tensor | int8.Int8Weight | GroupQuantWeight | TorchInt4Weight


def can_run(
    kernel: str, dtype: torch.dtype, in_features: int, quantization: str | None = None, out_features: int = 0
) -> bool:
    """quantization: a group-quantized weight's format (group_quant.py), for the group
    kernels, with its out_features."""
    if kernel in GROUP_GEMM_C_KERNELS:
        # The int8-activation kernels round x to 8 bits a 32-block, which a bf16 model's
        # activations already are to 8 significant bits; an fp32 model gets the exact one.
        exact = kernel == GROUP_GEMM_C or dtype == torch.bfloat16
        if kernel == GROUP_Q8_256_GEMM_C:
            fits = quantization is not None and group_quant.q8_256_kernel_runs(quantization, in_features)
        else:
            fits = kernel == GROUP_GEMM_C or quantization is None or group_quant.q8_kernel_runs(quantization)
        return fits and exact and in_features % 32 == 0 and group_quant.group_gemm_available()
    if kernel == GROUP_TORCH:
        return quantization is not None and group_quant.torch_int4_runs(quantization, out_features)
    if kernel == GROUP_DEQUANT:
        return group_quant.group_gemm_available()
    if kernel == INT8_GEMM_C:
        return dtype == torch.float32 and int8.i8_gemm_available()
    if kernel == INT8_TORCH:
        return True
    if kernel == GEMM_C:
        if dtype == torch.float32:
            return ops.f32_gemm_available()
        return dtype == torch.bfloat16 and in_features % 2 == 0 and ops.bf16_gemm_available()
    if kernel == ONEDNN:
        # oneDNN reorders bf16 weights only on CPUs with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT.
        return dtype == torch.float32 or (
            dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    return kernel == TORCH


def pack(
    kernel: str,
    weight: torch.Tensor | GroupQuantWeight,
    bias: torch.Tensor | None,
    gated: bool,
    scale: torch.Tensor | None = None,
) -> tuple[Weight, torch.Tensor | None]:
    """(weight, bias) laid out for `kernel`. gated: the rows are the gate's, then the up
    projection's. scale: per-row scales an int8 kernel quantizes with (a pre-quantized
    checkpoint's; None: its own). A group kernel takes a GroupQuantWeight, which its own
    kernels read as it is (the same object: one copy in memory)."""
    bias = None if bias is None else bias.detach().contiguous()
    if kernel == GROUP_TORCH:
        return group_quant.pack_for_torch_int4(weight), bias
    if kernel in GROUP_KERNELS:
        return weight, bias
    weight = weight.detach()
    if kernel == INT8_GEMM_C:
        if gated and bias is not None:
            bias = ops.interleave_gate_up(*bias.chunk(2), 8)
        return int8.pack_for_gemm_i8(weight, gated, scale), bias
    if kernel == INT8_TORCH:
        return int8.pack_for_torch(weight, scale), bias
    if kernel == GEMM_C:
        fp32 = weight.dtype == torch.float32
        if gated:  # gemm.c's panels pair each 16 (bf16) or 8 (fp32) gate rows with their up rows
            group = 8 if fp32 else 16
            weight = ops.interleave_gate_up(*weight.chunk(2), group)
            bias = None if bias is None else ops.interleave_gate_up(*bias.chunk(2), group)
        return (ops.pack_f32_weight(weight) if fp32 else ops.pack_bf16_weight(weight)), bias
    if kernel == ONEDNN:
        # The reorder takes a batch-size hint; decode batches are what runs most often.
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64), bias
    return weight.contiguous(), bias


def run(
    kernel: str,
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    out_features: int,
    gated: bool,
) -> torch.Tensor:
    """x [rows, in] -> [rows, out_features]; for a gated weight, silu(gate) * up."""
    if kernel in GROUP_GEMM_C_KERNELS:
        y = group_quant.gemm_group(x, weight, bias, kernel != GROUP_GEMM_C, kernel == GROUP_Q8_256_GEMM_C)
    elif kernel == GROUP_TORCH:
        y = group_quant.mm_torch_int4(x, weight, bias)
    elif kernel == GROUP_DEQUANT:
        y = group_quant.mm_dequantized(x, weight, bias)
    elif kernel == INT8_GEMM_C:
        return int8.gemm_i8(x, weight, bias, out_features, gated)
    elif kernel == INT8_TORCH:
        y = int8.mm_torch(x, weight, bias)
    elif kernel == GEMM_C and x.dtype == torch.float32:
        return ops.gemm_f32(x, weight, bias, out_features, gated)
    elif kernel == GEMM_C:
        return ops.gemm_bf16(x, weight, bias, out_features, gated)
    elif kernel == ONEDNN:
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    else:
        y = F.linear(x, weight, bias)
    return ops.silu_mul(y) if gated else y
