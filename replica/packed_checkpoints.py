"""4-bit checkpoints loaded in 4 bits: GPTQ, AWQ and compressed-tensors' pack-quantized
W4A16, each linear's integers repacked once into group_quant's layout (w = scale * q +
min per group), which the group kernels multiply as they do a GGUF's blocks.

What each format stores, per linear (k inputs, n outputs, groups of g along k):
- GPTQ (AutoGPTQ, GPTQModel, optimum): `qweight` int32 [k / 8, n], 8 nibbles of one column
  down k; `qzeros` int32 [k / g, n / 8], 8 nibbles across n; `scales` fp16 [k / g, n];
  `g_idx` [k]. w = scale * (q - zero), the stored zero one less than the real one in the
  original format ("gptq"; "gptq_v2" stores it as it is).
- AWQ, GEMM version (AutoAWQ): `qweight` int32 [k, n / 8] and `qzeros` int32 [k / g, n / 8],
  8 nibbles across n in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales` fp16 [k / g, n].
  w = scale * (q - zero).
- compressed-tensors pack-quantized (llm-compressor's W4A16 schemes): `weight_packed` int32
  [n, k / 8], nibbles along k holding q + 8; `weight_scale` [n, k / g];
  `weight_zero_point` int32 [n / 8, k / g] (asymmetric only), packed likewise down n.
  w = scale * (q - zero).
The min is -scale * zero, rounded to fp16 as the scales are (exact where the zero is a
power of two, as a symmetric checkpoint's 8 is; else within 2^-11 of it). Act-order
checkpoints whose groups are not in input order, other bit widths and other AWQ versions
are refused with an error that says which."""

import json
from pathlib import Path

import torch

from replica.cpu.group_quant import GroupQuantWeight, from_integers

METHODS = ("gptq", "awq", "w4a16")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
# Each method's tensor names (suffixes of "<linear>."): packed integers, scales, zeros.
TENSORS = {
    "gptq": ("qweight", "scales", "qzeros"),
    "awq": ("qweight", "scales", "qzeros"),
    "w4a16": ("weight_packed", "weight_scale", "weight_zero_point"),
}
EXTRA = ("g_idx", "weight_shape", "weight_g_idx")


def method_of(config: dict) -> str | None:
    """The method of a `quantization_config` this module loads, or None where it is not a
    4-bit one; raises ValueError, naming what, for a 4-bit variant it cannot run."""
    method = config.get("quant_method")
    if method == "gptq":
        if config.get("bits") != 4:
            raise ValueError(f"GPTQ with {config.get('bits')} bits (kvserve runs 4-bit GPTQ)")
        return "gptq"
    if method == "awq":
        if config.get("bits", config.get("w_bit")) != 4:
            raise ValueError(f"AWQ with {config.get('bits')} bits (kvserve runs 4-bit AWQ)")
        if str(config.get("version", "gemm")).lower() != "gemm" or not config.get("zero_point", True):
            raise ValueError(
                f"AWQ version {config.get('version')!r} (kvserve runs the GEMM version, with zero points)"
            )
        return "awq"
    if method == "compressed-tensors" and config.get("format") == "pack-quantized":
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
            if scheme not in (("int", 4, "group"), ("int", 4, "channel")):
                raise ValueError(
                    f"{name}'s weights are {scheme[1]}-bit {scheme[0]} per {scheme[2]} (kvserve runs 4-bit "
                    "int weights per group or channel)"
                )
            if group.get("input_activations"):
                raise ValueError(f"{name} quantizes activations (kvserve runs W4A16)")
        return "w4a16"
    return None


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles each (lowest first), side by side along dim."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1)
    values = (words >> shifts) & 0xF  # [..., 8]
    if dim == 0:  # [rows, cols, 8] -> [rows * 8, cols]
        return values.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return values.reshape(packed.shape[0], -1)


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """AWQ's nibble order within each word of 8 columns back to column order."""
    rows, cols = values.shape
    words = values.view(rows, cols // 8, 8)
    order = torch.tensor(AWQ_ORDER).argsort()  # column c sits at nibble order.index(c)
    return words[:, :, order].reshape(rows, cols)


def integers_scales_zeros(method: str, tensors: dict, config: dict):
    """One linear's checkpoint tensors (by TENSORS' names) -> (q [n, k] in 0..15, scales
    [n, k / g] float, zeros [n, k / g] float), with w = scales * (q - zeros)."""
    packed_name, scale_name, zero_name = TENSORS[method]
    scales = tensors[scale_name].float()
    if method == "gptq":
        q = _nibbles(tensors[packed_name], 0).t().contiguous()  # [n, k]
        zeros = _nibbles(tensors[zero_name], 1).float()  # [k / g, n]
        if config.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1
        _check_group_order(tensors.get("g_idx"), q.shape[1], scales.shape[0])
        return q, scales.t().contiguous(), zeros.t().contiguous()
    if method == "awq":
        q = _awq_columns(_nibbles(tensors[packed_name], 1)).t().contiguous()
        zeros = _awq_columns(_nibbles(tensors[zero_name], 1)).float()
        return q, scales.t().contiguous(), zeros.t().contiguous()
    q = _nibbles(tensors[packed_name], 1)  # q + 8
    _check_group_order(tensors.get("weight_g_idx"), q.shape[1], scales.shape[1])
    if zero_name in tensors:
        zeros = _nibbles(tensors[zero_name], 0)[: q.shape[0]].float()  # zero + 8, as q is stored
    else:
        zeros = torch.full_like(scales, 8.0)
    return q, scales, zeros


def _check_group_order(g_idx: torch.Tensor | None, k: int, groups: int) -> None:
    """An act-order checkpoint whose input rows are not in group order is refused."""
    if g_idx is None:
        return
    in_order = torch.arange(k) // (k // groups)
    if not torch.equal(g_idx.to(torch.int64), in_order):
        raise ValueError("act-order (desc_act) with groups out of input order, which kvserve does not run")


def to_group_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> GroupQuantWeight:
    group = q.shape[1] // scales.shape[1]
    return from_integers(q, scales, -scales * zeros, 4, group)


def dequantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The checkpoint's own w = scale * (q - zero), fp32 [n, k], scales as stored."""
    group = q.shape[1] // scales.shape[1]
    return ((q.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)).contiguous()


def linear_tensors(all_tensors: dict[str, torch.Tensor], method: str) -> dict[str, dict[str, torch.Tensor]]:
    """{linear prefix: {suffix: tensor}} of the packed linears among a checkpoint's tensors."""
    packed_name = TENSORS[method][0]
    prefixes = [
        name.removesuffix(f".{packed_name}") for name in all_tensors if name.endswith(f".{packed_name}")
    ]
    suffixes = (*TENSORS[method], *EXTRA)
    return {
        prefix: {s: all_tensors[f"{prefix}.{s}"] for s in suffixes if f"{prefix}.{s}" in all_tensors}
        for prefix in prefixes
    }


def quantization_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
