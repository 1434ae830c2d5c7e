"""The Llama family's decoder on GPUs in about ten launches a layer, where transformers'
modules launch about forty: q, k and v in one GEMM, gate and up in another, each skip
connection fused into the next RMSNorm, rotary fused into the KV-cache write, SiLU * up in
one kernel (fused_ops.py), attention through the Triton backend's kernels. The layer loop
is FusedDecoder's (replica/cpu/decoder.py), which cuts the last layer short for rows that
sample nothing; only the stand-ins differ. Inside a CUDA graph each launch still costs a
few microseconds, so at batch 1 their count sets the step's time.

The projections stay nn.Linear modules, so int8 and fp8 weights (quantized_linear.py) and
LoRA adapters (replica/lora/layers.py) wrap the packed ones as they wrap the CPU path's.
"""

import logging

import torch
from torch import nn

from replica.attention.context import get_forward_context
from replica.attention.triton_backend import attend
from replica.cpu.decoder import FusedDecoder
from replica.cpu.group_quant import GroupQuantWeight
from replica.cpu.layers import RotaryTable, concat_bias
from replica.gpu.op_choice import OpChoices, OpShapes, choose_ops

logger = logging.getLogger(__name__)


def _packed(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose outputs are the given ones' side by side (same input)."""
    first, bias = linears[0], concat_bias(linears)
    packed = nn.Linear(
        first.in_features, sum(m.out_features for m in linears), bias=bias is not None,
        device=first.weight.device, dtype=first.weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        packed.weight.copy_(torch.cat([m.weight for m in linears]))
        if bias is not None:
            packed.bias.copy_(bias)
    if all(hasattr(m, "weight_scale") for m in linears):  # a pre-quantized checkpoint's rows
        packed.weight_scale = torch.cat([m.weight_scale for m in linears])
    if all(hasattr(m, "group_weight") for m in linears):  # group_linear.py runs their integers
        packed.group_weight = GroupQuantWeight.concat([m.group_weight for m in linears])
    return packed


class RMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, ops: OpChoices):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with `residual`: residual += x in place, then norm(residual)."""
        return self.ops.pick("add_rms_norm", x.shape[0])(x, self.weight, self.eps, residual)


class SiluMLP(nn.Module):
    def __init__(self, mlp: nn.Module, ops: OpChoices):
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up = _packed([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj
        self.down = mlp.down_proj
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.pick("silu_mul", x.shape[0])(self.gate_up(x)))


class RotaryPagedAttention(nn.Module):
    """q, k, v in one GEMM; rotary (after Qwen3's per-head norms) and the KV write in one
    kernel; attention over the paged cache; the output projection."""

    def __init__(self, attn: nn.Module, ops: OpChoices):
        super().__init__()
        self.ops = ops
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = attn.scaling
        self.qkv = _packed([attn.q_proj, attn.k_proj, attn.v_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj  # one copy of these weights at a time
        self.o_proj = attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)

    def attend(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, E]; cos, sin: [T, head_dim]."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        kv_scale = ctx.kv_scale(self.layer_idx)
        norms = None
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon)
        q = self.ops.pick("rope_write_kv", hidden.shape[0])(
            self.qkv(hidden), cos, sin, k_cache, v_cache, ctx.metadata.slot_mapping,
            self.num_heads, self.num_kv_heads, kv_scale, norms,
        )  # fmt: skip
        out = attend(q, k_cache, v_cache, ctx.metadata, self.scaling, kv_scale)
        return self.o_proj(out.view(hidden.shape[0], self.num_heads * self.head_dim))


class GPUFusedDecoder(FusedDecoder):
    def __init__(self, decoder: nn.Module):
        nn.Module.__init__(self)
        # Shared by every stand-in: Triton's kernels until choose_ops measures this GPU.
        self.op_choices = ops = OpChoices()
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.rotary = RotaryTable(self.rotary_emb, lookup=False)
        self.input_norms = nn.ModuleList(RMSNorm(layer.input_layernorm, ops) for layer in decoder.layers)
        self.attentions = nn.ModuleList(
            RotaryPagedAttention(layer.self_attn, ops) for layer in decoder.layers
        )
        self.post_norms = nn.ModuleList(
            RMSNorm(layer.post_attention_layernorm, ops) for layer in decoder.layers
        )
        self.mlps = nn.ModuleList(SiluMLP(layer.mlp, ops) for layer in decoder.layers)
        self.norm = RMSNorm(decoder.norm, ops)
        self.native = None

    def choose_ops(self, block_size: int, max_rows: int) -> dict:
        """Time each element-wise op's candidates (Triton kernel, torch reference, compiled
        reference) on this GPU, on this model's shapes, and run the fastest per row count
        (op_choice.py). Returns the timings."""
        attn = self.attentions[0]
        shapes = OpShapes(
            hidden=self.norm.weight.shape[0],
            intermediate=self.mlps[0].intermediate,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            block_size=block_size,
            dtype=self.norm.weight.dtype,
            head_norms=attn.q_norm is not None,
        )
        choices, timings = choose_ops(shapes, max_rows, self.norm.weight.device)
        self.op_choices.choices = choices.choices
        logger.info("fused GPU ops: %s", self.op_choices.describe())
        return timings


def fuse_for_gpu(model: nn.Module) -> GPUFusedDecoder | None:
    """Swap a GPUFusedDecoder into `model` in place of a Llama-family decoder (dropping
    transformers' layers and their unpacked weights) and return it; None where the model is
    not one, or where a pre-quantized checkpoint or a GGUF file quantizes some projections
    of a packed GEMM but not the others."""
    decoder, prefix = model.get_decoder(), model.base_model_prefix
    if not FusedDecoder.supports(decoder) or getattr(model, prefix, None) is not decoder:
        logger.info(
            "the GPU decoder stays transformers': %s is not of the Llama family", type(decoder).__name__
        )
        return None
    for layer in decoder.layers:
        groups = ([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                  [layer.mlp.gate_proj, layer.mlp.up_proj])  # fmt: skip
        for attribute in ("weight_scale", "group_weight"):
            if any(len({hasattr(m, attribute) for m in group}) > 1 for group in groups):
                logger.info(
                    "the GPU decoder stays transformers': the checkpoint quantizes only some projections"
                )
                return None
    fused = GPUFusedDecoder(decoder)
    setattr(model, prefix, fused)
    return fused
