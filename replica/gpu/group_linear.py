"""Group-quantized linears on GPUs: a GGUF file's blocks and 4-bit checkpoints (GPTQ, AWQ,
compressed-tensors W4A16) stay in their integers on the device, and each product runs the
candidate that measured fastest on this GPU at its row count (group_gemm.py): kvserve's
Triton kernel, torch's int4 GEMM where it takes the format, or the weight dequantized for
the call then cuBLAS. Timed at load with CUDA events on the model's own shapes, as the
fused decoder's element-wise ops are (op_choice.py: the same buckets and `fastest`, the
Triton kernel the default). A candidate that fails, or whose product differs from the
dequantized reference, never runs. Where nothing is timed (the tests on CPU, under the
Triton interpreter) the Triton kernel runs.
"""

import logging
import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from replica.cpu.group_quant import GroupQuantWeight
from replica.cpu.kernel_choice import LinearChoice, buckets_up_to, fastest
from replica.cpu.layers import GroupQuantEmbedding
from replica.gpu import group_gemm
from replica.gpu.op_choice import gpu_seconds

logger = logging.getLogger(__name__)

TRITON, TINYGEMM, DEQUANTIZED = "triton", "tinygemm", "dequantized"


class GroupLinear(nn.Module):
    """y = x W^T + b with W in its integers, scales and mins (buffers, so that .to() moves
    them); `choice` names the candidate per row count."""

    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group = weight.bits, weight.group
        self.register_buffer("qs", weight.qs)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.choice = LinearChoice.forced(TRITON)
        self.tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def weight_blocks(self) -> GroupQuantWeight:
        return GroupQuantWeight(self.qs, self.scales, self.mins, self.bits, self.group)

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if kernel == TINYGEMM:
            return group_gemm.mm_tinygemm(x, *self.tinygemm, self.group, bias)
        if kernel == DEQUANTIZED:
            return group_gemm.mm_dequantized(x, self.weight_blocks, bias)
        return group_gemm.group_gemm(x, self.weight_blocks, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.run(self.choice.kernel_for(flat.shape[0]), flat)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"q{self.bits}g{self.group}{'m' if self.mins is not None else ''}, in_features="
            f"{self.in_features}, out_features={self.out_features}, {self.choice.describe()}"
        )


def group_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear given a `group_weight` (gguf_blocks.attach_gguf_weights,
    checkpoint_quantization.attach_group_weights, or the GPU decoder's packing) with a
    GroupLinear, in place, dropping its dense weight. Returns how many."""
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and hasattr(m, "group_weight")
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, GroupLinear(linear.group_weight, linear.bias))
    return len(targets)


def move_embeddings(model: nn.Module, device: torch.device) -> None:
    """A GGUF's token embeddings (GroupQuantEmbedding, whose blocks are no buffers) to
    `device`, sharing a tied lm_head's tensors where it has them."""
    embed = model.get_input_embeddings()
    if not isinstance(embed, GroupQuantEmbedding):
        return
    head = model.get_output_embeddings()
    if isinstance(head, GroupLinear) and head.qs.data_ptr() == embed.weight_blocks.qs.data_ptr():
        embed.weight_blocks = head.weight_blocks  # already moved with the model
        return
    w = embed.weight_blocks
    moved = [None if t is None else t.to(device) for t in (w.qs, w.scales, w.mins)]
    embed.weight_blocks = GroupQuantWeight(*moved, w.bits, w.group)


@dataclass(frozen=True)
class GroupShape:
    n: int
    k: int
    bits: int
    group: int
    mins: bool


def _shape(m: GroupLinear) -> GroupShape:
    return GroupShape(m.out_features, m.in_features, m.bits, m.group, m.mins is not None)


def _agrees(y: torch.Tensor, reference: torch.Tensor) -> bool:
    """Within a few roundings of a 16-bit output (1e-4 of fp32's, whose sums' order
    differs), relative to the output's largest value: a candidate that reads the integers
    wrongly is off by about that value."""
    relative = 1e-4 if y.dtype == torch.float32 else 8 * torch.finfo(y.dtype).eps
    tolerance = relative * (reference.float().abs().max().item() + 1e-6)
    return bool(((y.float() - reference.float()).abs().max() <= tolerance).item())


def time_group_linear(m: GroupLinear, buckets: tuple[int, ...], dtype: torch.dtype) -> dict[str, list[float]]:
    """Seconds per call of each candidate at each bucket (inf: it failed, or disagreed with
    the dequantized reference on a probe)."""
    device = m.qs.device
    candidates = [TRITON, DEQUANTIZED]
    if group_gemm.tinygemm_runs(m.weight_blocks, dtype, device):
        try:
            m.tinygemm = group_gemm.pack_tinygemm(m.weight_blocks)
            candidates.append(TINYGEMM)
        except Exception as e:
            logger.warning("torch's int4 packing failed for %s: %s", _shape(m), e)
    out: dict[str, list[float]] = {c: [] for c in candidates}
    for rows in buckets:
        x = torch.randn(rows, m.in_features, dtype=dtype, device=device)
        reference = m.run(DEQUANTIZED, x)
        for c in candidates:
            try:
                ok = _agrees(m.run(c, x), reference)
                out[c].append(gpu_seconds(partial(m.run, c, x)) if ok else math.inf)
                if not ok:
                    logger.warning("%s's product differs from the reference at %d rows: never run", c, rows)
            except Exception as e:
                logger.warning("%s failed for %s at %d rows: %s", c, _shape(m), e, rows)
                out[c].append(math.inf)
    return out


def choose_group_kernels(model: nn.Module, max_rows: int, dtype: torch.dtype) -> dict:
    """Times each distinct shape's candidates on this GPU and sets every GroupLinear's
    choice; drops torch's int4 packing where it is chosen nowhere. Returns the timings."""
    buckets = buckets_up_to(max_rows)
    by_shape: dict[GroupShape, list[GroupLinear]] = {}
    for m in model.modules():
        if isinstance(m, GroupLinear):
            by_shape.setdefault(_shape(m), []).append(m)
    timings = {}
    for shape, linears in by_shape.items():
        seconds = time_group_linear(linears[0], buckets, dtype)
        choice = fastest(buckets, seconds)
        for m in linears:
            m.choice = choice
            if TINYGEMM not in choice.used():
                m.tinygemm = None
            elif m.tinygemm is None:  # linears[0] keeps the packing it was timed with
                m.tinygemm = group_gemm.pack_tinygemm(m.weight_blocks)
        timings[f"{shape.n}x{shape.k} q{shape.bits}g{shape.group}{'m' if shape.mins else ''}"] = {
            "choice": choice.describe(),
            **seconds,
        }
        logger.info("group-quantized %s: %s", shape, choice.describe())
    return {"buckets": buckets, "shapes": timings}
