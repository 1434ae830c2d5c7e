"""The fused GPU decoder (replica/gpu/) on a GPU, or on CPU through the same code with its
Triton kernels under TRITON_INTERPRET=1: the kernels against their torch references, the
references compiled against themselves, the whole engine's greedy output against HF
`generate` in float32 (Llama, Qwen2's biases, Qwen3's per-head norms), the fused decoder
against transformers' modules in bfloat16, and the number of operations a decode step
launches per layer, bounded, so that a change that unfuses something fails here without a
GPU."""

import contextlib

import pytest
import torch
from conftest import hf_greedy, triton_device

DEVICE = triton_device()

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.cpu.kernel_choice import LinearChoice  # noqa: E402
from replica.gpu import fused_ops  # noqa: E402
from replica.gpu.decoder import GPUFusedDecoder  # noqa: E402
from replica.gpu.op_choice import COMPILED, IMPLEMENTATIONS, TORCH  # noqa: E402
from replica.kv_quant import KVScale  # noqa: E402
from replica.model_runner import ModelRunner  # noqa: E402

SHAPES = dict(
    vocab_size=49152,  # the bundled tokenizer's
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS = {
    "llama": LlamaConfig(num_hidden_layers=2, **SHAPES),
    "qwen2": Qwen2Config(num_hidden_layers=2, **SHAPES),  # q, k, v biases
    "qwen3": Qwen3Config(num_hidden_layers=2, head_dim=16, **SHAPES),  # per-head q and k norms
}


def _save(path, config, tokenizer, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """name -> (path, float32 HF model)."""
    out = {}
    for name, config in CONFIGS.items():
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        out[name] = (path, _save(path, config, tokenizer))
    return out


def _ulps(dtype: torch.dtype) -> dict:
    """Tolerances of a few roundings in `dtype` (the interpreter's bf16 casts truncate)."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.04)


# -- the kernels against their references ----------------------------------------------------

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(0, 5),
    n=st.integers(1, 200),
    dtype=DTYPES,
    with_residual=st.booleans(),
    seed=st.integers(0, 99),
)
def test_add_rms_norm_matches_reference(rows, n, dtype, with_residual, seed):
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(rows, n, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = torch.randn(n, generator=g).to(DEVICE, dtype)
    mine, ref = residual.clone(), residual.clone()
    out = fused_ops.add_rms_norm(x, weight, 1e-5, mine if with_residual else None)
    expected = fused_ops.add_rms_norm_reference(x, weight, 1e-5, ref if with_residual else None)
    torch.testing.assert_close(out, expected, **_ulps(dtype))
    torch.testing.assert_close(mine, ref, **_ulps(dtype))


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 5), n=st.integers(1, 1500), dtype=DTYPES, seed=st.integers(0, 99))
def test_silu_mul_matches_reference(rows, n, dtype, seed):
    gate_up = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    torch.testing.assert_close(
        fused_ops.silu_mul(gate_up), fused_ops.silu_mul_reference(gate_up), **_ulps(dtype)
    )


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([2, 8, 16, 24, 40]),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=DTYPES,
    head_norms=st.booleans(),
    fp8=st.sampled_from([None, torch.float8_e4m3fn, torch.float8_e5m2]),
    seed=st.integers(0, 99),
)
def test_rope_write_kv_matches_rotary_then_the_cache_write(
    tokens, kv_heads, group, head_dim, block_size, dtype, head_norms, fp8, seed
):
    """q rotated, k rotated and v as it is in the cache at each slot, none at a negative
    slot, every other slot untouched; with and without Qwen3's per-head norms, in a cache
    of the model's dtype or an fp8 one with its scales (within one fp8 step: the reference
    rounds k in the model's dtype before quantizing it)."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    angles = torch.randn(tokens, head_dim // 2, generator=g).repeat(1, 2).to(DEVICE)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    num_blocks = -(-tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(DEVICE)
    slots[0] = -1  # a padded row
    cache_dtype = fp8 or dtype
    caches = [
        torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(DEVICE, cache_dtype)
        for _ in range(2)
    ]
    mine, ref = [c.clone() for c in caches], [c.clone() for c in caches]
    norms = (
        torch.rand(head_dim, generator=g).to(DEVICE, dtype) + 0.5,
        torch.rand(head_dim, generator=g).to(DEVICE, dtype),
        1e-6,
    )
    norms = norms if head_norms else None
    args = (slots, heads, kv_heads, KVScale(0.5, 2.0) if fp8 else KVScale(), norms)
    q = fused_ops.rope_write_kv(qkv, cos, sin, *mine, *args)
    expected = fused_ops.rope_write_kv_reference(qkv, cos, sin, *ref, *args)
    torch.testing.assert_close(q, expected, **_ulps(dtype))
    written = {int(s) for s in slots[1:]}
    for a, b, before in zip(mine, ref, caches, strict=True):
        if fp8:  # one step of e4m3 is 1/8 of the value, of e5m2 1/4; k is stored / 0.5
            atol = 2**-9 if dtype == torch.float32 else 2 * _ulps(dtype)["atol"]
            torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=0.26)
        else:
            torch.testing.assert_close(a, b, **_ulps(dtype))
        for slot in set(range(num_blocks * block_size)) - written:
            block, offset = divmod(slot, block_size)
            assert torch.equal(
                a[block, :, offset].view(torch.uint8), before[block, :, offset].view(torch.uint8)
            )


# -- the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_with_the_fused_gpu_decoder_matches_hf(models, tokenizer, name):
    """Greedy output through the engine on the Triton backend (the GPU path: padded decode
    batches, chunked prefill beside decodes) equals HF generate token for token in fp32."""
    path, model = models[name]
    prompts = [tokenizer(p).input_ids for p in ["Hi", "The sky is", "One two three four five six seven", "x"]]
    lengths = [4, 9, 6, 12]
    expected = [hf_greedy(model, p, n, set()) for p, n in zip(prompts, lengths, strict=True)]
    llm = LLM(
        str(path), dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=48, attention_backend="triton",
        max_num_batched_tokens=8,  # prompts in chunks, beside decodes
    )  # fmt: skip
    runner = llm.engine.runner
    assert isinstance(runner.run_decoder, GPUFusedDecoder)
    runner.graphs = runner.build_graph_runner(max_batch=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_torch_references_where_chosen_give_the_same_tokens(models, tokenizer):
    """Where the measurement picks the torch references (op_choice.py), the engine still
    equals HF: both implementations of each op are the same function."""
    path, model = models["llama"]
    prompts = [tokenizer(p).input_ids for p in ["The sky is", "One two three"]]
    expected = [hf_greedy(model, p, 6, set()) for p in prompts]
    llm = LLM(
        str(path), dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=32, attention_backend="triton"
    )
    # torch at up to 2 rows (decodes of both), Triton above (the prefills)
    choice = LinearChoice((2, 8), (TORCH, "triton"))
    llm.engine.runner.run_decoder.op_choices.choices = dict.fromkeys(IMPLEMENTATIONS, choice)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_the_compiled_references_equal_the_references():
    """torch.compile's candidates (inductor: C++ on CPU, Triton on a GPU) compute what the
    references do, the in-place residual and the cache write included."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(3, 64, generator=g).to(DEVICE) for _ in range(2))
    weight = torch.randn(64, generator=g).to(DEVICE)
    gate_up = torch.randn(3, 96, generator=g).to(DEVICE)
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)
    cos = torch.randn(3, head_dim, generator=g).to(DEVICE)
    slots = torch.tensor([0, 5, -1], device=DEVICE)
    args = {
        "add_rms_norm": lambda: (x, weight, 1e-6, residual.clone()),
        "silu_mul": lambda: (gate_up,),
        "rope_write_kv": lambda: (
            qkv,
            cos,
            cos.flip(0),
            torch.zeros(4, kv_heads, 4, head_dim, device=DEVICE),
            torch.zeros(4, kv_heads, 4, head_dim, device=DEVICE),
            slots,
            heads,
            kv_heads,
        ),  # fmt: skip
    }
    for op, impls in IMPLEMENTATIONS.items():
        given, expected_args = args[op](), args[op]()
        torch.testing.assert_close(impls[COMPILED](*given), impls[TORCH](*expected_args))
        for a, b in zip(given, expected_args, strict=True):  # what each wrote in place
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: ops are timed with CUDA events")
def test_each_fused_op_is_timed_on_the_gpu_and_chosen_per_row_count(models):
    path, _ = models["qwen3"]
    runner = _runner(path, "bfloat16", "fused")
    timings = runner.op_timings
    assert timings is not None and timings["buckets"]
    for op in IMPLEMENTATIONS:
        for name, seconds in timings[op].items():
            assert len(seconds) == len(timings["buckets"])
            # torch.compile's candidate may fail to compile (inf: never chosen); the others run.
            assert all(0 < t < 1 for t in seconds) or (name == COMPILED and all(t > 0 for t in seconds))
        assert set(runner.run_decoder.op_choices.choices[op].kernels) <= set(timings[op])


def _runner(path, dtype: str, gpu_decoder: str) -> ModelRunner:
    config = EngineConfig(
        model=str(path), dtype=dtype, device=DEVICE, block_size=4, num_kv_blocks=32, max_model_len=64,
        attention_backend="triton", gpu_decoder=gpu_decoder,
    )  # fmt: skip
    return ModelRunner(config, path)


def _prefill_and_decode(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a mixed step (two prefills), then of a decode step of both rows."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in (7, 10)]
    tables = [[0, 1], [2, 3, 4]]
    first = runner.execute(prompts, [7, 10], tables, sample_rows=[0, 1])
    second = runner.execute([[5], [6]], [8, 11], tables, sample_rows=[0, 1])
    return [first.float(), second.float()]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_fused_decoder_matches_transformers_modules_in_bf16(models, name):
    """The same steps through both decoders in bfloat16: logits within bf16 rounding (the
    fused kernels round rotary once and the residual as transformers does)."""
    path, _ = models[name]
    fused, plain = _runner(path, "bfloat16", "fused"), _runner(path, "bfloat16", "transformers")
    assert isinstance(fused.run_decoder, GPUFusedDecoder)
    assert not isinstance(plain.run_decoder, GPUFusedDecoder)
    for a, b in zip(_prefill_and_decode(fused), _prefill_and_decode(plain), strict=True):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


# -- the operations a decode step launches -------------------------------------------------

# What a decode step of the fused decoder launches per layer on a GPU: RMSNorm with the skip
# connection (2), the q/k/v and gate/up GEMMs (2), rotary with the KV write (1), decode
# attention (1, plus its merge when the context is split), the output and down GEMMs (2),
# SiLU * up (1): 9, and the merge where the context is split (docs/gpus.md's table).
# transformers' modules launch more than twice the bound (the test's last assertion).
LAUNCHES_PER_LAYER = 9
MAX_LAUNCHES_PER_LAYER = 10
MERGE = "triton:_decode_merge_kernel"


class LaunchCounter(TorchDispatchMode):
    """Counts what would launch a GPU kernel: each aten op that computes (not a view, not an
    allocation) and each Triton kernel launch; the torch ops the interpreter runs inside a
    launch are its own, not counted."""

    NO_KERNEL = {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "detach",
        "lift_fresh",
        "alias",
        "_unsafe_view",
    }

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_triton and not func.is_view and func._overloadpacket.__name__ not in self.NO_KERNEL:
            self.ops.append(str(func._overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self):
        kernel_type = type(fused_ops._silu_mul_kernel)  # compiled (JITFunction) or interpreted
        run = kernel_type.run

        def counted(fn, *args, **kwargs):
            self.ops.append(f"triton:{fn.fn.__name__}")
            self._in_triton += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._in_triton -= 1

        kernel_type.run = counted
        try:
            with self:
                yield self
        finally:
            kernel_type.run = run


def _decode_launches(path, gpu_decoder: str, torch_ops: bool = False) -> list[str]:
    """The operations of one padded decode step's forward (what a CUDA graph captures),
    lm_head and the graph's input copies aside. torch_ops: the fused decoder with every
    element-wise op's torch reference chosen."""
    runner = _runner(path, "float32", gpu_decoder)
    if torch_ops:
        runner.run_decoder.op_choices.choices = dict.fromkeys(IMPLEMENTATIONS, LinearChoice.forced(TORCH))
    runner.execute([[1, 2, 3], [4, 5]], [3, 2], [[0], [1]], sample_rows=[0, 1])
    graphs = runner.build_graph_runner(max_batch=2)
    forward = graphs.forward
    counter = LaunchCounter()

    def counted(*args, **kwargs):
        with counter.counting():
            return forward(*args, **kwargs)

    graphs.forward = counted
    graphs.run([6, 7], [4, 3], [[0], [1]], None, None)
    return counter.ops


@pytest.fixture(scope="module")
def depth_models(tmp_path_factory, tokenizer):
    """The same Llama shapes with 1 and 3 layers: launches per layer are their difference / 2."""
    paths = {}
    for layers in (1, 3):
        paths[layers] = tmp_path_factory.mktemp(f"llama-{layers}")
        _save(paths[layers], LlamaConfig(num_hidden_layers=layers, **SHAPES), tokenizer)
    return paths


def test_a_decode_step_launches_at_most_ten_operations_per_layer(depth_models):
    counts, merges = {}, {}
    for name, decoder, torch_ops in [("fused", "fused", False), ("fused, torch's ops", "fused", True),
                                     ("transformers", "transformers", False)]:  # fmt: skip
        one, three = (_decode_launches(depth_models[n], decoder, torch_ops) for n in (1, 3))
        counts[name] = (len(three) - len(one)) / 2
        merges[name] = (three.count(MERGE) - one.count(MERGE)) / 2
    assert counts["fused"] == LAUNCHES_PER_LAYER + merges["fused"], _decode_launches(depth_models[1], "fused")
    assert counts["fused"] <= MAX_LAUNCHES_PER_LAYER, counts
    # The bound bites: the same packed GEMMs with the ops unfused, and transformers'
    # modules, through the same counter, launch more.
    assert counts["fused, torch's ops"] > MAX_LAUNCHES_PER_LAYER, counts
    assert counts["transformers"] > 2 * MAX_LAUNCHES_PER_LAYER, counts
