"""CPU stand-ins for transformers modules: the same math, and the same bf16 rounding
points, in a few calls each instead of dozens of small torch ops.

- PackedLinear: the weight laid out once for each kernel that multiplies it at some row
  count (gemm.c's bf16 kernel, oneDNN's reordered weights, or F.linear: whichever measured
  fastest on this machine, kernel_choice.py), dispatched on the step's row count.
- RMSNorm: one C kernel. SiluMLP: the gate and up projections share one GEMM, whose
  epilogue also applies silu(gate) * up where gemm.c's kernel runs.
- RotaryPagedAttention: q/k/v in one GEMM, then rotary, the KV write and paged attention
  in one C call per layer. RotaryTable: the rotary module's cos and sin, looked up.

decoder.py decides where they replace transformers' modules.
"""

import torch
from torch import nn

from replica.attention.context import get_forward_context
from replica.cpu import group_quant, int8, linear_kernels, ops
from replica.cpu.group_quant import GroupQuantWeight
from replica.cpu.kernel_choice import KernelChooser, LinearChoice, LinearShape


def concat_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The bias of the linears' outputs side by side (zeros for one without a bias), or None
    where none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


class PackedLinear(nn.Module):
    """y = x W^T + b with W laid out once for each kernel `choice` runs; a drop-in for
    nn.Linear. A gated one (PackedLinear.gated) gives a SiLU MLP's silu(x Wg^T) * (x Wu^T)."""

    def __init__(
        self,
        weight: torch.Tensor | GroupQuantWeight,
        bias: torch.Tensor | None,
        choice: LinearChoice,
        group=None,
        gated: bool = False,
        scale: torch.Tensor | None = None,
    ):
        """group: a tensor-parallel TPGroup whose ranks' outputs are summed (a row-split
        linear, replica/parallel/sharding.py); None for a whole linear. gated: weight and
        bias are the gate's rows, then the up projection's. scale: a pre-quantized
        checkpoint's per-row scales, which int8 kernels quantize with. A GroupQuantWeight
        weight (a file's integers, replica/gguf_blocks.py) runs on the group kernels."""
        super().__init__()
        self.group, self.gated, self.choice = group, gated, choice
        self.in_features, self.out_features = weight.shape[1], weight.shape[0] // (2 if gated else 1)
        # Only the layouts of kernels that win at some row count: memory is not doubled for
        # a kernel that never runs.
        self.layouts = {
            kernel: linear_kernels.pack(kernel, weight, bias, gated, scale) for kernel in choice.used()
        }
        self._only = next(iter(self.layouts)) if len(self.layouts) == 1 else None

    @staticmethod
    def choose(
        chooser: KernelChooser,
        weight: torch.Tensor | GroupQuantWeight,
        gated: bool,
        dtype: torch.dtype,
        max_rows: int | None = None,
    ) -> LinearChoice:
        """dtype: the activations'."""
        if isinstance(weight, GroupQuantWeight):
            shape = LinearShape(*weight.shape, dtype, gated, weight.format)
        else:
            # A float linear of a model whose others hold group weights stays a float one.
            quantization = chooser.quantization if chooser.quantization == "int8" else None
            shape = LinearShape(weight.shape[0], weight.shape[1], dtype, gated, quantization)
        return chooser.linear(shape, max_rows)

    @classmethod
    def of(cls, linear: nn.Linear, chooser: KernelChooser, max_rows: int | None = None) -> "PackedLinear":
        """linear.group_weight, where the loader gave it one, is the weight it packs."""
        weight = getattr(linear, "group_weight", linear.weight)
        choice = cls.choose(chooser, weight, False, linear.weight.dtype, max_rows)
        scale = getattr(linear, "weight_scale", None)
        return cls(weight, linear.bias, choice, getattr(linear, "group", None), scale=scale)

    @classmethod
    def concat(cls, linears: list[nn.Linear], chooser: KernelChooser, gated: bool = False) -> "PackedLinear":
        """One GEMM for several projections of the same input (outputs side by side): of
        their group weights where every one has one, else of their float weights."""
        if all(hasattr(m, "group_weight") for m in linears):
            weight = GroupQuantWeight.concat([m.group_weight for m in linears])
        else:
            weight = torch.cat([m.weight for m in linears])
        choice = cls.choose(chooser, weight, gated, linears[0].weight.dtype)
        scale = None  # a checkpoint's scales, where it quantized some of them; the others' own
        if any(hasattr(m, "weight_scale") for m in linears):
            scale = torch.cat(
                [
                    m.weight_scale if hasattr(m, "weight_scale") else int8.quantize_per_row(m.weight)[1]
                    for m in linears
                ]
            )
        return cls(weight, concat_bias(linears), choice, gated=gated, scale=scale)

    @classmethod
    def gated(cls, gate: nn.Linear, up: nn.Linear, chooser: KernelChooser) -> "PackedLinear":
        return cls.concat([gate, up], chooser, gated=True)

    def layout(self, kernel: str) -> tuple[linear_kernels.Weight, torch.Tensor | None] | None:
        """(weight, bias) as `kernel` reads them, or None where it never runs here."""
        return self.layouts.get(kernel)

    def weight_bytes(self) -> int:
        """What the layouts of its weight hold in memory (biases aside; a layout that
        several kernels read counts once)."""
        weights = {id(w): w for w, _ in self.layouts.values()}.values()
        return sum(
            w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes() for w in weights
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        kernel = self._only or self.choice.kernel_for(flat.shape[0])
        weight, bias = self.layouts[kernel]
        y = linear_kernels.run(kernel, flat, weight, bias, self.out_features, self.gated)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.group is None else self.group.all_reduce(y)


class GroupQuantEmbedding(nn.Module):
    """Token embeddings in a file's group-quantized blocks (a GGUF's token_embd, which a
    tied lm_head's PackedLinear multiplies too, the same tensors): a lookup dequantizes
    its rows into the model's dtype."""

    def __init__(self, weight: GroupQuantWeight, dtype: torch.dtype):
        super().__init__()
        self.weight_blocks, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = group_quant.embedding_rows(self.weight_blocks, input_ids.reshape(-1), self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)


class RMSNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with `residual`: residual += x in place, then norm(residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class SiluMLP(nn.Module):
    def __init__(self, mlp: nn.Module, chooser: KernelChooser, fuse_activation: bool = True):
        """fuse_activation=False: gate_up returns gate and up side by side, and the
        activation follows it; LoRA adapters add to them before it (replica/lora/)."""
        super().__init__()
        self.fused = fuse_activation
        linears = [mlp.gate_proj, mlp.up_proj]
        self.gate_up = (
            PackedLinear.gated(*linears, chooser)
            if fuse_activation
            else PackedLinear.concat(linears, chooser)
        )
        self.down = PackedLinear.of(mlp.down_proj, chooser)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        return self.down(gate_up if self.fused else ops.silu_mul(gate_up))


class RotaryPagedAttention(nn.Module):
    """The Llama family's self-attention over kvserve's paged cache. Takes the same call
    as the module it replaces (the decoder layer passes position_embeddings)."""

    def __init__(self, attn: nn.Module, chooser: KernelChooser):
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        # From the projections, not the config: a tensor-parallel rank holds only some heads.
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = attn.scaling
        self.qkv = PackedLinear.concat([attn.q_proj, attn.k_proj, attn.v_proj], chooser)
        self.o_proj = PackedLinear.of(attn.o_proj, chooser)
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
        out = ops.paged_attention(
            q, k, v, k_cache, v_cache, ctx.metadata, self.scaling, cos=cos, sin=sin,
            kv_scale=ctx.kv_scale(self.layer_idx),
        )  # fmt: skip
        return self.o_proj(out.view(num_tokens, q_size))


class RotaryTable:
    """transformers' rotary module's cos and sin [T, head_dim] (in x's dtype) at T
    positions, looked up in a table that the module itself fills for positions 0..n-1,
    n doubling as positions grow: one index a step in place of the module's half-dozen
    small ops, which a decode step of a small model runs after its weights have pushed
    the interpreter out of cache. Each position's values are the module's own: it
    computes every element alone (a product, then cos or sin). Rope types that rescale
    their frequencies with the sequence's length (dynamic, longrope) call the module."""

    def __init__(self, module: nn.Module, lookup: bool = True):
        """lookup=False: always the module (a table's size comes from the positions'
        maximum, which on a GPU is a sync, and no CUDA graph can hold one)."""
        self.module = module
        rope_type = getattr(module, "rope_type", "default")
        self.static = (
            lookup and isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"
        )
        self.cos = self.sin = torch.empty(0)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: any tensor of the model's dtype; positions [T] -> cos, sin [T, head_dim]."""
        if not self.static:
            cos, sin = self.module(x, positions[None])
            return cos[0].contiguous(), sin[0].contiguous()
        needed = int(positions.max()) + 1
        if needed > self.cos.shape[0] or self.cos.dtype != x.dtype:
            size = max(needed, 2 * self.cos.shape[0], 256)
            limit = getattr(self.module, "max_seq_len_cached", None)
            if limit and needed <= limit:  # doubling, but not past the model's context
                size = min(size, limit)
            cos, sin = self.module(x, torch.arange(size, device=positions.device)[None])
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cos[positions], self.sin[positions]
