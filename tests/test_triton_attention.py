"""The Triton paged-attention kernels against the torch backend and dense causal attention.

On CPU they run under TRITON_INTERPRET=1 at small shapes (the kernels' math and indexing:
block sizes, GQA groups, ragged lengths, split-K, prefix hits, chunked prefill); on a GPU
the same tests run compiled, plus real shapes and CUDA-graph capture.

Tolerances, against an fp32 dense reference on the same (rounded) inputs:
- fp32: atol/rtol 1e-4 (only summation order differs; dots run in IEEE fp32, not TF32);
- bf16: atol/rtol 2e-2 (probabilities are rounded to bf16 before the P @ V dot, as in
  FlashAttention; outputs are rounded to bf16);
- fp16: atol/rtol 2e-3;
- the KV write is exact, fp8 included: the bytes are replica/kv_quant.py's, computed on the
  CPU (torch on CUDA divides by a scalar as a multiply by its reciprocal, which can round
  differently);
- with an fp8 cache the reference attends the dequantized keys and values (what the cache
  holds), under the same tolerances.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # triton.jit picks compiled or interpreted when a function is defined, triton's own
    # library included, so this has to come before anything imports triton.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set: tests/conftest.py must set it"
            " (on machines without CUDA) before any test module imports transformers"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip(
    "triton", reason="triton is not installed: pip install -e '.[triton]'", exc_type=ImportError
)

from replica.attention import ForwardContext, build_metadata, forward_context  # noqa: E402
from replica.attention.torch_backend import (  # noqa: E402
    decode_attention,
    kv_cache_shape,
    torch_paged_attention,
    write_kv,
)
from replica.attention.triton_backend import triton_paged_attention  # noqa: E402
from replica.attention.triton_decode import choose_num_splits, paged_decode  # noqa: E402
from replica.attention.triton_prefill import paged_prefill  # noqa: E402
from replica.attention.triton_write import write_kv_triton  # noqa: E402
from replica.kv_quant import FP8_MAX, UNIT_SCALE, KVScale, dequantize_kv, quantize_kv  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: real shapes and CUDA graphs")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Not powers of two, so dividing by them rounds; K and V differ, so a swap would show.
FP8_SCALE = KVScale(0.037, 0.021)


@pytest.fixture(autouse=True)
def _bf16_dot_in_interpreter(monkeypatch):
    """triton's interpreter (3.9) runs tl.dot with numpy on bf16's raw uint16 storage, which
    gives garbage; loads, stores and casts of bf16 are fine. Widen bf16 dot operands to
    fp32 (exact), which is what the tensor cores compute (bf16 products, fp32 sums), so the
    kernels' bf16 paths are still tested on CPU. Compiled kernels are untouched."""
    if not INTERPRET:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype.is_bf16():
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    def create_dot(self, a, b, *args, **kwargs):
        return original(self, widen(a), widen(b), *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


class _Layer(torch.nn.Module):
    layer_idx = 0


def dense_reference(q, k, v, scale):
    """q [Tq, H, D] are the last Tq positions of k/v [Tk, Hkv, D]; causal, in fp32."""
    tq, h, _ = q.shape
    tk, hkv, _ = k.shape
    q, k, v = q.float(), k.float().repeat_interleave(h // hkv, 1), v.float().repeat_interleave(h // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(tk, device=q.device)
    allowed = pos[None, :] <= torch.arange(tk - tq, tk, device=q.device)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fill_cache(
    lengths, block_size, kv_heads, head_dim, dtype, gen, spare_blocks=3, cache_dtype=None, kv_scale=UNIT_SCALE
):
    """Sequences of the given lengths, fully written into scattered cache blocks (of
    cache_dtype, default dtype). Returns (k_cache, v_cache, per-sequence block lists,
    per-sequence [L, Hkv, D] K and V as the cache holds them, dequantized to fp32 if fp8)."""
    num_blocks = sum(-(-n // block_size) for n in lengths) + spare_blocks
    k_cache = torch.zeros(
        kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), dtype=cache_dtype or dtype, device=DEVICE
    )
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values = [], [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(n)], device=DEVICE
        )
        write_kv(k_cache, v_cache, k, v, slots, kv_scale)
        if k_cache.dtype != dtype:
            blocks, offsets = slots // block_size, slots % block_size
            k = dequantize_kv(k_cache[blocks, :, offsets], kv_scale.k, torch.float32)
            v = dequantize_kv(v_cache[blocks, :, offsets], kv_scale.v, torch.float32)
        tables.append(table)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, tables, keys, values


def padded(tables, dtype=torch.long):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype, device=DEVICE)


# ---- KV write ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads, head_dim", [(1, 16), (3, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_torch(block_size, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(block_size * 10 + kv_heads)
    num_blocks, t = 16, 13
    k_cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
    k_cache = k_cache.to(dtype=dtype, device=DEVICE)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(DEVICE)
    # [1, Hkv, T, D] -> [T, Hkv, D] views, as transformers hands them over: not contiguous.
    k = torch.randn(1, kv_heads, t, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)[0].transpose(0, 1)
    v = torch.randn(1, kv_heads, t, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)[0].transpose(0, 1)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, k, v, slots)
    write_kv_triton(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def fp8_write_inputs(cache_dtype, scale):
    """[N] fp32 values that, divided by scale, exercise every rounding case: each finite fp8
    value, each midpoint between neighbours (a tie) and the fp32 values around it (where a
    division rounded differently, say as a multiply by 1 / scale, lands on the other side),
    subnormals, random values, and ones past the format's range (saturated), inf, NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(cache_dtype).double()
    grid = grid[grid.isfinite()].unique()  # sorted, -0 folded into 0
    mids = ((grid[1:] + grid[:-1]) / 2 * scale).float()
    inf = torch.tensor(float("inf"))
    up = down = mids
    near = [mids]
    for _ in range(3):
        up, down = up.nextafter(inf), down.nextafter(-inf)
        near += [up, down]
    limit = FP8_MAX[cache_dtype]
    gen = torch.Generator().manual_seed(0)
    extremes = torch.tensor([1.01, 1.5, 1e30, float("inf"), float("nan"), 1e-40, 0.0]) * limit * scale
    noise = torch.randn(512, generator=gen) * limit * scale / 8
    values = [(grid * scale).float(), *near, noise, extremes, -extremes, torch.tensor([-0.0, 1e-40])]
    return torch.cat(values)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 0.473: its fp32 reciprocal is among the worst rounded, so multiplying by 1 / scale
# instead of dividing writes different bytes near ties.
@pytest.mark.parametrize("scale", [1.0, 0.037, 0.473])
def test_write_kv_fp8_bytes_match_kv_quant(cache_dtype, dtype, scale):
    """Bit for bit the bytes replica/kv_quant.py stores (on the CPU: see the module docstring)."""
    kv_heads, head_dim, block_size = 4, 64, 4
    x = fp8_write_inputs(cache_dtype, scale).to(dtype)
    x = torch.cat([x, x.new_zeros(-x.numel() % (kv_heads * head_dim))]).view(-1, kv_heads, head_dim)
    t = x.shape[0]
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(t * block_size, generator=gen)[:t]
    k_cache = torch.zeros(kv_cache_shape(t, block_size, kv_heads, head_dim), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kv_scale = KVScale(scale, 2 * scale)
    write_kv_triton(k_cache, v_cache, x.to(DEVICE), x.flip(0).to(DEVICE), slots.to(DEVICE), kv_scale)
    blocks, offsets = slots // block_size, slots % block_size
    for cache, values, s in ((k_cache, x, kv_scale.k), (v_cache, x.flip(0), kv_scale.v)):
        written = cache.cpu()[blocks, :, offsets].view(torch.uint8)
        expected = quantize_kv(values, s, cache_dtype).view(torch.uint8)
        assert torch.equal(written, expected), (
            values[written != expected][:8],
            written[written != expected][:8],
        )


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(kv_cache_shape(4, 4, 2, 16), device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 2, 16, device=DEVICE)
    write_kv_triton(k_cache, v_cache, k, k, torch.tensor([5, -1, 0], device=DEVICE))
    assert k_cache.sum() == 2 * 2 * 16 and k_cache[1, :, 1].eq(1).all() and k_cache[0, :, 0].eq(1).all()


# ---- decode --------------------------------------------------------------------------------


def check_decode(
    lengths,
    block_size,
    heads,
    kv_heads,
    head_dim,
    dtype,
    num_splits,
    seed,
    cache_dtype=None,
    kv_scale=UNIT_SCALE,
):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, keys, values = fill_cache(
        lengths, block_size, kv_heads, head_dim, dtype, gen, cache_dtype=cache_dtype, kv_scale=kv_scale
    )
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    block_tables = padded(tables)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits, kv_scale=kv_scale
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i in range(len(lengths)):
        expected = dense_reference(q[i : i + 1], keys[i], values[i], scale)[0]
        torch.testing.assert_close(out[i].float(), expected, **TOL[dtype])
    if dtype == torch.float32:  # and the torch backend's own decode path
        positions = torch.arange(block_tables.shape[1] * block_size, device=DEVICE)
        mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
        expected = decode_attention(q, k_cache, v_cache, block_tables, mask, scale, kv_scale)
        torch.testing.assert_close(out, expected, **TOL[dtype])


# Every block size and every split count, each split count with a small and a large block
# (a split's end then falls inside a block and on a block's edge), not their whole product.
@pytest.mark.parametrize("block_size, num_splits", [(4, 3), (8, 8), (16, 1), (16, 8), (16, 3)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(block_size, heads, kv_heads, dtype, num_splits):
    # Ragged: a 1-token context, one inside a tile, several tiles; with 3 or 8 splits the
    # long rows really split and the short ones leave trailing splits empty.
    check_decode(
        [1, 17, 75, 130], block_size, heads, kv_heads, 16, dtype, num_splits, seed=block_size + heads
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_default_splits_and_odd_head_dim(dtype):
    assert choose_num_splits(1, 2, 600, torch.device("cpu")) > 1  # a long context alone splits
    assert choose_num_splits(256, 8, 600, torch.device("cpu")) == 1  # a big batch doesn't
    check_decode([600, 33], 16, 4, 2, 24, dtype, None, seed=7)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_cache_matches_reference(cache_dtype, dtype, num_splits):
    check_decode(
        [1, 17, 75, 130], 8, 6, 2, 16, dtype, num_splits, seed=4, cache_dtype=cache_dtype, kv_scale=FP8_SCALE
    )


def test_decode_zero_length_row_gives_zeros():
    """CUDA-graph padding rows have context_len 0; they must not produce NaN."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, _, _ = fill_cache([40], 8, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    lens = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = paged_decode(q, k_cache, v_cache, padded(tables + [[0]]), lens, 0.25, num_splits=splits)
        assert out[1].eq(0).all() and out[0].isfinite().all()


# ---- prefill -------------------------------------------------------------------------------


def check_prefill(
    chunks,
    block_size,
    heads,
    kv_heads,
    head_dim,
    dtype,
    seed,
    leading_rows=3,
    cache_dtype=None,
    kv_scale=UNIT_SCALE,
):
    """chunks: (cached tokens, new tokens) per sequence; the new tokens' KV is already in
    the cache (the backend writes before it reads). Packed after `leading_rows` decode rows
    that the kernel must leave alone."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in chunks]
    k_cache, v_cache, tables, keys, values = fill_cache(
        lengths, block_size, kv_heads, head_dim, dtype, gen, cache_dtype=cache_dtype, kv_scale=kv_scale
    )
    total = leading_rows + sum(n for _, n in chunks)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    starts = [leading_rows]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    paged_prefill(
        q,
        k_cache,
        v_cache,
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        padded(tables, torch.int32),
        max(n for _, n in chunks),
        scale,
        out,
        kv_scale,
    )
    assert out[:leading_rows].eq(7.0).all()
    for i in range(len(chunks)):
        expected = dense_reference(q[starts[i] : starts[i + 1]], keys[i], values[i], scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].float(), expected, **TOL[dtype])


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(block_size, heads, kv_heads, dtype):
    # A fresh prompt, a chunk after a prefix hit, a long chunk of a chunked prefill (two
    # query tiles; the others skip their second tile), a 1-token prompt, a 1-token chunk.
    chunks = [(0, 9), (12, 7), (37, 70), (0, 1), (5, 1)]
    check_prefill(chunks, block_size, heads, kv_heads, 16, dtype, seed=block_size * 10 + heads)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_fp8_cache_matches_reference(cache_dtype, dtype):
    chunks = [(0, 9), (12, 7), (37, 70), (5, 1)]
    check_prefill(chunks, 8, 6, 2, 16, dtype, seed=9, cache_dtype=cache_dtype, kv_scale=FP8_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_odd_head_dim(dtype):
    check_prefill([(20, 13), (0, 30)], 8, 6, 3, 24, dtype, seed=11, leading_rows=0)


# ---- the backend, end to end ---------------------------------------------------------------


def check_backend(seqs, block_size, heads, kv_heads, head_dim, dtype, seed, cache_dtype=None, kv_scale=None):
    """seqs: (cached, new) per sequence, decode rows (new == 1, cached > 0) first. Runs both
    backends from the same starting cache through build_metadata, as the model runner does;
    kv_scale, given, is layer 0's in the forward context."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, _, _ = fill_cache(
        [c + n for c, n in seqs],
        block_size,
        kv_heads,
        head_dim,
        dtype,
        gen,
        cache_dtype=cache_dtype,
        kv_scale=kv_scale or UNIT_SCALE,
    )
    # fill_cache wrote every position; blank the ones this step writes, so the write is tested.
    for table, (c, n) in zip(tables, seqs, strict=True):
        for p in range(c, c + n):
            k_cache[table[p // block_size], :, p % block_size] = 0
            v_cache[table[p // block_size], :, p % block_size] = 0
    t = sum(n for _, n in seqs)
    query = torch.randn(1, heads, t, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    key = torch.randn(1, kv_heads, t, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    value = torch.randn(1, kv_heads, t, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    meta = build_metadata(tables, [c + n for c, n in seqs], [n for _, n in seqs], block_size, DEVICE)
    assert meta.num_decodes == sum(1 for c, n in seqs if n == 1 and c > 0)

    results = []
    for fn in (torch_paged_attention, triton_paged_attention):
        caches = (k_cache.clone(), v_cache.clone())
        scales = None if kv_scale is None else [kv_scale]
        with forward_context(ForwardContext([caches], meta, kv_scales=scales)):
            out, _ = fn(_Layer(), query, key, value, None, scaling=head_dim**-0.5)
        results.append((out, caches))
    (ref, _), (out, caches) = results
    assert out.shape == (1, t, heads, head_dim) and out.dtype == dtype
    # The write, bit for bit, against the torch backend's on the CPU (see the module docstring).
    expected = (k_cache.cpu().clone(), v_cache.cpu().clone())
    k, v = key[0].transpose(0, 1).cpu(), value[0].transpose(0, 1).cpu()
    write_kv(*expected, k, v, meta.slot_mapping.cpu(), kv_scale or UNIT_SCALE)
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8))
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 8])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_backend(block_size, heads, kv_heads, dtype):
    seqs = [(5, 1), (17, 1), (1, 1), (0, 9), (12, 7), (0, 1)]
    check_backend(seqs, block_size, heads, kv_heads, 16, dtype, seed=block_size + heads)


def test_backend_prefill_only():
    check_backend([(0, 5), (30, 4)], 4, 4, 2, 16, torch.float32, seed=5)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_fp8_cache_matches_torch_backend(cache_dtype, dtype):
    """A fresh prompt attends its own keys as the cache holds them, in both backends."""
    seqs = [(5, 1), (17, 1), (1, 1), (0, 9), (12, 7), (0, 1)]
    check_backend(seqs, 8, 6, 2, 16, dtype, seed=6, cache_dtype=cache_dtype, kv_scale=FP8_SCALE)


# ---- real shapes, CUDA only ----------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 14, 2), (128, 32, 8)])
def test_cuda_decode_real_shapes(head_dim, heads, kv_heads):
    lengths = [1, 100, 1000, 2048, 4096, 3001, 17, 512]
    check_decode(lengths, 16, heads, kv_heads, head_dim, torch.bfloat16, None, seed=head_dim)
    check_decode(lengths[:3], 16, heads, kv_heads, head_dim, torch.float32, 4, seed=head_dim + 1)


@needs_cuda
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 14, 2), (128, 32, 8)])
def test_cuda_prefill_real_shapes(head_dim, heads, kv_heads):
    chunks = [(0, 1000), (2048, 512), (3000, 1096), (16, 1), (0, 64)]
    check_prefill(chunks, 16, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim)
    check_prefill(chunks[:2], 16, heads, kv_heads, head_dim, torch.float16, seed=head_dim + 1)


@needs_cuda
def test_cuda_backend_real_shapes():
    seqs = [(4000, 1), (100, 1), (2500, 1), (0, 700), (1024, 256), (3000, 33)]
    check_backend(seqs, 16, 32, 8, 128, torch.bfloat16, seed=1)


@needs_cuda
@pytest.mark.parametrize("cache_dtype", FP8)
def test_cuda_fp8_cache_real_shapes(cache_dtype):
    fp8 = dict(cache_dtype=cache_dtype, kv_scale=FP8_SCALE)
    lengths = [1, 100, 1000, 2048, 4096, 3001, 17, 512]
    check_decode(lengths, 16, 32, 8, 128, torch.bfloat16, None, seed=2, **fp8)
    check_decode(lengths[:3], 16, 14, 2, 64, torch.float32, 4, seed=3, **fp8)
    chunks = [(0, 1000), (2048, 512), (3000, 1096), (16, 1), (0, 64)]
    check_prefill(chunks, 16, 32, 8, 128, torch.bfloat16, seed=4, **fp8)
    check_prefill(chunks[:2], 16, 14, 2, 64, torch.float16, seed=5, **fp8)
    seqs = [(4000, 1), (100, 1), (2500, 1), (0, 700), (1024, 256), (3000, 33)]
    check_backend(seqs, 16, 32, 8, 128, torch.bfloat16, seed=6, **fp8)


@needs_cuda
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_cuda_decode_graph_capture(cache_dtype):
    """Captured once, replayed with new lengths and tables: no host sync may hide inside."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3000, 50, 1200, 7]
    k_cache, v_cache, tables, _, _ = fill_cache(
        lengths + [4096], 16, 8, 128, torch.bfloat16, gen, cache_dtype=cache_dtype, kv_scale=FP8_SCALE
    )
    q = torch.randn(4, 32, 128, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    width = 4096 // 16
    block_tables = padded([t + [0] * (width - len(t)) for t in tables[:4]])
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, 0.1, kv_scale=FP8_SCALE
    )  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(q, k_cache, v_cache, block_tables, context_lens, 0.1, kv_scale=FP8_SCALE)
    block_tables[0] = torch.tensor(tables[4], device=DEVICE)  # a different, longer sequence
    context_lens.copy_(torch.tensor([4096, 1, 1300, 0], dtype=torch.int32))
    graph.replay()
    expected = paged_decode(q, k_cache, v_cache, block_tables, context_lens, 0.1, kv_scale=FP8_SCALE)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
