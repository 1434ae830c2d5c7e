"""quantization="gguf": a GGUF file's quantized blocks run as they are.

- The block decoders (replica/gguf_blocks.py) against gguf-py's own dequantization, on
  random blocks of every type kvserve runs natively.
- gemm_group.c's kernels against torch references: the exact kernel against x times the
  dequantized weight, the int8-activation one against the same product with x quantized
  per 32-block as it quantizes it, the dequantizing one bit for bit, and decoder.c's
  group_linear against the Python loop's path through the same kernels.
- The chooser keeps one layout per group weight.
- Where a .gguf model file runs its blocks by default, and where it is dequantized.
- The bundled model, named by its file: its Q4_1 and Q8_0 blocks load, hold at most 0.35x the bf16 model's
  weight memory, and the fp32 engine's greedy tokens equal HF `generate` on the model
  transformers dequantized; the native loop equals the Python one."""

import ctypes

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_decoder import _assert_same, _both_loops

from kvserve import LLM, SamplingParams
from replica import gguf_blocks
from replica.cpu import group_quant, kernel_choice, linear_kernels, ops
from replica.cpu.abi import GroupWeight
from replica.cpu.build import load_library
from replica.cpu.group_quant import GroupQuantWeight, TorchInt4Weight

needs_kernels = pytest.mark.skipif(
    not group_quant.group_gemm_available(), reason="gemm_group.c needs AVX2, FMA and F16C"
)
# Groups of 96 put a 64-pair of blocks in two groups every third pair.
FORMATS = ["q4g32m", "q4g64m", "q4g96m", "q4g128m", "q8g16", "q8g32", "q8g32m", "q8g96"]


def _random_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random raw blocks of GGUF type `kind` whose fp16 fields are finite scales."""
    qtype = gguf.GGMLQuantizationType[kind]
    block, width = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // block, width), dtype=np.uint8)
    halves = {"Q6_K": [208]}.get(kind, [0, 2] if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for at in halves:
        scales = rng.uniform(-0.05, 0.05, size=(rows, k // block)).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(gguf_blocks.NATIVE_TYPES),
    rows=st.integers(1, 5),
    supers=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_decoded_blocks_equal_gguf_dequantization(kind, rows, supers, seed):
    """Bit for bit where the file's scales are fp16 already; a K-quant's multiplied-out
    sub-block scales are rounded to fp16, 2^-11 of each at most."""
    k = 256 * supers
    raw = _random_blocks(kind, rows, k, seed)
    weight = gguf_blocks.decode(kind, raw, rows, k)
    ours = weight.dequantize(torch.float32)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, k))
    if not kind.endswith("_K"):
        assert torch.equal(ours, theirs)
        return
    # Each term, scale * q and the min, off by 2^-11 of itself at most (with slack).
    terms = (weight.integers().float() * weight.scales.float().repeat_interleave(weight.group, 1)).abs()
    if weight.mins is not None:
        terms = terms + weight.mins.float().abs().repeat_interleave(weight.group, 1)
    assert ((ours - theirs).abs() <= 2**-10 * terms + 1e-12).all()


def _x_quantized(x: torch.Tensor) -> torch.Tensor:
    """x rounded as gemm_group_q8 rounds it: per 32-block, the largest |x| at 127."""
    blocks = x.view(x.shape[0], -1, 32)
    peak = blocks.abs().amax(dim=2, keepdim=True)
    # A true division, as the kernel's (127 / tensor is 127 times a reciprocal in torch,
    # which rounds differently, and a product at .5 then rounds the other way).
    inverse = torch.where(peak > 0, torch.full_like(peak, 127.0) / peak, 0.0)
    return ((blocks * inverse).round() * (peak / 127)).view_as(x)


def _reference(x: torch.Tensor, w: GroupQuantWeight, bias, quantized_x: bool) -> torch.Tensor:
    """The kernels' result in fp64: the min term takes x's exact group sums in both."""
    dense = w.dequantize(torch.float32).double()
    xs = _x_quantized(x).double() if quantized_x else x.double()
    y = xs @ dense.t()
    if quantized_x and w.mins is not None:  # the mins multiply the exact sums of x
        groups = w.shape[1] // w.group
        delta = (x.double() - xs).view(x.shape[0], groups, w.group).sum(dim=2)
        y = y + delta @ w.mins.double().t()
    return y if bias is None else y + bias.double()


def _in_features(fmt: str, blocks: int) -> int:
    """`blocks` 32-blocks of weights in a row, or that many groups where a group is larger."""
    _, group, _ = group_quant.parse_format(fmt)
    return 32 * blocks * max(1, group // 32)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    rows=st.integers(1, 9),
    n=st.integers(1, 40),
    blocks=st.integers(1, 9),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_group_kernels_match_their_references(fmt, rows, n, blocks, with_bias, seed):
    """Odd block counts take the block-at-a-time AVX2 loops (one row: four columns at a time,
    and column by column for the rest); even ones take blocks in pairs, 512 bits at a time
    where the AVX-512 kernel is built, else 256 bits for 4-bit weights (and there, the
    256-bit kernel too: its VNNI dot products; at one row in groups of 32, four pairs at a
    time)."""
    k = _in_features(fmt, blocks)
    g = torch.Generator().manual_seed(seed)
    w = group_quant.quantize(torch.randn(n, k, generator=g), fmt)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    kernels = [(False, False), (True, False)]
    if group_quant.q8_256_kernel_runs(fmt, k):
        kernels.append((True, True))
    for quantized_x, in_256_bits in kernels:
        y = group_quant.gemm_group(x, w, bias, quantized_x, in_256_bits)
        expected = _reference(x, w, bias, quantized_x)
        torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert torch.equal(
        group_quant.mm_dequantized(x, w, bias), torch.nn.functional.linear(x, w.dequantize(), bias)
    )
    if group_quant.torch_int4_runs(fmt, n):
        y = group_quant.mm_torch_int4(x, group_quant.pack_for_torch_int4(w), bias)
        expected = _reference(x, w, bias, False)
        torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    n=st.integers(1, 40),
    blocks=st.integers(1, 6),
    ids=st.lists(st.integers(0, 39), min_size=1, max_size=9),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_embedding_rows_equal_the_dequantized_rows(fmt, n, blocks, ids, bf16, seed):
    """A lookup in C (repeated ids, any order) gives the reference's rows bit for bit."""
    k = _in_features(fmt, blocks)
    w = group_quant.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), fmt)
    ids = torch.tensor([i % n for i in ids])
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert torch.equal(group_quant.embedding_rows(w, ids, dtype), w.dequantize(dtype, ids))


@needs_kernels
@pytest.mark.parametrize("k", [64, 256, 320, 576, 1536])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_256_bit_kernel_at_one_row_matches_its_reference(k, with_bias):
    """One row of groups of 32 goes four pairs of blocks at a time, then pair by pair (64:
    one pair; 256: one quad; 320 and 576: quads and a pair left over). It is a kernel of
    its own on AVX-512 CPUs, and the int8-activation kernel on AVX2 ones."""
    in_256_bits = group_quant.q8_256_kernel_runs("q4g32m", k)
    if not in_256_bits and load_library().group_q8_is_wide():
        pytest.skip("no 256-bit kernel runs this weight here")
    g = torch.Generator().manual_seed(k)
    w = group_quant.quantize(torch.randn(37, k, generator=g), "q4g32m")
    x = torch.randn(1, k, generator=g)
    bias = torch.randn(37, generator=g) if with_bias else None
    y = group_quant.gemm_group(x, w, bias, quantized_x=True, in_256_bits=in_256_bits)
    expected = _reference(x, w, bias, True)
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8g8", "q8g24", "q8g48"])
def test_the_int8_activation_kernel_refuses_groups_that_split_its_blocks(fmt):
    """Its dot products take one weight scale per 32-block (or per half): the chooser never
    times it on such a weight, and a direct call says why instead of returning garbage."""
    w = group_quant.quantize(torch.randn(8, 96), fmt)
    assert linear_kernels.can_run(linear_kernels.GROUP_GEMM_C, torch.bfloat16, 96, fmt, 8)
    assert not linear_kernels.can_run(linear_kernels.GROUP_Q8_GEMM_C, torch.bfloat16, 96, fmt, 8)
    with pytest.raises(ValueError, match="does not run " + fmt):
        group_quant.gemm_group(torch.randn(1, 96), w, None, quantized_x=True)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5])
def test_group_kernels_compute_every_column_once_whatever_the_threads(rows):
    """The threads take panels from the front of their own share and then from the back of
    the others': with more threads than cores most panels change hands, and every column
    comes out as one thread computes it (1000 columns: a part panel and a part quad)."""
    g = torch.Generator().manual_seed(0)
    w = group_quant.quantize(torch.randn(1000, 256, generator=g), "q4g32m")
    x = torch.randn(rows, 256, generator=g)
    threads = torch.get_num_threads()
    kernels = [(False, False), (True, False)]
    if group_quant.q8_256_kernel_runs(w.format, 256):
        kernels.append((True, True))
    try:
        for kernel in kernels:
            torch.set_num_threads(1)
            alone = group_quant.gemm_group(x, w, None, *kernel)
            for n in (2, 3, 8):
                torch.set_num_threads(n)
                assert torch.equal(group_quant.gemm_group(x, w, None, *kernel), alone), (n, kernel)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", linear_kernels.GROUP_GEMM_C_KERNELS)
@pytest.mark.parametrize("gated", [False, True])
def test_decoder_group_linear_equals_the_python_path(dtype, kernel, gated):
    """decoder.c's group_linear rounds where the Python loop does: the same tokens."""
    if not linear_kernels.can_run(kernel, dtype, 128, "q4g32m", 24):
        pytest.skip(f"{kernel} does not run {dtype} models here")
    g = torch.Generator().manual_seed(1)
    n, k, rows = 24, 128, 5
    w = group_quant.quantize(torch.randn(2 * n if gated else n, k, generator=g), "q4g32m")
    bias = torch.randn(w.shape[0], generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    # The oracle widens and rounds in torch: the kernel in fp32, then the output in dtype.
    expected = linear_kernels.run(kernel, x.float(), w, bias.float(), w.shape[0], False).to(dtype)
    expected = ops.silu_mul(expected) if gated else expected
    assert torch.equal(linear_kernels.run(kernel, x, w, bias, n, gated), expected)
    out = torch.empty(rows, n, dtype=dtype)
    struct = w.struct()
    load_library().group_linear(
        out.data_ptr(), x.data_ptr(), ctypes.byref(struct), bias.data_ptr(), rows, n, k, int(gated),
        int(dtype == torch.bfloat16), linear_kernels.GROUP_LINEAR_KERNEL[kernel], torch.get_num_threads(),
    )  # fmt: skip
    assert torch.equal(out, expected)


@needs_kernels
@pytest.mark.parametrize("kernel", linear_kernels.GROUP_GEMM_C_KERNELS)
@pytest.mark.parametrize("gated", [False, True])
def test_group_linear_each_runs_the_weights_in_turn(kernel, gated):
    """What the chooser times: group_linear with weights[start:start + count] one after
    another, leaving the last one's product (which the Python path gives for it)."""
    if not linear_kernels.can_run(kernel, torch.bfloat16, 128, "q4g32m", 24):
        pytest.skip(f"{kernel} does not run here")
    g = torch.Generator().manual_seed(3)
    n, k = 24, 128
    weights = [
        group_quant.quantize(torch.randn(2 * n if gated else n, k, generator=g), "q4g32m") for _ in range(4)
    ]
    structs = (GroupWeight * 4)(*(w.struct() for w in weights))
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    number = linear_kernels.GROUP_LINEAR_KERNEL[kernel]
    for start, count in [(0, 4), (1, 2), (2, 1)]:
        out = group_quant.group_linear_each(x, structs, start, count, None, n, gated, number)
        expected = linear_kernels.run(kernel, x, weights[start + count - 1], None, n, gated)
        assert torch.equal(out, expected), (start, count)
    with pytest.raises(IndexError, match=r"weights\[3:5\] of 4"):
        group_quant.group_linear_each(x, structs, 3, 2, None, n, gated, number)


@needs_kernels
def test_the_chooser_times_gemm_group_kernels_per_call_from_c(monkeypatch):
    """time_linears runs gemm_group.c's kernels IN_C_ROWS rows' worth of calls from C at
    a time, counts each call, and takes the mean of its timings from memory and from
    cache; other kernels, one call from Python at a time."""
    calls = []
    each = group_quant.group_linear_each

    def counted(x, weights, start, count, *args):
        calls.append((x.shape[0], count))
        return each(x, weights, start, count, *args)

    def one_second_a_call(timed):  # three from cache
        for call in timed.values():
            call()
        return {name: 3.0 if name.endswith(kernel_choice.FROM_CACHE) else 1.0 for name in timed}

    monkeypatch.setattr(group_quant, "group_linear_each", counted)
    monkeypatch.setattr(kernel_choice, "_time_rounds", one_second_a_call)
    shape = kernel_choice.LinearShape(64, 128, torch.bfloat16, quantization="q4g32m")
    kernels = [
        k
        for k in linear_kernels.GROUP_KERNELS
        if linear_kernels.can_run(k, torch.bfloat16, 128, "q4g32m", 64)
    ]
    seconds = kernel_choice.time_linears(kernels, shape, (1, 8, 64, 128))
    in_c = [k for k in kernels if k in linear_kernels.GROUP_GEMM_C_KERNELS]
    per_call = {1: 64, 8: 8, 64: 1, 128: 1}  # the copies outnumber IN_C_ROWS
    assert kernel_choice.IN_C_ROWS == 64 and calls
    assert sorted(set(calls)) == sorted(per_call.items())
    assert {k: seconds[k] for k in in_c} == {k: [2 / per_call[r] for r in (1, 8, 64, 128)] for k in in_c}
    assert seconds[linear_kernels.GROUP_DEQUANT] == [1.0] * 4


@given(faster=st.floats(1e-9, 0.5))
def test_gemm_group_kernels_take_row_counts_from_each_other_on_any_gain(faster):
    """gemm_group.c's kernels share a layout and each runs in decoder.c's loop: one that is
    faster than the default by any amount takes the rows; a kernel of another layout (the
    dequantizing one) must be faster by more than MARGIN."""
    default, rival = linear_kernels.GROUP_Q8_GEMM_C, linear_kernels.GROUP_Q8_256_GEMM_C
    buckets, slower = (1, 8), [1.0, 1.0]
    quicker = [1.0 / (1.0 + faster)] * 2
    assert kernel_choice.fastest(buckets, {default: slower, rival: quicker}).kernel_for(1) == rival
    dequant = kernel_choice.fastest(buckets, {default: slower, linear_kernels.GROUP_DEQUANT: quicker})
    wins = faster > kernel_choice.MARGIN
    assert dequant.kernel_for(1) == (linear_kernels.GROUP_DEQUANT if wins else default)


def test_concatenated_formats_widen_exactly():
    """q/k/v or gate/up of mixed formats (a Q4_K_M file's Q4_K and Q6_K) become one
    weight in the widest format, the same numbers."""
    g = torch.Generator().manual_seed(2)
    parts = [
        group_quant.quantize(torch.randn(8, 128, generator=g), fmt) for fmt in ("q4g32m", "q8g16", "q8g32")
    ]
    joined = GroupQuantWeight.concat(parts)
    assert joined.format == "q8g16m"
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(
        st.lists(st.floats(1e-5, 1.0), min_size=4, max_size=4),
        min_size=len(linear_kernels.GROUP_KERNELS),
        max_size=len(linear_kernels.GROUP_KERNELS),
    ),
    given_up=st.lists(
        st.integers(1, 4),
        min_size=len(linear_kernels.GROUP_KERNELS) - 1,
        max_size=len(linear_kernels.GROUP_KERNELS) - 1,
    ),
)
def test_a_group_weight_keeps_one_layout(times, given_up):
    """Whatever the timings (kernels given up on from any bucket, infinite there; the
    dequantizing one never), a group-quantized linear runs either torch's int4 layout or
    its own integers' kernels, never both (which would double its memory), and within
    the layout chosen, what fastest() chooses."""
    buckets = (1, 8, 64, 512)
    seconds = dict(zip(linear_kernels.GROUP_KERNELS, times, strict=True))
    others = [k for k in linear_kernels.GROUP_KERNELS if k != linear_kernels.GROUP_DEQUANT]
    for kernel, start in zip(others, given_up, strict=True):
        seconds[kernel] = seconds[kernel][:start] + [float("inf")] * (4 - start)
    choice = kernel_choice.one_layout(buckets, seconds)
    torch_layout = {linear_kernels.GROUP_TORCH}
    assert choice.used() <= torch_layout or not (choice.used() & torch_layout)
    family = {k: s for k, s in seconds.items() if (k in torch_layout) == bool(choice.used() & torch_layout)}
    assert choice == kernel_choice.fastest(buckets, family)
    assert all(seconds[choice.kernel_for(rows)][i] < float("inf") for i, rows in enumerate(buckets))


def test_the_dequantizing_kernel_is_timed_at_every_bucket():
    """It loses by far at one row (the whole weight dequantized for it) and wins at many."""
    measured = {
        1: {"a": 1.0, linear_kernels.GROUP_DEQUANT: 10.0},
        512: {"a": 100.0, linear_kernels.GROUP_DEQUANT: 20.0},
    }
    times = kernel_choice.time_buckets(
        ["a", linear_kernels.GROUP_DEQUANT],
        (1, 512),
        lambda rows, timed: {k: measured[rows][k] for k in timed},
    )
    assert times[linear_kernels.GROUP_DEQUANT] == [10.0, 20.0]


@pytest.fixture(scope="module")
def gguf_fp32():
    """The bundled model's own blocks, every linear on the exact kernel: the GGUF file named
    by its path, which runs its blocks by default (quantization="gguf")."""
    from replica.model_loader import bundled_gguf_path

    return LLM(str(bundled_gguf_path()), dtype="float32", cpu_kernels="gemm.c")


@needs_kernels
def test_the_bundled_models_blocks_run_as_they_are(gguf_fp32, model_path):
    runner = gguf_fp32.engine.runner
    assert runner.weights.quantization == "gguf"
    fused = runner.run_decoder
    layouts = [m.layout(linear_kernels.GROUP_GEMM_C)[0] for a in fused.attentions for m in (a.qkv, a.o_proj)]
    layouts += [
        m.layout(linear_kernels.GROUP_GEMM_C)[0] for mlp in fused.mlps for m in (mlp.gate_up, mlp.down)
    ]
    assert all(isinstance(w, GroupQuantWeight) and w.format == "q4g32m" for w in layouts)
    head = runner.lm_head.layout(linear_kernels.GROUP_GEMM_C)[0]
    assert head.format == "q8g32" and head is fused.embed_tokens.weight_blocks  # tied: one copy
    # The file's bytes, as llama.cpp reads them: Q4_1's nibbles kept, q rows and all.
    reader = gguf.GGUFReader(str(gguf_blocks_source(model_path)))
    down = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    ours = fused.mlps[3].down.layout(linear_kernels.GROUP_GEMM_C)[0]
    raw = np.asarray(down.data).reshape(ours.shape[0], -1, 20)
    assert np.array_equal(ours.qs.numpy().reshape(ours.shape[0], -1, 16), raw[..., 4:])


@needs_kernels
def test_a_gguf_model_on_the_group_kernels_shares_its_work(gguf_fp32):
    """Their threads take what is left of the others' shares, so a pinned replica runs its
    decode steps on every core (replica/cpu/affinity.py)."""
    assert gguf_fp32.engine.rows_sharing_work() >= gguf_fp32.engine.config.max_num_seqs


def gguf_blocks_source(model_path):
    from replica.model_loader import gguf_source

    return gguf_source(model_path)


@needs_kernels
def test_weight_memory_is_a_third_of_bf16(gguf_fp32, model_path):
    """The issue's bar: at most 0.35x the weights (linears and the rest) of the bf16 engine
    on the dequantized model, its kernel forced so that each weight has one layout (gemm.c,
    or torch's on a CPU without bf16 instructions). The group weights are the same integers
    in an fp32 engine (its norms, a few KB, in fp32)."""
    kernel = (
        linear_kernels.GEMM_C
        if linear_kernels.can_run(linear_kernels.GEMM_C, torch.bfloat16, 576)
        else linear_kernels.TORCH
    )
    dense = LLM(str(model_path), dtype="bfloat16", cpu_kernels=kernel, kv_cache_memory_gb=0.05)
    total = lambda w: w.linear_bytes + w.other_bytes  # noqa: E731
    assert total(gguf_fp32.engine.runner.weights) <= 0.35 * total(dense.engine.runner.weights)


@needs_kernels
def test_greedy_equals_hf_on_the_dequantized_model(gguf_fp32, hf_model, tokenizer):
    """HF `generate` in fp32 on the weights transformers dequantized from the same file:
    the exact kernel computes the same products, up to summation order."""
    eos = {tokenizer.eos_token_id}
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        out = gguf_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 16, eos)


@needs_kernels
def test_native_loop_same_as_python_loop(gguf_fp32):
    """decoder.c's loop over group weights (bf16's rounding points: the group_linear test)."""
    assert gguf_fp32.engine.runner.run_decoder.native is not None
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    ours, theirs, native_steps = _both_loops(gguf_fp32, ["Hello, my name is", "The sky is"], params)
    _assert_same(ours, theirs)
    assert native_steps > 0


@needs_kernels
def test_the_native_loop_runs_each_projection_on_its_own_group_kernel(monkeypatch):
    """decoder.c takes each projection's gemm_group.c kernel from the step's choices, so a
    step whose projections chose different ones (the exact kernel, the int8-activation
    one, in 256 bits where that is a kernel of its own) still runs in one call, with the
    Python loop's tokens and log-probabilities. The choices are forced per projection in
    place of timings, which would put every projection on one kernel here."""
    from replica.model_loader import bundled_gguf_path

    q8_256 = linear_kernels.GROUP_Q8_256_GEMM_C
    if not linear_kernels.can_run(q8_256, torch.bfloat16, 576, "q4g32m", 960):
        q8_256 = linear_kernels.GROUP_Q8_GEMM_C
    kernels = {  # (out, in) of SmolLM2's projections; the 8-bit lm_head on the exact kernel
        (960, 576): linear_kernels.GROUP_GEMM_C,
        (576, 576): linear_kernels.GROUP_Q8_GEMM_C,
        (3072, 576): q8_256,
        (576, 1536): q8_256,
    }

    def forced(self, shape, max_rows=None):
        kernel = kernels.get((shape.out_features, shape.in_features), linear_kernels.GROUP_GEMM_C)
        return kernel_choice.LinearChoice.forced(kernel)

    monkeypatch.setattr(kernel_choice.KernelChooser, "linear", forced)
    llm = LLM(str(bundled_gguf_path()), dtype="bfloat16", max_model_len=256)
    native = llm.engine.runner.run_decoder.native
    assert native is not None and native._step_kernels(1) == tuple(
        linear_kernels.GROUP_LINEAR_KERNEL[k] for k in kernels.values()
    )
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    ours, theirs, native_steps = _both_loops(llm, ["Hello, my name is", "The sky is"], params)
    _assert_same(ours, theirs)
    assert native_steps > 0


def test_gguf_needs_a_gguf_model(tmp_path, tokenizer):
    from test_gpu_path import TINY
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(TINY).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        LLM(str(tmp_path), dtype="float32", quantization="gguf")
    with pytest.raises(ValueError, match="runs on CPU with kvserve's CPU kernels"):
        LLM(str(tmp_path), dtype="float32", quantization="gguf", attention_backend="torch")


# (what is asked, the model named, where it runs) -> the engine's quantization
DEFAULTS = [
    ({}, "m.gguf", "gguf"),
    ({}, "/models/M.GGUF", "gguf"),
    ({"cpu_kernels": "gemm.c"}, "m.gguf", "gguf"),
    ({"quantization": "none"}, "m.gguf", None),
    ({"quantization": "int8"}, "m.gguf", "int8"),
    ({}, "/models/llama", None),
    ({}, None, None),  # the bundled model
    ({"backend": "torch"}, "m.gguf", None),
    ({"dtype": torch.float16}, "m.gguf", None),
    ({"group": object()}, "m.gguf", None),  # tensor parallelism
    ({"device": torch.device("cuda")}, "m.gguf", "gguf"),  # replica/gpu/group_linear.py
    ({"backend": "triton"}, "m.gguf", "gguf"),  # the same, on CPU under the Triton interpreter
    ({"cpu_kernels": "torch"}, "m.gguf", None),  # no kernel of its own for Q8_0
    ({"cpu_kernels": "onednn"}, "m.gguf", None),
]


@pytest.mark.parametrize("given_, model, expected", DEFAULTS)
def test_a_gguf_file_runs_its_blocks_by_default_where_they_run(given_, model, expected, caplog):
    """vLLM's default for a .gguf model; where the blocks cannot run, the file is
    dequantized as before, and the log says why."""
    from replica.attention.select import CPU_KERNELS
    from replica.config import EngineConfig
    from replica.model_runner import resolve_quantization

    config = EngineConfig(
        model=model, quantization=given_.get("quantization"), cpu_kernels=given_.get("cpu_kernels", "auto")
    )
    where = {
        "device": given_.get("device", torch.device("cpu")),
        "dtype": given_.get("dtype", torch.bfloat16),
        "backend": given_.get("backend", CPU_KERNELS),
        "group": given_.get("group"),
    }
    with caplog.at_level("INFO", logger="replica.model_runner"):
        assert resolve_quantization(config, **where) == expected
    dequantized = expected is None and model is not None and model.lower().endswith(".gguf")
    assert ("is dequantized" in caplog.text) == (dequantized and given_.get("quantization") != "none")


def test_torch_int4_layout_counts_its_own_bytes():
    w = group_quant.quantize(torch.randn(16, 64), "q4g32m")
    packed = group_quant.pack_for_torch_int4(w)
    assert isinstance(packed, TorchInt4Weight) and packed.nbytes() > 0
