"""Where the CPU stand-ins (layers.py) replace transformers' modules.

For the Llama family (Llama, Mistral, Qwen2, Qwen3), whose decoder is embeddings, then
per layer norm -> attention -> add -> norm -> SiLU MLP -> add, then a final norm, the
whole decoder runs as FusedDecoder: kvserve's own loop over the stand-ins, with each
skip connection fused into the next norm. That removes transformers' per-layer Python
(module calls, keyword plumbing, output records), which on a CPU costs as much as a
small model's decode-step arithmetic.

Any other architecture keeps transformers' decoder with packed linears swapped in, and
its attention goes through the AttentionInterface function: every model runs, only with
fewer shortcuts.
"""

import torch
from torch import nn

from replica.attention.context import get_forward_context
from replica.cpu.kernel_choice import KernelChooser
from replica.cpu.layers import PackedLinear, RMSNorm, RotaryPagedAttention, RotaryTable, SiluMLP
from replica.cpu.native_decoder import NativeDecoder

# transformers classes whose math the stand-ins reproduce exactly.
RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
SILU_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
SILU_ACTIVATIONS = {"SiLU", "SiLUActivation"}  # torch's and transformers' (both F.silu)
ROTARY_ATTENTIONS = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
DECODER_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
DECODERS = {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"}
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class FusedDecoder(nn.Module):
    def __init__(self, decoder: nn.Module, chooser: KernelChooser, lora: bool = False):
        """lora: adapters will wrap the projections (replica/lora/layers.py), so the MLP
        activation stays out of its GEMM and decoder.c, which would skip them, is off."""
        super().__init__()
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.rotary = RotaryTable(self.rotary_emb)
        self.input_norms = nn.ModuleList(RMSNorm(layer.input_layernorm) for layer in decoder.layers)
        self.attentions = nn.ModuleList(
            RotaryPagedAttention(layer.self_attn, chooser) for layer in decoder.layers
        )
        self.post_norms = nn.ModuleList(RMSNorm(layer.post_attention_layernorm) for layer in decoder.layers)
        self.mlps = nn.ModuleList(
            SiluMLP(layer.mlp, chooser, fuse_activation=not lora) for layer in decoder.layers
        )
        self.norm = RMSNorm(decoder.norm)
        # decoder.c's loop over the same kernels, where it covers this model (bf16 or fp32,
        # with gemm.c's kernel chosen for some row counts): the same result without Python
        # between the kernels, in the steps whose every linear runs gemm.c.
        self.native = NativeDecoder(self) if not lora and NativeDecoder.supports(self) else None

    @staticmethod
    def supports(decoder: nn.Module) -> bool:
        layers = getattr(decoder, "layers", [])
        return type(decoder).__name__ in DECODERS and all(
            type(layer).__name__ in DECODER_LAYERS
            and type(layer.self_attn).__name__ in ROTARY_ATTENTIONS
            and _is_silu_mlp(layer.mlp)
            and type(layer.input_layernorm).__name__ in RMS_NORMS
            and type(layer.post_attention_layernorm).__name__ in RMS_NORMS
            for layer in layers
        )

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[1, T] ids and positions -> final hidden states [1, T, E], or [1, R, E] of the
        packed rows `rows` [R]. The other rows' last layer stops once their K and V are in
        the cache: nothing reads the rest (its o_proj and MLP are a thirtieth of a prompt
        token's GEMMs in a 30-layer model)."""
        residual = self.embed_tokens(input_ids[0])  # [T, E]; updated in place by each fused add
        cos, sin = self.rotary(residual, position_ids[0])  # [T, head_dim], once for every layer
        if self.native is not None:
            final = self.native.forward(residual, cos, sin, rows)
            if final is not None:
                return final[None]
        out = None
        last = len(self.attentions) - 1
        # Bound forwards: nn.Module's call machinery costs as much as a small kernel here.
        for i, (input_norm, attention, post_norm, mlp) in enumerate(
            zip(self.input_norms, self.attentions, self.post_norms, self.mlps, strict=True)
        ):
            # out is the previous layer's MLP output: add it in, then normalise.
            hidden = input_norm.forward(residual) if out is None else input_norm.forward(out, residual)
            out = attention.attend(hidden, cos, sin)
            if i == last and rows is not None:
                out, residual = out[rows], residual[rows]
                ctx = get_forward_context()
                if ctx.lora is not None:  # the MLP's adapter rows are the kept rows
                    ctx.lora = ctx.lora.select(rows)
            out = mlp.forward(post_norm.forward(out, residual))
        final = self.norm.forward(residual) if out is None else self.norm.forward(out, residual)
        return final[None]


def optimize_for_cpu(
    model: nn.Module, chooser: KernelChooser, max_logit_rows: int, lora: bool = False
) -> FusedDecoder | None:
    """Swap the stand-ins into `model` in place, each linear with the kernels `chooser`
    picks. Returns the FusedDecoder that replaced
    its decoder, or None where transformers' decoder stays (with stand-ins inside).
    Packing needs fp32 or bf16 weights; other dtypes keep transformers' modules.
    max_logit_rows: the most rows the output projection sees in a step. lora: as in
    FusedDecoder."""
    if model.dtype not in PACKABLE_DTYPES:
        return None
    decoder, prefix = model.get_decoder(), model.base_model_prefix
    fused = None
    if FusedDecoder.supports(decoder) and getattr(model, prefix, None) is decoder:
        fused = FusedDecoder(decoder, chooser, lora)
        setattr(model, prefix, fused)  # drops transformers' layers and their unpacked weights
    output = model.get_output_embeddings()
    if isinstance(output, nn.Linear):
        # Quantized like the decoder's linears (bench/quantization.py measures what that
        # costs), in a layout of its own even where its weight is the embeddings', which
        # stay in the model's dtype: a lookup reads one row a token.
        model.set_output_embeddings(PackedLinear.of(output, chooser, max_logit_rows))
    _swap_children(model, chooser)
    return fused


def _is_silu_mlp(module: nn.Module) -> bool:
    return type(module).__name__ in SILU_MLPS and type(module.act_fn).__name__ in SILU_ACTIVATIONS


def _swap_children(module: nn.Module, chooser: KernelChooser) -> None:
    for name, child in module.named_children():
        replacement = _replacement(child, chooser)
        if replacement is None:
            _swap_children(child, chooser)
        else:
            setattr(module, name, replacement)


def _replacement(module: nn.Module, chooser: KernelChooser) -> nn.Module | None:
    kind = type(module).__name__
    if kind in ROTARY_ATTENTIONS:
        return RotaryPagedAttention(module, chooser)
    if _is_silu_mlp(module):
        return SiluMLP(module, chooser)
    if kind in RMS_NORMS:
        return RMSNorm(module)
    if isinstance(module, nn.Linear):
        return PackedLinear.of(module, chooser)
    return None
