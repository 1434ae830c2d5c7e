"""decoder.c's whole-step loop for FusedDecoder: ctypes mirrors of its structs, the
layers' weight pointers gathered once, and the KV cache's once per cache.

It runs where every linear is packed for gemm.c's bf16 kernel and the layers have no
parts it lacks (tensor-parallel reductions, Qwen3's q/k norms), and only in steps whose
attention the C kernel does entirely (not fresh prefills that go to SDPA on AMX CPUs).
Anywhere else FusedDecoder's Python loop runs the same kernels."""

import ctypes

import torch

from replica.attention.context import get_forward_context
from replica.cpu import ops
from replica.cpu.build import load_library

_ptr = ctypes.c_void_p
_WEIGHTS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
            "down", "down_bias")  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in (*_WEIGHTS, "k_cache", "v_cache")]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                            "intermediate", "block_size")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", _ptr),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    """paged_attention's step arguments, in ops.step_arguments' order."""

    _fields_ = [
        ("slots", _ptr), ("num_tokens", ctypes.c_int64),
        ("num_decodes", ctypes.c_int), ("decode_tables", _ptr), ("decode_width", ctypes.c_int),
        ("decode_lens", _ptr), ("num_prefills", ctypes.c_int),
        ("prefill_starts", _ptr), ("prefill_ends", _ptr), ("prefill_lens", _ptr), ("prefill_tables", _ptr),
        ("prefill_width", ctypes.c_int),
    ]  # fmt: skip


def _declare(lib: ctypes.CDLL) -> None:
    lib.decoder_forward.argtypes = [_ptr] * 7 + [ctypes.c_int64, _ptr, _ptr, ctypes.c_int]
    lib.decoder_forward.restype = None
    lib.decoder_scratch_elements.argtypes = [_ptr, ctypes.c_int64]
    lib.decoder_scratch_elements.restype = ctypes.c_int64


class NativeDecoder:
    def __init__(self, fused):
        """fused: a FusedDecoder that `supports`."""
        attention, mlp = fused.attentions[0], fused.mlps[0]
        self.hidden = fused.norm.weight.shape[0]
        self.block_size = None  # from the KV cache, with the layers' cache pointers
        self._shape_args = dict(
            num_layers=len(fused.attentions),
            hidden=self.hidden,
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            intermediate=mlp.gate_up.out_features,
            eps=fused.norm.eps,
            scale=attention.scaling,
            final_norm=fused.norm.weight.data_ptr(),
        )
        self._weights = [
            dict(
                input_norm=norm_in.weight,
                post_norm=norm_post.weight,
                qkv=attn.qkv.packed,
                qkv_bias=attn.qkv.bias,
                o=attn.o_proj.packed,
                o_bias=attn.o_proj.bias,
                gate_up=mlp.gate_up.packed,
                gate_up_bias=mlp.gate_up.bias,
                down=mlp.down.packed,
                down_bias=mlp.down.bias,
            )  # fmt: skip
            for norm_in, attn, norm_post, mlp in zip(
                fused.input_norms, fused.attentions, fused.post_norms, fused.mlps, strict=True
            )
        ]
        self._layers, self._caches_seen = None, None
        self._scratch = torch.empty(0, dtype=torch.bfloat16)
        self._lib = load_library()
        _declare(self._lib)

    @staticmethod
    def supports(fused) -> bool:
        linears = [m for a in fused.attentions for m in (a.qkv, a.o_proj)]
        linears += [m for mlp in fused.mlps for m in (mlp.gate_up, mlp.down)]
        norms = [*fused.input_norms, *fused.post_norms, fused.norm]
        if not fused.attentions:
            return False
        first = fused.attentions[0]
        return (
            all(m.own_kernel and m.group is None for m in linears)
            and all(a.q_norm is None and a.k_norm is None for a in fused.attentions)
            and all(n.weight.dtype == torch.bfloat16 and n.eps == fused.norm.eps for n in norms)
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
        None where this step's attention needs the Python loop."""
        ctx = get_forward_context()
        kernel_args, fresh_runs = ops.step_arguments(ctx.metadata)
        if fresh_runs:
            return None
        shape = self._bind(ctx.kv_caches)
        num_tokens = residual.shape[0]
        needed = self._lib.decoder_scratch_elements(ctypes.byref(shape), num_tokens)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.bfloat16)
        num_rows = -1 if rows is None else rows.shape[0]  # -1: every row
        out = residual.new_empty((num_tokens if rows is None else num_rows, self.hidden))
        cos, sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        self._lib.decoder_forward(
            ctypes.byref(shape), self._layers, ctypes.byref(_Step(*kernel_args)), residual.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), rows.data_ptr() if num_rows > 0 else None, num_rows,
            out.data_ptr(), self._scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> _Shape:
        """The layers' struct array with this KV cache, rebuilt when the cache changes."""
        caches = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        if caches != self._caches_seen:
            self._layers = (_Layer * len(self._weights))(
                *(
                    _Layer(
                        **{name: None if t is None else t.data_ptr() for name, t in weights.items()},
                        k_cache=k,
                        v_cache=v,
                    )  # fmt: skip
                    for weights, (k, v) in zip(self._weights, caches, strict=True)
                )
            )
            self._caches_seen, self.block_size = caches, kv_caches[0][0].shape[2]
        return _Shape(**self._shape_args, block_size=self.block_size)
