"""What a loaded model's weights take, for the start-up log and the benchmarks' records:
the linears (the decoder's and lm_head, which carry the quantization), in every layout
their kernels read, apart from the rest (embeddings and norms, in the model's dtype)."""

import sys
from dataclasses import dataclass

from torch import nn

from replica.cpu.layers import GroupQuantEmbedding, PackedLinear
from replica.quantized_linear import QuantizedLinear


@dataclass
class WeightsSummary:
    quantization: str | None  # the engine's; None: the linears are in the model's dtype
    dtype: str  # the model's
    linear_bytes: int
    other_bytes: int

    @classmethod
    def of(cls, model: nn.Module, quantization: str | None) -> "WeightsSummary":
        # The GPU's group-quantized linears, where that module (which imports triton) is loaded:
        # no model holds one otherwise.
        group_linear = sys.modules.get("replica.gpu.group_linear")
        gpu_kinds = (group_linear.GroupLinear,) if group_linear else ()
        kinds = (PackedLinear, QuantizedLinear, nn.Linear, *gpu_kinds)
        linears = [m for m in model.modules() if isinstance(m, kinds)]
        counted = {id(p) for m in linears for p in m.parameters(recurse=False)}
        other = sum(_nbytes(p) for p in model.parameters() if id(p) not in counted)
        # Quantized embeddings, unless a tied lm_head holds the same blocks.
        layouts = {id(w) for m in linears if isinstance(m, PackedLinear) for w, _ in m.layouts.values()}
        integers = {m.qs.data_ptr() for m in linears if isinstance(m, gpu_kinds)}
        other += sum(
            m.weight_blocks.nbytes()
            for m in model.modules()
            if isinstance(m, GroupQuantEmbedding)
            and id(m.weight_blocks) not in layouts
            and m.weight_blocks.qs.data_ptr() not in integers
        )
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return cls(quantization, dtype, sum(_linear_bytes(m) for m in linears), other)

    def describe(self) -> str:
        mib = 2**20
        return (
            f"linears in {self.quantization or self.dtype} {self.linear_bytes / mib:.1f} MiB, "
            f"the rest in {self.dtype} {self.other_bytes / mib:.1f} MiB"
        )


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _linear_bytes(module: nn.Module) -> int:
    """A packed linear's layouts (the unpacked weight, if tied to the embeddings, is not its)."""
    if isinstance(module, PackedLinear):
        return module.weight_bytes()
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(_nbytes(t) for t in tensors)
