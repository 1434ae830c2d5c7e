"""Tensor-level wrappers around the compiled CPU kernels (kernels.c, sampling.c, attention.c, gemm.c).

Each wrapper checks what the C code assumes (CPU, fp32 or bf16, unit stride in the last
dimension) and passes raw pointers. ctypes releases the GIL for the call.
"""

import torch
import torch.nn.functional as F

from replica.attention.metadata import AttentionMetadata
from replica.cpu.abi import StepLayout
from replica.cpu.build import load_library
from replica.kv_quant import UNIT_SCALE, KVScale, as_cached

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# A cache dtype's kv_format in attention.c (kvserve_abi.h's KV_*) beside activations of
# another dtype; a cache in the activations' dtype is format 0.
KV_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.bfloat16: 3}


def kv_format(cache_dtype: torch.dtype, dtype: torch.dtype) -> int:
    return 0 if cache_dtype == dtype else KV_FORMATS[cache_dtype]


# Whether torch's SDPA, rather than the C kernel, attends fresh prefills (nothing cached
# before them): SDPA's tiled kernel wins on some CPUs (those with AMX) and loses on others,
# so the model load sets it from a measurement on this machine (kernel_choice.py).
FRESH_PREFILLS_BY_SDPA = False


def _is_bf16(t: torch.Tensor) -> int:
    if t.dtype not in SUPPORTED_DTYPES or t.device.type != "cpu":
        raise ValueError(f"CPU kernels take float32 or bfloat16 CPU tensors, got {t.dtype} on {t.device}")
    return int(t.dtype == torch.bfloat16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x; with `residual`, first residual += x (in place), then the norm of
    the sum: the decoder layer's skip connection and the next norm in one pass."""
    x = x.contiguous()
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
        raise ValueError("residual must be contiguous and shaped like x")
    out = torch.empty_like(x)
    n = x.shape[-1]
    load_library().rms_norm(
        out.data_ptr(), x.data_ptr(), _ptr(residual), weight.data_ptr(), x.numel() // n, n, eps, _is_bf16(x),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2n] (gate first) -> [..., n]."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], n))
    load_library().silu_mul(
        out.data_ptr(), gate_up.data_ptr(), gate_up.numel() // (2 * n), n, _is_bf16(gate_up),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def bf16_gemm_available() -> bool:
    """gemm.c's kernel needs AVX512-BF16 (vdpbf16ps) and is compiled for this CPU."""
    return bool(load_library().bf16_gemm_available())


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [n, k] weight in gemm_bf16's panel layout (a flat bf16 tensor)."""
    if weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        raise ValueError("gemm_bf16 takes a bf16 weight with an even number of columns")
    lib = load_library()
    return _packed(weight, lib.packed_bf16_weight_elements, lib.pack_bf16_weight)


def _packed(weight: torch.Tensor, num_elements, pack) -> torch.Tensor:
    """weight [n, k] in a gemm.c panel layout: num_elements(n, k) is its size, pack the
    C function that lays it out."""
    weight = weight.detach().contiguous()
    n, k = weight.shape
    packed = torch.empty(num_elements(n, k), dtype=weight.dtype)
    pack(packed.data_ptr(), weight.data_ptr(), n, k)
    return packed


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, group: int) -> torch.Tensor:
    """Gate and up rows (weights [n, k] or biases [n]) in the order gemm.c's gated panels
    read them: `group` gate rows, then the `group` matching up rows, and so on, each
    zero-padded to a multiple of `group` rows (16 for gemm_bf16, 8 for gemm_f32)."""
    n = gate.shape[0]
    padded = -(-n // group) * group

    def groups(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros((padded - n, *t.shape[1:]))])
        return t.view(padded // group, group, *t.shape[1:])

    return torch.stack([groups(gate), groups(up)], dim=1).reshape(2 * padded, *gate.shape[1:])


def gemm_bf16(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, gated: bool = False
) -> torch.Tensor:
    """x [rows, k] bf16 times the weight packed by pack_bf16_weight, plus bias: [rows, n].
    gated: the weight is interleave_gate_up's, and the result silu(gate) * up [rows, n]."""
    x = x.contiguous()
    rows, k = x.shape
    out = x.new_empty((rows, n))
    load_library().gemm_bf16(
        out.data_ptr(), x.data_ptr(), packed.data_ptr(), _ptr(bias), rows, n, k, int(gated),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def f32_gemm_available() -> bool:
    """gemm.c's fp32 kernel needs AVX2 and FMA, and is compiled for this CPU."""
    return bool(load_library().f32_gemm_available())


def pack_f32_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 [n, k] weight in gemm_f32's panel layout (a flat fp32 tensor)."""
    if weight.dtype != torch.float32:
        raise ValueError("gemm_f32 takes an fp32 weight")
    lib = load_library()
    return _packed(weight, lib.packed_f32_weight_elements, lib.pack_f32_weight)


def gemm_f32(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, gated: bool = False
) -> torch.Tensor:
    """x [rows, k] fp32 times the weight packed by pack_f32_weight, plus bias: [rows, n].
    gated: the weight (and bias) is interleave_gate_up's in groups of 8, and the result
    silu(gate) * up [rows, n]."""
    x = x.contiguous()
    rows, k = x.shape
    out = x.new_empty((rows, n))
    load_library().gemm_f32(
        out.data_ptr(), x.data_ptr(), packed.data_ptr(), _ptr(bias), rows, n, k, int(gated),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for a 2-D CPU tensor, without widening bf16 first."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    load_library().argmax_rows(
        out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], _is_bf16(x), torch.get_num_threads()
    )
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    draws: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens drawn by inverse CDF from softmax(logits / temperature), one uniform draw in
    [0, 1) per row; argmax where the temperature is 0. A row with top_k (V or more: none),
    top_p (1: none) or min_p (0: none) draws by rank among its kept tokens, as
    sampler.py's candidates do. logits: [B, V] fp32 or bf16."""
    logits = logits.contiguous()
    inv_temperature = torch.where(temperature > 0, 1.0 / temperature.clamp_min(1e-5), 0.0)
    inv_temperature = inv_temperature.float().contiguous()
    draws = draws.reshape(-1).float().contiguous()
    top_k = None if top_k is None else top_k.to(torch.int64).contiguous()
    top_p, min_p = (None if t is None else t.float().contiguous() for t in (top_p, min_p))
    out = torch.empty(logits.shape[0], dtype=torch.long)
    load_library().sample_rows(
        out.data_ptr(), logits.data_ptr(), inv_temperature.data_ptr(), _ptr(top_k), _ptr(top_p), _ptr(min_p),
        draws.data_ptr(), logits.shape[0], logits.shape[1], _is_bf16(logits),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D], contiguous, q's dtype or fp8
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    cos: torch.Tensor | None = None,  # [T, D]: apply the rotary embedding to q and k first
    sin: torch.Tensor | None = None,
    kv_scale: KVScale = UNIT_SCALE,  # an fp8 cache's (replica/kv_quant.py)
) -> torch.Tensor:
    """Write this step's K/V (rotated when cos/sin are given) into the paged cache, then
    attend every query row causally over its sequence's cache. Returns [T, H, D].

    Decode rows and chunks after cached tokens go through the C kernel. So do fresh
    prefills (nothing cached before them), unless torch's SDPA measured faster at them on
    this machine: then it attends them from q, k and v directly (FRESH_PREFILLS_BY_SDPA),
    rounded as an fp8 cache holds them.

    Called once per layer per step, so it checks only what a layer could get wrong; the
    step's metadata becomes the kernel's StepLayout once, on the first layer."""
    num_tokens, num_heads, head_dim = q.shape
    if (
        q.stride(2) != 1
        or k.stride(2) != 1
        or v.stride(2) != 1
        or not k.dtype == v.dtype == q.dtype
        or not k_cache.dtype == v_cache.dtype
        or (k_cache.dtype != q.dtype and k_cache.dtype not in KV_FORMATS)
    ):
        raise ValueError(
            "q, k, v and the KV cache need one dtype (or an fp8 cache, or a bf16 one beside fp32) "
            "and a contiguous last dimension"
        )
    if cos is not None and not (cos.dtype == q.dtype and cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.to(q.dtype).contiguous(), sin.to(q.dtype).contiguous()
    out = q.new_empty((num_tokens, num_heads, head_dim))
    layout, fresh_runs = step_layout(meta)
    load_library().paged_attention(
        out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        _ptr(cos), _ptr(sin), k_cache.data_ptr(), v_cache.data_ptr(), layout,
        num_heads, k_cache.shape[1], head_dim, k_cache.shape[2], scale, _is_bf16(q),
        kv_format(k_cache.dtype, q.dtype), kv_scale.k, kv_scale.v, torch.get_num_threads(),
    )  # fmt: skip
    for start, end, length in fresh_runs:
        _attend_fresh(
            out, q[start:end], k[start:end], v[start:end], length, scale, cos, sin, start,
            k_cache.dtype, kv_scale,
        )  # fmt: skip
    return out


def _attend_fresh(
    out, q, k, v, length: int, scale: float, cos, sin, start: int, cache_dtype: torch.dtype, kv_scale: KVScale
) -> None:
    """Causal SDPA over a run of fresh prefill chunks of `length` rows each, starting at
    packed row `start`, into out. Over a cache of another dtype (fp8, or bf16 beside fp32)
    it attends K and V as the cache holds them, as the kernel and every later step do."""
    end = start + q.shape[0]
    if cos is not None:
        q, k = (
            rotary_embed(q, cos[start:end], sin[start:end]),
            rotary_embed(k, cos[start:end], sin[start:end]),
        )
    k, v = as_cached(k, kv_scale.k, cache_dtype), as_cached(v, kv_scale.v, cache_dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]

    def batched(x: torch.Tensor) -> torch.Tensor:  # [B * L, heads, D] -> [B, heads, L, D]
        return x.view(-1, length, x.shape[1], head_dim).transpose(1, 2)

    attended = F.scaled_dot_product_attention(
        batched(q), batched(k), batched(v), is_causal=True, scale=scale, enable_gqa=num_heads != k.shape[1]
    )
    out[start:end].view(-1, length, num_heads, head_dim).copy_(attended.transpose(1, 2))


def rotary_embed(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any strides, last one 1) rotated, as transformers rounds it;
    cos/sin: contiguous [T, D] of x's dtype. Returns a contiguous tensor."""
    out = torch.empty(x.shape, dtype=x.dtype)
    load_library().rotary_embed(
        out.data_ptr(), x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
        x.shape[0], x.shape[1], x.shape[2], _is_bf16(x), torch.get_num_threads(),
    )  # fmt: skip
    return out


def step_layout(meta: AttentionMetadata) -> tuple[StepLayout, list[tuple[int, int, int]]]:
    """The metadata as the kernel's StepLayout (slots, decode rows, the prefill chunks it
    attends), and the fresh prefills SDPA attends as runs of equal-length chunks (first
    row, end row, chunk length), each one batched SDPA call. Built on a step's first
    layer and reused by the others, and by decoder.c's whole-step loop."""
    if meta.kernel_args is None:
        by_kernel = [not FRESH_PREFILLS_BY_SDPA or c.block_table is not None for c in meta.prefills]
        kernel_chunks = [i for i, kernel in enumerate(by_kernel) if kernel]
        fresh_runs: list[tuple[int, int, int]] = []
        for chunk, kernel in zip(meta.prefills, by_kernel, strict=True):
            if kernel:
                continue
            length = chunk.end - chunk.start
            if fresh_runs and fresh_runs[-1][1] == chunk.start and fresh_runs[-1][2] == length:
                fresh_runs[-1] = (fresh_runs[-1][0], chunk.end, length)
            else:
                fresh_runs.append((chunk.start, chunk.end, length))
        decode_tables = meta.decode_block_tables
        layout = StepLayout(
            slots=meta.slot_mapping.data_ptr(),
            num_tokens=meta.slot_mapping.shape[0],
            decode_tables=_ptr(decode_tables),
            decode_lens=_ptr(meta.decode_context_lens),
            num_decodes=meta.num_decodes,
            decode_width=0 if decode_tables is None else decode_tables.shape[1],
        )
        prefill_arrays: tuple = ()
        if kernel_chunks:
            index = torch.tensor(kernel_chunks)
            starts = meta.prefill_query_starts
            prefill_arrays = (
                starts[:-1][index].contiguous(), starts[1:][index].contiguous(),
                meta.prefill_context_lens[index].contiguous(), meta.prefill_block_tables[index].contiguous(),
            )  # fmt: skip
            layout.prefill_starts, layout.prefill_ends, layout.prefill_lens, layout.prefill_tables = (
                a.data_ptr() for a in prefill_arrays
            )
            layout.num_prefills = len(kernel_chunks)
            layout.prefill_width = meta.prefill_block_tables.shape[1]
        # The arrays ride along: the layout's pointers point into them.
        meta.kernel_args = (layout, fresh_runs, prefill_arrays)
    return meta.kernel_args[:2]
