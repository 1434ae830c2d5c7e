"""The mixed-adapter LoRA update (replica/lora): the torch reference against a plain
per-token loop, and the Triton BGMV kernels against the torch reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1 at small shapes (ragged `in`,
`out` and P*R against the block sizes, base-only, one-slot and mixed batches, strided
rows); on a GPU the same tests run compiled, plus SmolLM2-135M's and a 1B model's real
projection shapes and CUDA-graph capture.

Tolerances, against lora_delta_torch in float64 on the same (rounded) inputs, with
outputs of order 1:
- fp32: atol/rtol 1e-4 (only summation order differs; no TF32, the kernels use no tl.dot);
- bf16: atol/rtol 2e-2 (the output is rounded to bf16, by truncation under triton
  3.9's interpreter, to nearest when compiled; h stays fp32 in between);
- fp16: atol/rtol 2e-3;
- base-model rows (slot -1) are exactly zero.
"""

import importlib.util
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.lora.kernels import TRITON_MAX_ROWS, lora_delta, lora_delta_torch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRET_WAS_SET = os.environ.get("TRITON_INTERPRET") == "1"
if not CUDA:
    # triton.jit picks compiled or interpreted when a function is defined, triton's own
    # library included, so this has to come before anything imports triton (conftest.py
    # sets it first; this covers importing the file without it).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    TRITON_SKIP = "triton is not installed: pip install -e '.[triton]'"
elif not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    TRITON_SKIP = "no CUDA GPU and TRITON_INTERPRET is not 1: Triton cannot run here"
elif not CUDA and not INTERPRET_WAS_SET and "triton" in sys.modules:
    TRITON_SKIP = "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)"
else:
    TRITON_SKIP = None
needs_triton = pytest.mark.skipif(TRITON_SKIP is not None, reason=TRITON_SKIP or "")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: real shapes, CUDA graphs")

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def triton_delta(*args) -> torch.Tensor:
    from replica.lora.triton_lora import lora_delta_triton

    return lora_delta_triton(*args)


def loop_reference(x, a, b, token_slots) -> torch.Tensor:
    """The definition, one token at a time, in float64."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] = (x[t].double() @ a[slot].double().T) @ b[slot].double()
    return out


def stacked(slots, out_sizes, rank, in_features, dtype, gen, ranks=None):
    """Adapters in the stacked layout of replica/lora/kernels.py: slice p's A in rows
    p*R:(p+1)*R, its B in its own output columns only; slot s's true rank ranks[s] <= R,
    the rest zero padding. Scaled so that h and the update are of order 1."""
    parts = len(out_sizes)
    a = torch.zeros(slots, parts * rank, in_features)
    b = torch.zeros(slots, parts * rank, sum(out_sizes))
    for s in range(slots):
        r = rank if ranks is None else ranks[s]
        col = 0
        for p, size in enumerate(out_sizes):
            rows = slice(p * rank, p * rank + r)
            a[s, rows] = torch.randn(r, in_features, generator=gen) / in_features**0.5
            b[s, rows, col : col + size] = torch.randn(r, size, generator=gen) / r**0.5
            col += size
    return a.to(dtype=dtype, device=DEVICE), b.to(dtype=dtype, device=DEVICE)


def make_slots(pattern, tokens, slots, gen):
    if pattern == "base":
        ids = torch.full((tokens,), -1)
    elif pattern == "one":
        ids = torch.full((tokens,), slots - 1)
    else:  # mixed, base rows included
        ids = torch.randint(-1, slots, (tokens,), generator=gen)
        ids[0] = -1
    return ids.to(DEVICE)


def check(x, a, b, token_slots, dtype):
    got = triton_delta(x, a, b, token_slots)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], b.shape[2])
    expected = lora_delta_torch(x.double(), a.double(), b.double(), token_slots)
    torch.testing.assert_close(got.double(), expected, **TOL[dtype])
    assert torch.all(got[token_slots < 0] == 0), "a base-model row got an update"
    return got


# ---- the torch reference against the definition -------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    slots=st.integers(1, 4),
    parts=st.integers(1, 3),
    rank=st.integers(1, 8),
    tokens=st.integers(0, 12),
    in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_torch_reference_is_the_per_token_loop(
    seed, slots, parts, rank, tokens, in_features, out_features, dtype
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=gen, dtype=dtype)
    a = torch.randn(slots, parts * rank, in_features, generator=gen, dtype=dtype)
    b = torch.randn(slots, parts * rank, out_features, generator=gen, dtype=dtype)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    got = lora_delta_torch(x, a, b, token_slots)
    assert got.dtype == dtype and got.shape == (tokens, out_features)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got.double(), loop_reference(x, a, b, token_slots), atol=tol, rtol=tol)
    assert torch.all(got[token_slots < 0] == 0)


# ---- Triton at small shapes (interpreted on CPU) -------------------------------------------

# (slots, out_sizes (one per slice P), rank R, in, tokens) against the block sizes of
# replica/lora/triton_lora.py (16 rows of A, 128 of `in`, 16 of P*R, 128 output columns).
SMALL = {
    "one-tile": (2, (16,), 4, 16, 5),
    "ragged": (3, (70, 30, 30), 5, 200, 9),  # P*R 15, in 200, out 130: every edge masked
    "rank-loop": (2, (100, 100), 12, 33, 6),  # P*R 24: two steps of the expand's loop
}


@needs_triton
@pytest.mark.parametrize("shape", SMALL)
@pytest.mark.parametrize("pattern", ["base", "one", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch(shape, pattern, dtype):
    slots, out_sizes, rank, in_features, tokens = SMALL[shape]
    gen = torch.Generator().manual_seed(len(shape) * 7 + tokens)
    a, b = stacked(slots, out_sizes, rank, in_features, dtype, gen, ranks=[rank] + [rank - 1] * (slots - 1))
    x = torch.randn(tokens, in_features, generator=gen).to(dtype=dtype, device=DEVICE)
    got = check(x, a, b, make_slots(pattern, tokens, slots, gen), dtype)
    if pattern == "base":
        assert torch.all(got == 0)


@needs_triton
def test_triton_strided_rows_int32_slots_fp16():
    """x a column slice of a wider activation (row stride > in), int32 slot ids."""
    gen = torch.Generator().manual_seed(1)
    a, b = stacked(3, (40, 24), 4, 48, torch.float16, gen)
    wide = torch.randn(7, 80, generator=gen).to(dtype=torch.float16, device=DEVICE)
    x = wide[:, 16:64]
    token_slots = torch.tensor([2, -1, 0, 1, 2, -1, 0], dtype=torch.int32, device=DEVICE)
    check(x, a, b, token_slots, torch.float16)


@needs_triton
def test_triton_one_row_views():
    """A one-row batch whose slot id and row are views with other strides, as a CUDA
    graph's one-row bucket reads them from its packed inputs."""
    gen = torch.Generator().manual_seed(5)
    a, b = stacked(2, (24, 8), 4, 32, torch.float32, gen)
    packed = torch.tensor([[7, 1, 3, 9, 1]], device=DEVICE)  # the slot in column 4
    token_slots = packed[:, 4]
    assert token_slots.stride(0) == 5
    x = torch.randn(3, 64, generator=gen).to(DEVICE)[1:2, ::2]  # one row, strided columns
    check(x.contiguous(), a, b, token_slots, torch.float32)
    wide = torch.randn(1, 96, generator=gen).to(DEVICE)[:, 16:48]
    check(wide, a, b, token_slots, torch.float32)


@needs_triton
def test_triton_reads_only_each_tokens_own_slot():
    """NaN in a slot no token uses must not reach any row: each token gathers its own
    slot's A and B. (lora_delta_torch's second GEMM runs over every slot's B, so a NaN
    there would reach every row: the reference is taken with the slot zeroed.)"""
    gen = torch.Generator().manual_seed(2)
    a, b = stacked(3, (20,), 4, 24, torch.float32, gen)
    x = torch.randn(6, 24, generator=gen, device="cpu").to(DEVICE)
    token_slots = torch.tensor([0, -1, 2, 2, -1, 0], device=DEVICE)
    poisoned_a, poisoned_b = a.clone(), b.clone()
    poisoned_a[1] = float("nan")
    poisoned_b[1] = float("nan")
    got = triton_delta(x, poisoned_a, poisoned_b, token_slots)
    torch.testing.assert_close(got, lora_delta_torch(x, a, b, token_slots), **TOL[torch.float32])
    assert torch.all(got[token_slots < 0] == 0)


@needs_triton
def test_triton_empty_batch():
    gen = torch.Generator().manual_seed(3)
    a, b = stacked(2, (8,), 2, 8, torch.float32, gen)
    no_slots = torch.zeros(0, dtype=torch.long, device=DEVICE)
    assert triton_delta(torch.zeros(0, 8, device=DEVICE), a, b, no_slots).shape == (0, 8)


# ---- real shapes, CUDA only ----------------------------------------------------------------

# (in, out_sizes): SmolLM2-135M's fused q/k/v, gate/up and down projections, and a 1B
# model's MLP up projection.
REAL = {
    "smollm-qkv": (576, (576, 192, 192)),
    "smollm-gate-up": (576, (1536, 1536)),
    "smollm-down": (1536, (576,)),
    "1b-up": (2048, (8192,)),
}


@needs_cuda
@pytest.mark.parametrize("shape", REAL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_real_shapes(shape, dtype):
    in_features, out_sizes = REAL[shape]
    slots, rank = 4, 16
    gen = torch.Generator().manual_seed(in_features)
    a, b = stacked(slots, out_sizes, rank, in_features, dtype, gen, ranks=[16, 8, 16, 4])
    for tokens in (1, 7, 64, 512):
        x = torch.randn(tokens, in_features, generator=gen).to(dtype=dtype, device=DEVICE)
        token_slots = make_slots("mixed" if tokens > 1 else "one", tokens, slots, gen)
        got = check(x, a, b, token_slots, dtype)
        # lora_delta picks the Triton kernels on CUDA up to TRITON_MAX_ROWS rows, torch past
        # it; torch in bf16 rounds h to bf16, hence the looser bound against it.
        native = lora_delta_torch(x, a, b, token_slots)
        picked = got if tokens <= TRITON_MAX_ROWS else native
        torch.testing.assert_close(lora_delta(x, a, b, token_slots), picked, atol=0, rtol=0)
        loose = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else TOL[dtype]
        torch.testing.assert_close(got, native, **loose)


@needs_cuda
def test_cuda_graph_capture():
    """Captured once, replayed with other slot ids: no host read of a device value."""
    gen = torch.Generator().manual_seed(4)
    a, b = stacked(4, (576, 192, 192), 16, 576, torch.bfloat16, gen)
    x = torch.randn(64, 576, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    token_slots = make_slots("mixed", 64, 4, gen)
    triton_delta(x, a, b, token_slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_delta(x, a, b, token_slots)
    token_slots.copy_(make_slots("mixed", 64, 4, gen).flip(0))
    graph.replay()
    torch.testing.assert_close(out, triton_delta(x, a, b, token_slots), atol=0, rtol=0)
