"""An fp8 KV cache (kv_cache_dtype="fp8", "fp8_e5m2") in kvserve's C kernels against the
torch reference (replica/kv_quant.py, replica/attention/torch_backend.py): the bytes the
kernel writes, attention over them (decode rows, chunks after cached tokens, fresh
prefills; rotary fused or not), and decoder.c's whole-step loop."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention_reference import _Layer
from test_cpu_kernels import _rotary, random_batch
from test_native_decoder import _assert_same, _both_loops, _gemm_c_runs
from test_other_models import CONFIGS
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from replica.attention import ForwardContext, build_metadata, forward_context
from replica.attention.torch_backend import kv_cache_shape, torch_paged_attention, write_kv
from replica.cpu import ops
from replica.kv_quant import FP8_MAX, KVScale, quantize_kv

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Against the torch backend, which attends the same dequantized keys and values (in bf16
# for bf16 activations, where the kernel keeps them in fp32).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _hard_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties), the
    floats either side of each, and values past the largest (saturation), both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique()  # sorted, 0 included
    limit = FP8_MAX[kv_dtype]
    extremes = torch.tensor([limit * 1.03, limit * 1.07, limit * 2, 1e30, float("inf"), 2.0**-149, 1e-30])
    base = torch.cat([values, (values[1:] + values[:-1]) / 2, extremes])
    near = torch.cat([base, base.nextafter(torch.tensor(float("inf"))), base.nextafter(torch.tensor(0.0))])
    return torch.cat([near, -near, torch.tensor([-0.0])])


def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8 if cache.element_size() == 1 else torch.int16)


def _written(cache: torch.Tensor, slots: torch.Tensor, keys: bool) -> torch.Tensor:
    """The bits at `slots` of a kernel-written cache, as [T, Hkv, D]: a K page is [D, BS]."""
    nb, hkv, bs, d = cache.shape
    raw = _bits(cache)
    if keys:
        raw = raw.view(nb, hkv, d, bs).transpose(2, 3)
    return raw[slots // bs, :, slots % bs]


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Unit, powers of two (quotients exact), and scales where multiplying by the reciprocal
# would round some quotients next to a tie the other way than torch's division does.
@pytest.mark.parametrize(
    "kv_scale", [KVScale(), KVScale(0.25, 0.5), KVScale(0.037, 0.0277), KVScale(0.013, 0.0071)]
)
@pytest.mark.parametrize("rotary", [False, True])
def test_written_bytes_are_torchs(kv_dtype, dtype, kv_scale, rotary):
    """The kernel's K and V writes hold exactly the bytes quantize_kv gives: ties to even,
    subnormals, saturation, signed zero; rotated first when rotary is fused."""
    g = torch.Generator().manual_seed(0)
    hkv, d, bs = 2, 64, 16
    magnitudes = 10 ** (torch.rand(20000, generator=g) * 14 - 9)
    random = torch.randn(20000, generator=g) * magnitudes

    def inputs(scale: float) -> torch.Tensor:
        values = random
        if not rotary:  # the rotation of inf is NaN, whose sign no kernel promises
            hard = _hard_values(kv_dtype) * scale
            up, down = hard.nextafter(torch.tensor(float("inf"))), hard.nextafter(torch.tensor(-float("inf")))
            values = torch.cat([hard, up, down, values])
        return values[torch.randperm(values.numel(), generator=g)]

    k_values, v_values = inputs(kv_scale.k), inputs(kv_scale.v)
    tokens = -(-k_values.numel() // (hkv * d))
    k, v = (
        torch.cat([x, x.new_zeros(tokens * hkv * d - x.numel())]).view(tokens, hkv, d).to(dtype)
        for x in (k_values, v_values)
    )
    q = torch.zeros(tokens, hkv, d, dtype=dtype)
    num_blocks = -(-tokens // bs) + 3
    table = torch.randperm(num_blocks, generator=g)[: -(-tokens // bs)].tolist()
    meta = build_metadata([table], [tokens], [tokens], bs, "cpu")
    cos = sin = None
    if rotary:
        angles = torch.rand(tokens, d // 2, generator=g).repeat(1, 2) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.zeros(kv_cache_shape(num_blocks, bs, hkv, d), dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    ops.paged_attention(q, k, v, k_cache, v_cache, meta, d**-0.5, cos, sin, kv_scale=kv_scale)

    rotated = k if cos is None else ops.rotary_embed(k, cos, sin)
    slots = meta.slot_mapping
    for cache, x, s, keys in ((k_cache, rotated, kv_scale.k, True), (v_cache, v, kv_scale.v, False)):
        got, expected = _written(cache, slots, keys), quantize_kv(x, s, kv_dtype).view(torch.uint8)
        wrong = (got != expected).nonzero()
        assert not len(wrong), [
            (x[tuple(i)].item(), got[tuple(i)].item(), expected[tuple(i)].item()) for i in wrong[:5]
        ]
    # Nothing but those slots: the whole caches are the reference's, K pages transposed.
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(k_ref, v_ref, rotated, v, slots, kv_scale)
    k_pages = k_ref.view(torch.uint8).transpose(2, 3).contiguous().flatten()
    assert torch.equal(k_cache.view(torch.uint8).flatten(), k_pages)
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def run_fp8_attention(seqs, heads, kv_heads, head_dim, block_size, dtype, kv_dtype, kv_scale, rotary, seed):
    """Two steps over a scattered paged cache, as test_cpu_kernels.run_attention runs them
    (each sequence's history as a prefill, then decode rows, fresh prefills and chunks
    after cached tokens), the kernel on its cache and the torch backend on its own: the
    same outputs, and the same bytes at every written slot."""
    num_blocks, tables, qs, ks, vs = random_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    # Unwritten bytes are NaN codes, which widen to 480 (e4m3) or 114688 (e5m2) times the
    # scale, or NaN (bf16): a kernel that lets one reach a score or an output is far off.
    if kv_dtype == torch.bfloat16:
        k_cache, v_cache = (
            torch.full(shape, float("nan"), dtype=kv_dtype),
            torch.full(shape, float("nan"), dtype=kv_dtype),
        )
    else:
        k_cache = torch.full(shape, 0x7F, dtype=torch.uint8).view(kv_dtype)
        v_cache = torch.full(shape, 0x7F, dtype=torch.uint8).view(kv_dtype)
    k_ref, v_ref = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    scale = head_dim**-0.5

    def step(rows: list[int], starts: list[int], ends: list[int]):
        lens = [e - s for s, e in zip(starts, ends, strict=True)]
        meta = build_metadata([tables[i] for i in rows], ends, lens, block_size, "cpu")
        pick = lambda xs: torch.cat([xs[i][s:e] for i, s, e in zip(rows, starts, ends, strict=True)])  # noqa: E731
        q, k, v = pick(qs), pick(ks), pick(vs)
        cos = sin = None
        if rotary:
            positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
            cos, sin = (t.to(dtype) for t in _rotary(positions, head_dim))
        out = ops.paged_attention(q, k, v, k_cache, v_cache, meta, scale, cos, sin, kv_scale=kv_scale)
        if rotary:  # the reference takes q and k rotated, as the kernel rotates them
            q, k = ops.rotary_embed(q, cos, sin), ops.rotary_embed(k, cos, sin)
        meta = build_metadata([tables[i] for i in rows], ends, lens, block_size, "cpu")
        with forward_context(ForwardContext([(k_ref, v_ref)], meta, kv_scales=[kv_scale])):
            expected, _ = torch_paged_attention(
                _Layer(), *(t.transpose(0, 1)[None] for t in (q, k, v)), None, scaling=scale
            )
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), expected[0].float(), atol=tol, rtol=tol)
        slots = meta.slot_mapping
        assert torch.equal(
            _written(k_cache, slots, True),
            _bits(k_ref)[slots // block_size, :, slots % block_size],
        )
        assert torch.equal(
            _written(v_cache, slots, False),
            _bits(v_ref)[slots // block_size, :, slots % block_size],
        )

    history = [i for i, (c, _) in enumerate(seqs) if c > 0]
    if history:
        step(history, [0] * len(history), [seqs[i][0] for i in history])
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0] > 0))
    step(order, [seqs[i][0] for i in order], [sum(seqs[i]) for i in order])


SEQS = [(5, 1), (40, 1), (1, 1), (0, 19), (23, 9), (0, 1), (64, 3), (90, 12)]
# A unit scale, calibrated-looking ones, and ones small enough that a few percent of
# randn's keys and values saturate in e4m3.
SCALES = [KVScale(), KVScale(0.037, 0.021), KVScale(0.0047, 0.0041)]


@pytest.fixture(params=[False, True], ids=["fresh-by-kernel", "fresh-by-sdpa"])
def fresh_prefills_by_sdpa(request, monkeypatch):
    monkeypatch.setattr(ops, "FRESH_PREFILLS_BY_SDPA", request.param)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (24, 3): attend_any, and pages whose size is not a whole number of widening steps;
# (64, 16) and (128, 32): attend_impl's specialisations.
@pytest.mark.parametrize(("head_dim", "block_size"), [(24, 3), (64, 16), (128, 32)])
@pytest.mark.parametrize("kv_scale", SCALES, ids=["unit", "calibrated", "saturating"])
def test_attention_over_fp8_matches_torch(
    kv_dtype, dtype, head_dim, block_size, kv_scale, fresh_prefills_by_sdpa
):
    run_fp8_attention(
        SEQS, 6, 2, head_dim, block_size, dtype, kv_dtype, kv_scale, rotary=False, seed=head_dim
    )


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 1)])
def test_fused_rotary_over_fp8_matches_torch(kv_dtype, dtype, heads, kv_heads, fresh_prefills_by_sdpa):
    run_fp8_attention(SEQS, heads, kv_heads, 64, 16, dtype, kv_dtype, SCALES[1], rotary=True, seed=7)


def test_caches_of_another_dtype_are_only_fp8_or_bf16_beside_fp32():
    meta = build_metadata([[0]], [1], [1], 4, "cpu")
    q, k, v = (torch.randn(1, 1, 16) for _ in range(3))
    caches = torch.zeros(kv_cache_shape(1, 4, 1, 16), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="one dtype"):
        ops.paged_attention(q, k, v, caches, caches.to(torch.float8_e5m2), meta, 0.25)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    with pytest.raises(ValueError, match="one dtype"):
        ops.paged_attention(*bf16, caches.float(), caches.float(), meta, 0.25)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2", "bfloat16"])
def test_native_decoder_over_fp8_same_as_python_loop(kv_cache_dtype, tmp_path, tokenizer):
    """decoder.c passes each layer's fp8 scales and the cache's format (or a bf16 cache's,
    beside the float32 model) to the kernel as the Python loop does: the same tokens and
    logprobs, bit for bit."""
    _gemm_c_runs("float32")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["llama-gqa4"]).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
              cpu_kernels="gemm.c", kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    runner = llm.engine.runner
    assert runner.run_decoder.native is not None
    assert runner.kv_caches[0][0].dtype in [*FP8, torch.bfloat16]
    prompts = [tokenizer(p).input_ids for p in ["Hello there", "A longer prompt with more tokens in it", "x"]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    ours, theirs, native_steps = _both_loops(llm, prompts, params)
    _assert_same(ours, theirs)
    assert native_steps > 0


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 3, 16, 32]),
    group=st.sampled_from([1, 3]),
    bf16=st.booleans(),
    e5m2=st.booleans(),
    fresh_by_sdpa=st.booleans(),
)
def test_fp8_attention_any_batch(seqs, block_size, group, bf16, e5m2, fresh_by_sdpa):
    """test_cpu_kernels' property test of any batch, over fp8 caches."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    kv_dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "FRESH_PREFILLS_BY_SDPA", fresh_by_sdpa)
        run_fp8_attention(
            seqs, 2 * group, 2, 32, block_size, dtype, kv_dtype, SCALES[1], rotary=bf16, seed=len(seqs)
        )


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize(("head_dim", "block_size"), [(24, 3), (64, 16)])
def test_bf16_cache_beside_fp32_activations_matches_torch(
    head_dim, block_size, rotary, fresh_prefills_by_sdpa
):
    """kv_cache_dtype="bfloat16" with a float32 model: bf16 pages, fp32 everything else."""
    run_fp8_attention(
        SEQS, 6, 2, head_dim, block_size, torch.float32, torch.bfloat16, KVScale(), rotary=rotary, seed=3
    )
