"""int8 weights on CPU (quantization="int8"): each linear's weight quantized at load,
symmetric, one fp32 scale per output row, and two kernels that multiply it:

- gemm_int8.c's kernel (AVX2): activations quantized per row at each call, symmetric
  and dynamic, to as many bits (up to 13) as its int32 sums hold (activation_limit);
- torch's _weight_int8pack_mm: activations kept in the model's dtype.

kernel_choice.py times both (and the unquantized kernels) on the machine."""

from dataclasses import dataclass

import torch

from replica.cpu import ops
from replica.cpu.build import load_library

PANEL = 16  # gemm_i8's output rows per panel; its scales are read in whole panels


@dataclass
class Int8Weight:
    """A linear's int8 weight [n, k] (laid out for one kernel) and its per-row scales [n]
    (zero-padded to whole panels for gemm_i8)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale))


def quantize_per_row(
    weight: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (int8 [n, k], fp32 scale [n]) with weight ~ scale[:, None] * q:
    symmetric, the row's largest |w| at 127 (an all-zero row gets scale 0), or with the
    given scales (a pre-quantized checkpoint's, whose weights may hold -128)."""
    w = weight.detach().float()
    if scale is None:
        scale = w.abs().amax(dim=1) / 127
    scale = scale.float()
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp(-128, 127).to(torch.int8), scale


def i8_gemm_available() -> bool:
    """gemm_int8.c's kernel needs AVX2 and FMA, and is compiled for this CPU."""
    return bool(load_library().i8_gemm_available())


def activation_limit(k: int) -> int:
    """The largest |quantized activation| gemm_i8 gives a row of k inputs."""
    return load_library().activation_limit(k)


def pack_for_gemm_i8(weight: torch.Tensor, gated: bool, scale: torch.Tensor | None = None) -> Int8Weight:
    """A float weight [n, k] quantized (with `scale`, if given) and packed for gemm_i8
    (gated: gate rows, then up rows, interleaved by 8 as its gated panels read them)."""
    q, scale = quantize_per_row(weight, scale)
    if gated:
        q, scale = (ops.interleave_gate_up(*t.chunk(2), 8) for t in (q, scale))
    n, k = q.shape
    lib = load_library()
    packed = torch.empty(lib.packed_i8_weight_bytes(n, k), dtype=torch.int8)
    lib.pack_i8_weight(packed.data_ptr(), q.contiguous().data_ptr(), n, k)
    padded = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
    padded[:n] = scale
    return Int8Weight(packed, padded)


def gemm_i8(
    x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None, n: int, gated: bool = False
) -> torch.Tensor:
    """x [rows, k] fp32, quantized per row to activation_limit(k), times w
    (pack_for_gemm_i8's), plus bias:
    [rows, n] fp32. gated: silu(gate) * up."""
    if x.dtype != torch.float32:
        raise ValueError("gemm_i8 takes fp32 activations")
    x = x.contiguous()
    rows, k = x.shape
    out = x.new_empty((rows, n))
    load_library().gemm_i8(
        out.data_ptr(), x.data_ptr(), w.weight.data_ptr(), w.scale.data_ptr(),
        None if bias is None else bias.data_ptr(), rows, n, k, int(gated), torch.get_num_threads(),
    )  # fmt: skip
    return out


def pack_for_torch(weight: torch.Tensor, scale: torch.Tensor | None = None) -> Int8Weight:
    q, scale = quantize_per_row(weight, scale)
    return Int8Weight(q.contiguous(), scale)


def mm_torch(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, k] in the model's dtype times w (pack_for_torch's), dequantized by torch's
    _weight_int8pack_mm (which takes scales in x's dtype)."""
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), w.weight, w.scale.to(x.dtype))
    return y if bias is None else y + bias
