"""A GGUF file's quantized weights as kvserve runs them natively (quantization="gguf"):
each linear's blocks read from the file and repacked once into group_quant's layout, the
integers as the file has them.

GGUF type -> what its blocks become (w = scale * q + min, per group):
- Q4_0, Q4_1: 4 bits, groups of 32 (the same nibble order, so the bytes are kept);
- Q4_K: 4 bits, groups of 32 (each sub-block's 6-bit scale and min multiplied out);
- Q5_0, Q5_1, Q5_K, Q8_0: int8, groups of 32; Q6_K: int8, groups of 16.
A K-quant's scale d * sc is rounded to fp16 (at most 2^-11 of it); every other format's
scales are the file's fp16 values, so those weights dequantize bit for bit as the file's.
Tensors of other types (F16, BF16, F32, Q2_K, Q3_K, the IQ formats) stay as transformers
dequantized them.

transformers loads the same file for the model's structure (model_loader.convert_gguf);
the linears then get their blocks here. Its loader permutes the rows of a Llama's q and k
projections back from the converter's rotary order; which permutation a tensor's rows
need is found by comparing its blocks, dequantized, with the weight transformers loaded,
and a tensor that matches neither is left dense, with a warning."""

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from replica.cpu.group_quant import GroupQuantWeight, from_integers

logger = logging.getLogger(__name__)

QK = 32  # elements of a Q4_0 ... Q8_0 block
QK_K = 256  # of a K-quant super-block
# How far a repacked tensor, dequantized, may be from transformers' weight (of its largest
# |w|): bf16 rounding and fp16 K-quant scales stay far under it; a wrong row order does not.
MATCH_TOLERANCE = 1e-2


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's 12 bytes -> the 6-bit scales and mins of its 8 sub-blocks."""
    s = packed.astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits."""
    return (np.ascontiguousarray(qh).view(np.uint32)[..., :1] >> np.arange(32, dtype=np.uint32)) & 1


def decode(kind: str, raw: np.ndarray, n: int, k: int) -> GroupQuantWeight:
    """A tensor's raw blocks (uint8 [n, bytes per row]) of GGUF type `kind` -> its weight."""
    rows = raw.reshape(n, -1)
    if kind in ("Q4_0", "Q4_1"):
        width = 18 if kind == "Q4_0" else 20
        b = rows.reshape(n, k // QK, width)
        d = _f16(b[..., 0:2])
        low = -8 * d if kind == "Q4_0" else _f16(b[..., 2:4])
        qs = torch.from_numpy(np.ascontiguousarray(b[..., width - 16 :]).reshape(n, k // 2))
        half = lambda a: torch.from_numpy(a).to(torch.float16)  # noqa: E731
        return GroupQuantWeight(qs, half(d), half(low), 4, QK)
    if kind == "Q8_0":
        b = rows.reshape(n, k // QK, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        return _weight(q, _f16(b[..., 0:2]), None, 8, QK)
    if kind in ("Q5_0", "Q5_1"):
        width = 22 if kind == "Q5_0" else 24
        b = rows.reshape(n, k // QK, width)
        d = _f16(b[..., 0:2])
        q = _nibbles(b[..., width - 16 :]).astype(np.int32) | (
            _high_bits(b[..., width - 20 : width - 16]) << 4
        )
        if kind == "Q5_0":
            return _weight((q - 16).reshape(n, k), d, None, 8, QK)
        return _weight(q.reshape(n, k), d, _f16(b[..., 2:4]), 8, QK)
    if kind in ("Q4_K", "Q5_K"):
        width = 144 if kind == "Q4_K" else 176
        b = rows.reshape(n, k // QK_K, width)
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., width - 128 :].reshape(n, k // QK_K, 4, 32)
        # Sub-blocks 2c and 2c + 1 are chunk c's low and high nibbles.
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).astype(np.int32)  # [n, supers, 4, 2, 32]
        if kind == "Q5_K":
            qh = b[..., 16:48][:, :, None, :]  # bit j of byte l: element l of sub-block j
            bits = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, supers, 8, 32]
            q |= bits.reshape(n, k // QK_K, 4, 2, 32).astype(np.int32) << 4
        q = q.reshape(n, k)
        return _weight(
            q, (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1), 4 if kind == "Q4_K" else 8, QK
        )
    if kind == "Q6_K":
        b = rows.reshape(n, k // QK_K, 210)
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])[..., None]
        # Each 128-element half: 4 runs of 32, from ql's two 32-byte rows' nibbles and qh's
        # 2-bit fields.
        low = np.stack(
            [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3
        )
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
        q = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
        return _weight(q.reshape(n, k), (d * sc).reshape(n, -1), None, 8, 16)
    raise ValueError(f"GGUF type {kind} is not run natively")


NATIVE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def _weight(q, scales, mins, bits: int, group: int) -> GroupQuantWeight:
    t = torch.from_numpy
    return from_integers(
        t(np.ascontiguousarray(q)), t(scales), None if mins is None else t(mins), bits, group
    )


def _llama_rows(n: int, heads: int) -> torch.Tensor:
    """The row order transformers' GGUF loader gives a Llama q or k projection of n rows
    (it undoes the converter's interleaving of each head's rotary halves)."""
    index = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2)
    return index.reshape(n)


def _matches(weight: GroupQuantWeight, dense: torch.Tensor) -> bool:
    ours = weight.dequantize(torch.float32)
    scale = dense.abs().max().float().clamp_min(torch.finfo(torch.float32).tiny)
    return bool((ours - dense.float()).abs().max() <= MATCH_TOLERANCE * scale)


def _rows(weight: GroupQuantWeight, order: torch.Tensor) -> GroupQuantWeight:
    mins = None if weight.mins is None else weight.mins[order].contiguous()
    return GroupQuantWeight(
        weight.qs[order].contiguous(), weight.scales[order].contiguous(), mins, weight.bits, weight.group
    )


def attach_gguf_weights(model: nn.Module, gguf_path: Path) -> dict[str, str]:
    """Gives each linear of `model` (loaded from gguf_path by transformers) whose tensor the
    file holds in a NATIVE_TYPES type that tensor's blocks as `group_weight`, which
    PackedLinear multiplies; the token embeddings become a GroupQuantEmbedding of theirs
    (shared with a tied lm_head). Returns {gguf type: how many tensors} of what it kept."""
    import gguf

    from replica.cpu.layers import GroupQuantEmbedding

    reader = gguf.GGUFReader(str(gguf_path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    hf = model.config
    names = gguf.get_tensor_name_map(arch, hf.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    heads = {"q_proj": hf.num_attention_heads, "k_proj": getattr(hf, "num_key_value_heads", None)}
    kept: dict[str, str] = {}
    cache: dict[str, GroupQuantWeight | None] = {}

    def blocks(name: str, dense: torch.Tensor, module_name: str) -> GroupQuantWeight | None:
        if name in cache:
            return cache[name]
        tensor = tensors.get(name)
        weight = None
        if tensor is not None and tensor.tensor_type.name in NATIVE_TYPES:
            k, n = (int(x) for x in tensor.shape[:2])
            weight = decode(tensor.tensor_type.name, np.asarray(tensor.data), n, k)
            count = heads.get(module_name.rsplit(".", 1)[-1])
            orders = [None] + ([_llama_rows(n, count)] if count and n % (2 * count) == 0 else [])
            weight = next(
                (
                    w
                    for w in (weight if o is None else _rows(weight, o) for o in orders)
                    if _matches(w, dense)
                ),
                None,
            )
            if weight is None:
                logger.warning("%s: its GGUF blocks do not match the loaded weight; it stays dense", name)
            else:
                kept[tensor.tensor_type.name] = kept.get(tensor.tensor_type.name, 0) + 1
        cache[name] = weight
        return weight

    embed = model.get_input_embeddings()
    embed_weight = blocks("token_embd.weight", embed.weight.detach(), "embed_tokens")
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is model.get_output_embeddings():
            name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        else:
            name = names.get_name(f"{module_name}.weight", try_suffixes=(".weight",))
        weight = blocks(name, module.weight.detach(), module_name) if name else None
        if weight is not None:
            module.group_weight = weight
    if embed_weight is not None:
        model.set_input_embeddings(GroupQuantEmbedding(embed_weight, embed.weight.dtype))
    return kept
