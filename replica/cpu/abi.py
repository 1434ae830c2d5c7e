"""ctypes mirrors of the structs kvserve_abi.h declares, field for field and in its order.

build.py binds the library's functions with them and, when it loads the library,
compares their sizes with the ones the compiler gives (kvserve_*_size), so that a
field added on one side only fails there rather than as wrong memory reads."""

import ctypes

_ptr, _i64, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class StepLayout(ctypes.Structure):
    """One packed step's attention layout, shared by every layer (ops.step_layout builds it)."""

    _fields_ = [
        ("slots", _ptr), ("num_tokens", _i64),
        ("decode_tables", _ptr), ("decode_lens", _ptr),
        ("prefill_starts", _ptr), ("prefill_ends", _ptr), ("prefill_lens", _ptr), ("prefill_tables", _ptr),
        ("num_decodes", _int), ("decode_width", _int), ("num_prefills", _int), ("prefill_width", _int),
    ]  # fmt: skip


class GroupWeight(ctypes.Structure):
    """A group-quantized weight's tensors and format (group_quant.GroupQuantWeight)."""

    _fields_ = [("qs", _ptr), ("scales", _ptr), ("mins", _ptr), ("group", _int), ("bits", _int)]


class DecoderLayer(ctypes.Structure):
    """One decoder layer's packed weights and KV cache (with its fp8 scales), for decoder_forward."""

    _fields_ = [
        *((name, _ptr)
          for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
                       "down", "down_bias", "qkv_scale", "o_scale", "gate_up_scale", "down_scale")),
        *((name, GroupWeight) for name in ("qkv_group", "o_group", "gate_up_group", "down_group")),
        ("k_cache", _ptr), ("v_cache", _ptr),
        ("k_scale", _float), ("v_scale", _float),
    ]  # fmt: skip


class DecoderShape(ctypes.Structure):
    """The model's shapes, for decoder_forward."""

    _fields_ = [
        *((name, _int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                    "intermediate", "block_size", "is_bf16", "is_int8", "is_group",
                                    "kv_format")),
        ("group_kernels", _int * 4),
        ("eps", _float), ("scale", _float), ("final_norm", _ptr),
    ]  # fmt: skip


# Each struct and the library function that returns its size in C.
SIZE_FUNCTIONS = {
    StepLayout: "kvserve_step_layout_size",
    DecoderLayer: "kvserve_decoder_layer_size",
    DecoderShape: "kvserve_decoder_shape_size",
}
