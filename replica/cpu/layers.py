"""CPU stand-ins for transformers modules: the same math, and the same bf16 rounding
points, in a few calls each instead of dozens of small torch ops.

- PackedLinear: the weight laid out once for the kernel that multiplies it: gemm.c's
  own bf16 kernel on AVX512-BF16 CPUs (1.2-2x oneDNN at decode sizes), else oneDNN with
  the weight reordered into its blocked layout (what inductor's weight freezing does),
  1.3-2x faster than F.linear at decode sizes.
- RMSNorm: one C kernel. SiluMLP: the gate and up projections share one GEMM, whose
  epilogue also applies silu(gate) * up where gemm.c's kernel runs.
- RotaryPagedAttention: q/k/v in one GEMM, then rotary, the KV write and paged attention
  in one C call per layer.

decoder.py decides where they replace transformers' modules.
"""

import torch
from torch import nn

from replica.attention.context import get_forward_context
from replica.cpu import ops


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN reorders bf16 weights only on CPUs with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT."""
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W laid out once for its kernel; a drop-in for nn.Linear. Where
    neither kernel takes the weight's dtype on this CPU, it stays a plain F.linear.
    A gated one (PackedLinear.gated) gives a SiLU MLP's silu(x Wg^T) * (x Wu^T)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group=None, gated: bool = False):
        """group: a tensor-parallel TPGroup whose ranks' outputs are summed (a row-split
        linear, replica/parallel/sharding.py); None for a whole linear. gated: weight and
        bias are the gate's rows, then the up projection's."""
        super().__init__()
        self.group, self.gated = group, gated
        self.in_features, self.out_features = weight.shape[1], weight.shape[0] // (2 if gated else 1)
        weight, bias = weight.detach(), None if bias is None else bias.detach().contiguous()
        self.own_kernel = (
            weight.dtype == torch.bfloat16 and self.in_features % 2 == 0 and ops.bf16_gemm_available()
        )
        packed = None
        if self.own_kernel:
            if gated:  # gemm.c's panels pair each 16 gate rows with their up rows
                halves = weight.chunk(2), None if bias is None else bias.chunk(2)
                weight = ops.interleave_gate_up(*halves[0])
                bias = None if bias is None else ops.interleave_gate_up(*halves[1])
            weight, packed = None, ops.pack_bf16_weight(weight)
        elif can_pack(weight.dtype):
            # The reorder takes a batch-size hint; decode batches are what runs most often.
            weight, packed = None, torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        self.weight, self.bias = weight, bias
        self.register_buffer("packed", packed)

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias, getattr(linear, "group", None))

    @classmethod
    def concat(cls, linears: list[nn.Linear], gated: bool = False) -> "PackedLinear":
        """One GEMM for several projections of the same input (outputs side by side)."""
        weight = torch.cat([m.weight for m in linears])
        if all(m.bias is None for m in linears):
            return cls(weight, None, gated=gated)
        biases = [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
        return cls(weight, torch.cat(biases), gated=gated)

    @classmethod
    def gated(cls, gate: nn.Linear, up: nn.Linear) -> "PackedLinear":
        return cls.concat([gate, up], gated=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            flat = x.reshape(-1, self.in_features)
            y = ops.gemm_bf16(flat, self.packed, self.bias, self.out_features, self.gated)
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.packed is not None:
            flat = x.reshape(-1, self.in_features)
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            y = y.view(*x.shape[:-1], y.shape[-1])
        else:
            y = nn.functional.linear(x, self.weight, self.bias)
        if self.gated and not self.own_kernel:
            y = ops.silu_mul(y)
        return y if self.group is None else self.group.all_reduce(y)


class RMSNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with `residual`: residual += x in place, then norm(residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class SiluMLP(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_up = PackedLinear.gated(mlp.gate_proj, mlp.up_proj)
        self.down = PackedLinear.of(mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x))


class RotaryPagedAttention(nn.Module):
    """The Llama family's self-attention over kvserve's paged cache. Takes the same call
    as the module it replaces (the decoder layer passes position_embeddings)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        # From the projections, not the config: a tensor-parallel rank holds only some heads.
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = attn.scaling
        self.qkv = PackedLinear.concat([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = PackedLinear.of(attn.o_proj)
        # Qwen3 normalises each head's q and k before the rotary embedding.
        self.q_norm = RMSNorm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = RMSNorm(attn.k_norm) if hasattr(attn, "k_norm") else None

    def forward(self, hidden_states: torch.Tensor, position_embeddings, **kwargs):
        cos, sin = position_embeddings
        return self.attend(hidden_states[0], cos[0], sin[0])[None], None

    def attend(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, E]; cos, sin: [T, head_dim]."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        num_tokens = hidden.shape[0]
        qkv = self.qkv(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = ops.paged_attention(q, k, v, k_cache, v_cache, ctx.metadata, self.scaling, cos=cos, sin=sin)
        return self.o_proj(out.view(num_tokens, q_size))
