"""Group-quantized weights on CPU (quantization="gguf"): the 4- and 8-bit integers a
quantized file holds, kept as they are, with a scale and a min per group of weights, and
the kernels that multiply them.

One layout holds every format kvserve runs natively (replica/gguf_blocks.py repacks each
at load): w[j, i] = scale[j, g] * q[j, i] + min[j, g] for i in group g, scales and mins in
fp16. GGUF's Q4_0 and Q4_1 are this with groups of 32 (Q4_0's min is -8 * scale); its
K-quants are too, once their 6-bit sub-block scales are multiplied out (rounded to fp16:
at most 2^-11 of the scale, far under the 4-bit step); 5-, 6- and 8-bit formats hold
their integers in int8.

The kernels (kernel_choice.py times them on the machine, per row count):
- gemm_group.c's: sums q * x per group in fp32 and scales the sum, so the result is the
  dequantized weight's product up to summation order; x in fp32 (gemm_group) or rounded to
  int8 per 32-block (gemm_group_q8, and for 4-bit weights on AVX-512 CPUs also
  gemm_group_q8_256, its 256-bit twin: on some CPUs 512-bit vectors run as two halves);
- torch's int4 CPU kernel (_weight_int4pack_mm_for_cpu), for 4-bit weights: it takes
  w = (q - 8) * scale + zero, with scale and zero in x's dtype;
- the weight dequantized at each call into x's dtype, then F.linear (oneDNN or BLAS):
  for large prefills, where the GEMM's arithmetic dwarfs the dequantization. It holds no
  dense copy between calls, so memory stays that of the integers."""

import ctypes
import re
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from replica.cpu.abi import GroupWeight
from replica.cpu.build import load_library

TORCH_INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 kernel takes
_FORMAT = re.compile(r"q(\d+)g(\d+)(m?)")


@dataclass
class GroupQuantWeight:
    """A linear's weight [n, k]: qs holds the integers (bits 4: uint8 [n, k / 2], each
    32-block's byte i with q[i] low and q[i + 16] high, as GGUF's Q4_1; bits 8: int8
    [n, k]); scales and mins fp16 [n, k / group] (mins None: 0)."""

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group

    @property
    def format(self) -> str:
        """e.g. "q4g32m": bits, group size, and whether it has mins; kernel timings are
        kept per format."""
        return f"q{self.bits}g{self.group}{'m' if self.mins is not None else ''}"

    def struct(self) -> GroupWeight:
        """The weight's addresses and format as gemm_group.c's group_linear takes them
        (the tensors stay this object's)."""
        mins = None if self.mins is None else self.mins.data_ptr()
        return GroupWeight(self.qs.data_ptr(), self.scales.data_ptr(), mins, self.group, self.bits)

    def nbytes(self) -> int:
        tensors = [self.qs, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)

    def integers(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The integers of `rows` as int16 [rows, k]."""
        qs = self.qs[rows]
        if self.bits == 8:
            return qs.to(torch.int16)
        blocks = qs.view(qs.shape[0], -1, 16).to(torch.int16)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(qs.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | slice = slice(None)):
        """w[rows] in `dtype`, computed in fp32 (the reference the kernels are tested against)."""
        q = self.integers(rows).float().view(-1, self.shape[1] // self.group, self.group)
        w = q * self.scales[rows].float()[..., None]
        if self.mins is not None:
            w = w + self.mins[rows].float()[..., None]
        return w.reshape(-1, self.shape[1]).to(dtype)

    def widened(self, bits: int, group: int, mins: bool) -> "GroupQuantWeight":
        """The same weights in a format at least as wide (more bits, a group dividing this
        one's, mins if asked), exactly: to concatenate linears of mixed formats."""
        if bits < self.bits or self.group % group or (self.mins is not None and not mins):
            raise ValueError(f"{self.format} does not fit q{bits}g{group}{'m' if mins else ''}")
        repeat = self.group // group
        scales = self.scales.repeat_interleave(repeat, dim=1)
        zeros = torch.zeros_like(scales)
        lows = None if not mins else (zeros if self.mins is None else self.mins.repeat_interleave(repeat, 1))
        return from_integers(self.integers(), scales, lows, bits, group)

    @staticmethod
    def concat(weights: list["GroupQuantWeight"]) -> "GroupQuantWeight":
        """The weights' rows one after another (in the widest of their formats)."""
        bits = max(w.bits for w in weights)
        group = min(w.group for w in weights)
        if any(w.group % group for w in weights) or (bits == 4 and group % 32):
            raise ValueError(f"cannot concatenate formats {[w.format for w in weights]}")
        mins = any(w.mins is not None for w in weights)
        same = [
            w
            if (w.bits, w.group, w.mins is not None) == (bits, group, mins)
            else w.widened(bits, group, mins)
            for w in weights
        ]
        lows = torch.cat([w.mins for w in same]) if mins else None
        return GroupQuantWeight(
            torch.cat([w.qs for w in same]), torch.cat([w.scales for w in same]), lows, bits, group
        )


def from_integers(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, group: int
) -> GroupQuantWeight:
    """q [n, k] integers (0..15 for bits 4; int8's range for bits 8), scales and mins
    [n, k / group] in any float dtype -> the packed weight (scales and mins in fp16)."""
    n, k = q.shape
    if bits == 4:
        if k % 32 or group % 32:
            raise ValueError(
                f"4-bit weights need k and the group size to be multiples of 32, got {k}, {group}"
            )
        blocks = q.to(torch.uint8).view(n, k // 32, 2, 16)
        qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)
    elif bits == 8:
        if k % group or group % 8:
            raise ValueError(f"8-bit weights need groups of a multiple of 8 dividing k, got {group}, {k}")
        qs = q.to(torch.int8)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    half = lambda t: None if t is None else t.to(torch.float16).contiguous()  # noqa: E731
    return GroupQuantWeight(qs.contiguous(), half(scales), half(mins), bits, group)


def parse_format(fmt: str) -> tuple[int, int, bool]:
    """ "q4g32m" -> (4, 32, True)."""
    match = _FORMAT.fullmatch(fmt)
    if match is None:
        raise ValueError(f"not a group-quantized format: {fmt!r}")
    return int(match[1]), int(match[2]), bool(match[3])


def is_format(quantization: str | None) -> bool:
    return quantization is not None and _FORMAT.fullmatch(quantization) is not None


def quantize(weight: torch.Tensor, fmt: str) -> GroupQuantWeight:
    """A float weight in `fmt`, by each group's range (with mins) or its largest |w|
    (without): what kernel timings multiply, as a file's weights would be."""
    bits, group, with_mins = parse_format(fmt)
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    tiny = torch.finfo(torch.float32).tiny
    if with_mins:
        low, high = w.amin(dim=2), w.amax(dim=2)
        levels = (1 << bits) - 1 if bits == 4 else 255
        scales = (high - low) / levels
        q = ((w - low[..., None]) / scales.clamp_min(tiny)[..., None]).round().clamp(0, levels)
        if bits == 8:  # int8 holds 0..255 shifted down by 128
            q, low = q - 128, low + 128 * scales
        return from_integers(q.reshape(n, k), scales, low, bits, group)
    if bits == 4:
        raise ValueError("4-bit weights carry mins (a symmetric one's min is -8 * scale)")
    scales = w.abs().amax(dim=2) / 127
    q = (w / scales.clamp_min(tiny)[..., None]).round().clamp(-127, 127)
    return from_integers(q.reshape(n, k), scales, None, bits, group)


def group_gemm_available() -> bool:
    """gemm_group.c's kernel needs AVX2, FMA and F16C, and is compiled for this CPU."""
    return bool(load_library().group_gemm_available())


def q8_kernel_runs(w_format: str) -> bool:
    """gemm_group_q8 takes one weight scale per 32-block of its dot products (or one per
    half, in groups of 16): 8-bit groups that split a block otherwise it cannot run."""
    _, group, _ = parse_format(w_format)
    return group == 16 or group % 32 == 0


def q8_256_kernel_runs(w_format: str, in_features: int) -> bool:
    """gemm_group_q8_256 is a kernel of its own where gemm_group_q8 runs 512-bit vectors
    (elsewhere gemm_group_q8 runs it), for 4-bit weights in pairs of 32-blocks."""
    bits, _, _ = parse_format(w_format)
    if bits != 4 or in_features % 64 != 0 or not group_gemm_available():
        return False
    return bool(load_library().group_q8_is_wide())


def gemm_group(
    x: torch.Tensor,
    w: GroupQuantWeight,
    bias: torch.Tensor | None,
    quantized_x: bool = False,
    in_256_bits: bool = False,
) -> torch.Tensor:
    """x [rows, k] (fp32 or bf16) times w, plus bias (in x's dtype): [rows, n] in x's
    dtype, summed in fp32. quantized_x: x quantized per 32-block to int8 (gemm_group_q8,
    or gemm_group_q8_256 with in_256_bits), else exact in fp32."""
    if quantized_x and not q8_kernel_runs(w.format):
        raise ValueError(f"the int8-activation kernel does not run {w.format} (groups of 16 or of 32s)")
    if in_256_bits and not (quantized_x and q8_256_kernel_runs(w.format, w.shape[1])):
        raise ValueError(f"the 256-bit int8-activation kernel does not run {w.format} [{w.shape[1]} in] here")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"gemm_group.c's kernels take fp32 or bf16 inputs, not {x.dtype}")
    # group_linear, as decoder.c calls it: x widened to fp32 and the output rounded to its
    # dtype in C, in one call
    n, k = w.shape
    x, bias = x.contiguous(), None if bias is None else bias.to(x.dtype).contiguous()
    out = x.new_empty((x.shape[0], n))
    load_library().group_linear(
        out.data_ptr(), x.data_ptr(), ctypes.byref(w.struct()), None if bias is None else bias.data_ptr(),
        x.shape[0], n, k, 0, int(x.dtype == torch.bfloat16), 2 if in_256_bits else int(quantized_x),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def group_linear_each(
    x: torch.Tensor,
    weights: ctypes.Array,
    start: int,
    count: int,
    bias: torch.Tensor | None,
    out_features: int,
    gated: bool,
    kernel: int,
) -> torch.Tensor:
    """decoder.c's group_linear with each of weights[start: start + count]
    (GroupQuantWeight.struct()s of one shape) in turn, in one call from Python: x [rows, k]
    in the model's dtype, the bias too; kernel: group_linear's
    (linear_kernels.GROUP_LINEAR_KERNEL). Returns the last weight's output, [rows,
    out_features] (gated: silu(gate) * up)."""
    if not 0 <= start <= start + count <= len(weights):
        raise IndexError(f"weights[{start}:{start + count}] of {len(weights)}")
    out = x.new_empty((x.shape[0], out_features))
    address = ctypes.addressof(weights) + start * ctypes.sizeof(GroupWeight)
    first = ctypes.cast(address, ctypes.POINTER(GroupWeight))
    load_library().group_linear_each(
        out.data_ptr(), x.data_ptr(), first, count, None if bias is None else bias.data_ptr(),
        x.shape[0], out_features, x.shape[1], int(gated),
        int(x.dtype == torch.bfloat16), kernel, torch.get_num_threads(),
    )  # fmt: skip
    return out


@dataclass
class TorchInt4Weight:
    """A 4-bit weight as torch's int4 CPU kernel reads it: the integers packed by
    _convert_weight_to_int4pack_for_cpu and [k / group, n, 2] scales and zeros in fp32
    (converted to x's dtype at each call, a few KB)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))


def torch_int4_runs(w_format: str, out_features: int) -> bool:
    """torch's int4 packing takes 4-bit weights in its group sizes, rows in sixteens."""
    bits, group, _ = parse_format(w_format)
    return bits == 4 and group in TORCH_INT4_GROUPS and out_features % 16 == 0


def pack_for_torch_int4(w: GroupQuantWeight) -> TorchInt4Weight:
    packed = torch._convert_weight_to_int4pack_for_cpu(w.integers().to(torch.int32).contiguous(), 1)
    scales = w.scales.float()
    zeros = w.mins.float() + 8 * scales  # w = s q + m = s (q - 8) + (m + 8 s)
    return TorchInt4Weight(packed, torch.stack([scales.t(), zeros.t()], dim=-1).contiguous(), w.group)


def mm_torch_int4(x: torch.Tensor, w: TorchInt4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), w.packed, w.group, w.scales_zeros.to(x.dtype))
    return y if bias is None else y + bias


# One buffer per dtype, reused by every call: a fresh one each call would cost its page
# faults, which take longer than the dequantization.
_dequantized: dict[torch.dtype, torch.Tensor] = {}


def mm_dequantized(x: torch.Tensor, w: GroupQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x times w dequantized into x's dtype for this call (gemm_group.c's dequantize_group)."""
    n, k = w.shape
    scratch = _dequantized.get(x.dtype)
    if scratch is None or scratch.numel() < n * k:
        scratch = _dequantized[x.dtype] = x.new_empty(n * k)
    dense = scratch[: n * k].view(n, k)
    _dequantize_into(dense, w, None, torch.get_num_threads())
    return F.linear(x, dense, bias)


def embedding_rows(w: GroupQuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [T] of w dequantized into `dtype` [T, k]: as w.dequantize(dtype, ids), in
    one call where gemm_group.c runs here (the same fp32 product and rounding)."""
    if dtype not in (torch.float32, torch.bfloat16) or not group_gemm_available():
        return w.dequantize(dtype, ids)
    ids = ids.to(torch.long).contiguous()  # the C loop reads int64 ids
    out = torch.empty((ids.shape[0], w.shape[1]), dtype=dtype)
    _dequantize_into(out, w, ids, torch.get_num_threads())
    return out


def _dequantize_into(out: torch.Tensor, w: GroupQuantWeight, rows: torch.Tensor | None, threads: int) -> None:
    """out [n, k] (fp32 or bf16) = w's rows `rows` [n] (int64), or its first n."""
    mins = None if w.mins is None else w.mins.data_ptr()
    load_library().dequantize_group(
        out.data_ptr(), w.qs.data_ptr(), w.scales.data_ptr(), mins, None if rows is None else rows.data_ptr(),
        out.shape[0], out.shape[1], w.group, w.bits, int(out.dtype == torch.bfloat16), threads,
    )  # fmt: skip
