"""Where adapters act on the model: each target projection (or fused group of them, as
the CPU stand-ins' q/k/v GEMM) is wrapped in a LoRALinear that adds its rows' low-rank
updates to the base output, from max_loras slots of stacked weights (kernels.py).

Which slot each packed token uses travels in the forward context (LoRABatch), as the
attention metadata does; a step without adapter rows has none and pays nothing."""

import torch
from torch import nn

from replica.attention.context import get_forward_context
from replica.cpu.layers import PackedLinear
from replica.lora.kernels import lora_delta
from replica.lora.weights import AdapterWeights
from replica.quantized_linear import QuantizedLinear


class LoRALinear(nn.Module):
    """base(x) + each token's adapter update. slices: the target projections whose
    outputs `base` lays side by side ([("q_proj", 576), ("k_proj", 192), ...]); a slot
    without one of them adds zero there."""

    def __init__(
        self,
        base: nn.Module,
        layer: int,
        slices: list[tuple[str, int]],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.base, self.layer, self.slices, self.max_rank = base, layer, slices, max_rank
        width, out_features = len(slices) * max_rank, sum(n for _, n in slices)
        self.register_buffer("lora_a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device))
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        lora = get_forward_context().lora
        if lora is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        delta = lora_delta(flat, self.lora_a, self.lora_b, lora.token_slots)
        return y + delta.view(y.shape)

    def set_slot(self, slot: int, adapter: AdapterWeights | None) -> None:
        """Write an adapter's weights for this layer into `slot` (None: clear it)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        column = 0
        for p, (target, out_features) in enumerate(self.slices):
            pair = adapter.pairs.get((self.layer, target))
            if pair is not None:
                a, b = pair
                rows = slice(p * self.max_rank, p * self.max_rank + a.shape[0])
                self.lora_a[slot, rows] = a
                self.lora_b[slot, rows, column : column + out_features] = b.T
            column += out_features


def wrap_targets(decoder: nn.Module, max_loras: int, max_rank: int) -> list[LoRALinear]:
    """Wrap every target projection of a Llama-family decoder in place: the CPU
    stand-ins' fused q/k/v and gate/up GEMMs as one LoRALinear each (their slices side by
    side), or transformers' separate projections. Returns the wrappers, in layer order."""
    param = next(decoder.parameters())

    def make(base: nn.Module, layer: int, slices: list[tuple[str, int]], in_features: int) -> LoRALinear:
        return LoRALinear(base, layer, slices, in_features, max_loras, max_rank, param.dtype, param.device)

    wrapped = []
    if hasattr(decoder, "attentions"):  # replica/cpu/decoder.py's FusedDecoder
        for layer, (attn, mlp) in enumerate(zip(decoder.attentions, decoder.mlps, strict=True)):
            q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
            hidden, inner = attn.qkv.in_features, mlp.down.in_features
            attn.qkv = make(attn.qkv, layer, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], hidden)
            attn.o_proj = make(attn.o_proj, layer, [("o_proj", hidden)], q)
            mlp.gate_up = make(mlp.gate_up, layer, [("gate_proj", inner), ("up_proj", inner)], hidden)
            mlp.down = make(mlp.down, layer, [("down_proj", hidden)], inner)
            wrapped += [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down]
        return wrapped
    for layer, block in enumerate(getattr(decoder, "layers", [])):
        for parent, names in (
            (block.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (block.mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:
                base = getattr(parent, name, None)
                if not isinstance(base, nn.Linear | PackedLinear | QuantizedLinear):
                    raise ValueError(
                        f"enable_lora: layer {layer} of {type(decoder).__name__} has no linear {name}; "
                        "LoRA adapters run on Llama-family models"
                    )
                setattr(parent, name, make(base, layer, [(name, base.out_features)], base.in_features))
                wrapped.append(getattr(parent, name))
    return wrapped
