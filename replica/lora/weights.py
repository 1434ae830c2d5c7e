"""An adapter's tensors, read from its safetensors file into host memory, per layer and
target projection, with its scaling folded into B so that the kernels multiply only."""

from dataclasses import dataclass

import torch
from safetensors import safe_open

from replica.lora.adapter_files import WEIGHTS_FILE, AdapterSpec


@dataclass
class AdapterWeights:
    rank: int
    # (layer, target) -> (A [rank, in], B * scaling [out, rank]), in the model's dtype
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype) -> AdapterWeights:
    """Scales in fp32, then casts once. PEFT scales (x A^T) B^T after the product instead:
    the same value up to rounding."""
    pairs = {}
    with safe_open(spec.path / WEIGHTS_FILE, framework="pt") as f:
        for name, (a_key, b_key) in spec.keys.items():
            layer, target = name.split(".")
            a = f.get_tensor(a_key).float()
            b = f.get_tensor(b_key).float() * spec.scaling
            pairs[int(layer), target] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return AdapterWeights(spec.rank, pairs)
