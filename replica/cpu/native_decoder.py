"""decoder.c's whole-step loop for FusedDecoder: the layers' weight pointers gathered
once, and the KV cache's (with its format and fp8 scales) once per cache, in abi.py's
mirrors of decoder.c's structs.

It runs where every linear has a layout for one of the kernels decoder.c calls (gemm.c's:
bf16 on AVX512-BF16 CPUs, fp32 on AVX2 ones; gemm_int8.c's, for an fp32 model with
int8 weights; or one of gemm_group.c's, for a GGUF's group-quantized weights) and the
layers have no parts it lacks (tensor-parallel reductions, Qwen3's q/k norms), and only
in steps whose every linear chose that kernel at the step's row count (for group weights:
one of gemm_group.c's kernels, the same for a projection in every layer) and whose
attention the C kernel does entirely (not fresh prefills that SDPA attends where it
measured faster). Anywhere else FusedDecoder's Python loop runs the
kernels chosen for the step."""

import ctypes

import torch

from replica.attention.context import get_forward_context
from replica.cpu import ops
from replica.cpu.abi import DecoderLayer, DecoderShape
from replica.cpu.build import load_library
from replica.cpu.group_quant import GroupQuantWeight
from replica.cpu.int8 import Int8Weight
from replica.cpu.linear_kernels import GEMM_C, GROUP_LINEAR_KERNEL, INT8_GEMM_C

# NativeDecoder.kernel where every linear holds group-quantized weights: each projection
# runs the one of gemm_group.c's kernels it chose at the step's rows.
GROUP = "gemm_group.c"
NO_GROUP_KERNELS = (0, 0, 0, 0)


class NativeDecoder:
    def __init__(self, fused):
        """fused: a FusedDecoder that `supports`."""
        attention, mlp = fused.attentions[0], fused.mlps[0]
        self.hidden = fused.norm.weight.shape[0]
        self.dtype = fused.norm.weight.dtype
        self.kernel = _kernel(fused)
        self.block_size = self.kv_format = None  # from the KV cache, with the layers' cache pointers
        self._shape_args = dict(
            num_layers=len(fused.attentions),
            hidden=self.hidden,
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            intermediate=mlp.gate_up.out_features,
            is_bf16=int(self.dtype == torch.bfloat16),
            is_int8=int(self.kernel == INT8_GEMM_C),
            is_group=int(self.kernel == GROUP),
            eps=fused.norm.eps,
            scale=attention.scaling,
            final_norm=fused.norm.weight.data_ptr(),
        )
        self._projections = _projections(fused)
        self._weights = [
            dict(
                input_norm=norm_in.weight,
                post_norm=norm_post.weight,
                **_packed("qkv", attn.qkv, self.kernel),
                **_packed("o", attn.o_proj, self.kernel),
                **_packed("gate_up", mlp.gate_up, self.kernel),
                **_packed("down", mlp.down, self.kernel),
            )  # fmt: skip
            for norm_in, attn, norm_post, mlp in zip(
                fused.input_norms, fused.attentions, fused.post_norms, fused.mlps, strict=True
            )
        ]
        self._layers, self._caches_seen = None, None  # _caches_seen: (KV caches, scales) bound
        self._shapes: dict[tuple[int, ...], DecoderShape] = {}  # group_kernels -> shape, per binding
        self._kernels_at: dict[int, tuple[int, ...] | None] = {}  # rows -> _step_kernels(rows)
        self._scratch = torch.empty(0, dtype=self.dtype)
        self._lib = load_library()

    @staticmethod
    def supports(fused) -> bool:
        linears = _linears(fused)
        norms = [*fused.input_norms, *fused.post_norms, fused.norm]
        if not fused.attentions:
            return False
        first = fused.attentions[0]
        return (
            _kernel(fused) is not None
            and all(m.group is None for m in linears)
            and all(a.q_norm is None and a.k_norm is None for a in fused.attentions)
            and fused.norm.weight.dtype in (torch.bfloat16, torch.float32)
            and all(n.weight.dtype == fused.norm.weight.dtype and n.eps == fused.norm.eps for n in norms)
            and all(
                (a.num_heads, a.num_kv_heads, a.head_dim, a.scaling)
                == (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
                for a in fused.attentions
            )
        )

    def forward(
        self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor | None
    ):
        """residual [T, E] (the embeddings; overwritten) -> final hidden states [R, E], or
        None where this step's linears or attention need the Python loop."""
        group_kernels = self._step_kernels(residual.shape[0])
        if group_kernels is None:
            return None
        ctx = get_forward_context()
        layout, fresh_runs = ops.step_layout(ctx.metadata)
        if fresh_runs:
            return None
        shape = self._bind(ctx, group_kernels)
        num_tokens = residual.shape[0]
        needed = self._lib.decoder_scratch_elements(ctypes.byref(shape), num_tokens)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=self.dtype)
        num_rows = -1 if rows is None else rows.shape[0]  # -1: every row
        out = residual.new_empty((num_tokens if rows is None else num_rows, self.hidden))
        cos, sin = cos.to(self.dtype).contiguous(), sin.to(self.dtype).contiguous()
        self._lib.decoder_forward(
            ctypes.byref(shape), self._layers, ctypes.byref(layout), residual.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), rows.data_ptr() if num_rows > 0 else None, num_rows,
            out.data_ptr(), self._scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def _step_kernels(self, rows: int) -> tuple[int, ...] | None:
        """decoder.c's group_kernels for a step of `rows` (NO_GROUP_KERNELS for a model
        without group weights), or None where some linear runs a kernel decoder.c lacks."""
        if rows not in self._kernels_at:
            chosen = [{m.choice.kernel_for(rows) for m in kind} for kind in self._projections]
            if self.kernel != GROUP:
                native = all(kernels == {self.kernel} for kernels in chosen)
                self._kernels_at[rows] = NO_GROUP_KERNELS if native else None
            elif all(len(kernels) == 1 and kernels <= GROUP_LINEAR_KERNEL.keys() for kernels in chosen):
                self._kernels_at[rows] = tuple(GROUP_LINEAR_KERNEL[next(iter(kernels))] for kernels in chosen)
            else:
                self._kernels_at[rows] = None
        return self._kernels_at[rows]

    def _bind(self, ctx, group_kernels: tuple[int, ...]) -> DecoderShape:
        """The model's shapes for a step, and the layers' struct array with the context's
        KV cache and scales, rebuilt when either changes. The runner replaces its lists of
        caches and scales whole, never an item, so the lists' identity tells; held here,
        a list's id cannot pass to a new one."""
        kv_caches = ctx.kv_caches
        if self._caches_seen is None or not (
            kv_caches is self._caches_seen[0] and ctx.kv_scales is self._caches_seen[1]
        ):
            scales = [ctx.kv_scale(i) for i in range(len(self._weights))]
            self._layers = (DecoderLayer * len(self._weights))(
                *(
                    DecoderLayer(
                        **{name: _pointer(t) for name, t in weights.items()},
                        k_cache=k.data_ptr(),
                        v_cache=v.data_ptr(),
                        k_scale=scale.k,
                        v_scale=scale.v,
                    )  # fmt: skip
                    for weights, (k, v), scale in zip(self._weights, kv_caches, scales, strict=True)
                )
            )
            self._caches_seen, self.block_size = (kv_caches, ctx.kv_scales), kv_caches[0][0].shape[2]
            self.kv_format = ops.kv_format(kv_caches[0][0].dtype, self.dtype)
            self._shapes = {}
        if group_kernels not in self._shapes:
            self._shapes[group_kernels] = DecoderShape(
                **self._shape_args,
                block_size=self.block_size,
                kv_format=self.kv_format,
                group_kernels=(ctypes.c_int * 4)(*group_kernels),
            )
        return self._shapes[group_kernels]


def _projections(fused) -> list[list]:
    """Each layer's qkv, o, gate/up and down projections, in group_kernels' order."""
    return [
        [a.qkv for a in fused.attentions],
        [a.o_proj for a in fused.attentions],
        [mlp.gate_up for mlp in fused.mlps],
        [mlp.down for mlp in fused.mlps],
    ]


def _linears(fused) -> list:
    return [m for kind in _projections(fused) for m in kind]


def _group_layout(linear) -> tuple[GroupQuantWeight, torch.Tensor | None] | None:
    """The file's integers (which all of gemm_group.c's kernels read) with the bias, where
    `linear` holds them."""
    return next((wb for wb in linear.layouts.values() if isinstance(wb[0], GroupQuantWeight)), None)


def _kernel(fused) -> str | None:
    """The kernels decoder.c runs the linears with: gemm_group.c's (GROUP) where every
    linear holds group-quantized weights, gemm_int8.c's where every linear has int8
    weights (an fp32 model), else gemm.c's where every linear has its layout."""
    linears = _linears(fused)
    if all(_group_layout(m) is not None for m in linears):
        return GROUP
    candidates = (INT8_GEMM_C, GEMM_C) if fused.norm.weight.dtype == torch.float32 else (GEMM_C,)
    return next((k for k in candidates if all(m.layout(k) is not None for m in linears)), None)


def _packed(name: str, linear, kernel: str) -> dict:
    weight, bias = _group_layout(linear) if kernel == GROUP else linear.layout(kernel)
    if isinstance(weight, GroupQuantWeight):
        return {name: weight.qs, f"{name}_bias": bias, f"{name}_group": weight}
    if isinstance(weight, Int8Weight):
        return {name: weight.weight, f"{name}_bias": bias, f"{name}_scale": weight.scale}
    return {name: weight, f"{name}_bias": bias}


def _pointer(value):
    """A DecoderLayer field's value: a tensor's address, or a GroupWeight of a group weight's."""
    if isinstance(value, GroupQuantWeight):
        return value.struct()
    return None if value is None else value.data_ptr()
