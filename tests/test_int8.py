"""int8 weights on CPU (quantization="int8": replica/cpu/int8.py, gemm_int8.c): the
kernels against a quantize, then dequantize-and-matmul reference; the selector's fallback
to an unquantized kernel where that measures faster; decoder.c's loop against the Python
one; and the engine's greedy tokens against HF `generate` on the same quantized model."""

import pytest
import torch
from conftest import hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gpu_path import TINY
from test_native_decoder import _assert_same, _both_loops
from test_other_models import CONFIGS
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from replica.config import EngineConfig
from replica.cpu import int8, kernel_choice, linear_kernels, ops
from replica.cpu.kernel_choice import KernelChooser, LinearChoice, LinearShape
from replica.cpu.layers import PackedLinear

RUNNABLE_FP32 = [k for k in linear_kernels.LINEAR_KERNELS if linear_kernels.can_run(k, torch.float32, 64)]
needs_gemm_i8 = pytest.mark.skipif(
    not int8.i8_gemm_available(), reason="gemm_int8.c's kernel needs AVX2 and FMA"
)


def quantized_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What gemm_i8 computes, in torch: x quantized per row to activation_limit(k) (as the
    C code rounds it: x * (limit / peak), to nearest even), the weight per row to 127 (or
    with `scale`), the integer products summed exactly (in float64), then scaled."""
    q, scale = int8.quantize_per_row(weight, scale)
    limit = float(int8.activation_limit(x.shape[1]))
    peak = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(peak > 0, torch.full_like(peak, limit) / peak, 0.0)  # a float32 division, as in C
    xq = (x * inv).round()
    sums = xq.double() @ q.double().T
    y = sums.float() * (scale[None, :] * torch.where(peak > 0, peak / limit, 0.0))
    return y if bias is None else y + bias


def gated_reference(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


@needs_gemm_i8
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 20),
    out_features=st.integers(1, 40),
    in_features=st.integers(1, 70),
    gated=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemm_i8_matches_the_reference(rows, out_features, in_features, gated, with_bias, seed):
    """Any shape: odd k (a zero-padded pair), n off the 16-row panels, tiles of 1 to 6
    rows, gated or not, with or without bias."""
    g = torch.Generator().manual_seed(seed)
    n = 2 * out_features if gated else out_features
    weight = torch.randn(n, in_features, generator=g) * 0.05
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g)
    x[0] = 0.0  # an all-zero row: scale 0, not a division by zero
    expected = quantized_matmul(x, weight, bias)
    if gated:
        expected = gated_reference(expected)
    packed_bias = bias if bias is None or not gated else ops.interleave_gate_up(*bias.chunk(2), 8)
    y = int8.gemm_i8(x, int8.pack_for_gemm_i8(weight, gated), packed_bias, out_features, gated)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@needs_gemm_i8
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576), (49152 // 16, 576)])
def test_gemm_i8_error_against_fp32_on_model_shapes(shape):
    """Against the unquantized product: the error is the weights' rounding (activations
    keep 13 bits at these widths), well under 1% of the outputs' spread."""
    n, k = shape
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(n, k, generator=g) * 0.02, torch.randn(33, k, generator=g)
    assert int8.activation_limit(k) == 8191
    y = int8.gemm_i8(x, int8.pack_for_gemm_i8(weight, False), None, n)
    exact = x @ weight.T
    torch.testing.assert_close(y, quantized_matmul(x, weight, None), rtol=1e-5, atol=1e-5)
    assert ((y - exact).pow(2).mean() / exact.pow(2).mean()).sqrt() < 0.01


def test_activation_limit_keeps_int32_sums():
    for k in (1, 2, 64, 576, 1536, 11008, 14336, 130_000):
        limit = int8.activation_limit(k)
        assert 127 <= limit <= 8191 and (k + 1) * 128 * limit < 2**31  # weights may hold -128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_int8_kernel_matches_weight_only_reference(dtype):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=g) * 0.05, torch.randn(48, generator=g)
    x = torch.randn(5, 64, generator=g).to(dtype)
    q, scale = int8.quantize_per_row(weight)
    expected = x.float() @ (q.float() * scale[:, None]).T + bias
    y = int8.mm_torch(x, int8.pack_for_torch(weight), bias.to(dtype))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expected, rtol=tolerance, atol=tolerance)


@needs_gemm_i8
def test_an_unquantized_kernel_takes_the_rows_where_it_is_faster(monkeypatch, tmp_path):
    """Timings where fp32 gemm.c beats the int8 kernel at large steps (by more than the
    margin): those rows fall back to it, the rest stay int8, and both give their results."""
    kernels = [k for k in LinearShape(48, 64, torch.float32, quantization="int8").kernels()
               if linear_kernels.can_run(k, torch.float32, 64)]  # fmt: skip
    scripted = {k: [9.0] * 8 for k in kernels}
    scripted["int8 gemm.c"] = [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    scripted["gemm.c"] = [2.0] * 8

    def time_linears(timed, shape, buckets):
        assert shape.quantization == "int8" and timed == kernels
        return {k: scripted[k][: len(buckets)] for k in timed}

    monkeypatch.setattr(kernel_choice, "time_linears", time_linears)
    chooser = KernelChooser(max_rows=512, cache_dir=tmp_path, quantization="int8")
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear.of(linear, chooser)
    assert packed.choice.kernels == ("int8 gemm.c", "gemm.c")
    assert set(packed.layouts) == {"int8 gemm.c", "gemm.c"}
    for rows in (1, 300):
        x = torch.randn(rows, 64)
        expected = quantized_matmul(x, linear.weight, linear.bias) if rows == 1 else linear(x)
        torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
    assert "int8/float32 48x64: int8 gemm.c at <=44 rows, gemm.c above" in chooser.describe()
    assert chooser.kept_out == {}


def test_an_int8_linear_no_int8_kernel_wins_is_kept_unquantized_and_says_why(monkeypatch, tmp_path):
    """Where every int8 kernel loses at every step size (torch's int8 kernel against
    oneDNN's AMX one, on a bf16 model), the linear keeps only its float layout, and the
    chooser says so with the times at one row, for the engine's start-up warning."""
    kernels = [k for k in LinearShape(48, 64, torch.float32, quantization="int8").kernels()
               if linear_kernels.can_run(k, torch.float32, 64)]  # fmt: skip
    scripted = {k: [3e-6 * (i + 1) for i in range(8)] for k in kernels}
    scripted["gemm.c"] = [1e-6 * (i + 1) for i in range(8)]
    monkeypatch.setattr(kernel_choice, "time_linears", lambda timed, shape, buckets: {
        k: scripted[k][: len(buckets)] for k in timed})  # fmt: skip
    chooser = KernelChooser(max_rows=512, cache_dir=tmp_path, quantization="int8")
    packed = PackedLinear.of(torch.nn.Linear(64, 48), chooser)
    assert packed.choice.kernels == ("gemm.c",) and set(packed.layouts) == {"gemm.c"}
    why = chooser.kept_out["int8/float32 48x64"]
    int8_at_one = ", ".join(f"{k} 3 us" for k in kernels if k in linear_kernels.INT8_KERNELS)
    assert why.startswith("no int8 kernel was faster at any step size timed; at 1 row: gemm.c 1 us"), why
    assert int8_at_one in why, why


def test_a_kernel_far_slower_at_few_rows_is_not_timed_at_more(monkeypatch):
    """torch's int8 kernel takes seconds at 2048 rows on AVX2 CPUs: once a kernel is
    GIVE_UP_RATIO times slower than the fastest, its later buckets count as infinite."""
    timed = []

    def time_rounds(calls):
        timed.append(sorted(calls))
        return {name: (10.0 if name == "torch" else 1.0) for name in calls}

    monkeypatch.setattr(kernel_choice, "_time_rounds", time_rounds)
    seconds = kernel_choice.time_linears(RUNNABLE_FP32, LinearShape(48, 64, torch.float32), (1, 8, 32))
    assert timed[0] == sorted(RUNNABLE_FP32) and all("torch" not in t for t in timed[1:])
    assert seconds["torch"] == [10.0, float("inf"), float("inf")]


@needs_gemm_i8
def test_forced_kernels_run_their_int8_versions():
    shape = LinearShape(48, 64, torch.float32, quantization="int8")
    assert KernelChooser("gemm.c", quantization="int8").linear(shape) == LinearChoice.forced("int8 gemm.c")
    assert KernelChooser("torch", quantization="int8").linear(shape) == LinearChoice.forced("int8 torch")
    with pytest.raises(ValueError, match="cpu_kernels='onednn' cannot run a linear int8/float32 48x64"):
        KernelChooser("onednn", quantization="int8").linear(shape)


def test_unsupported_quantizations_are_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TINY).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="runs on CPU with kvserve's CPU kernels"):
        LLM(str(tmp_path), dtype="float32", quantization="int8", attention_backend="torch")


def fake_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every linear (lm_head too) computing quantized_matmul: HF's own
    forward around the products kvserve's int8 kernel computes. The embeddings, tied to
    lm_head's weight, stay as they are."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):

            def hook(linear, inputs, output):
                x = inputs[0]
                scale = getattr(linear, "weight_scale", None)  # a checkpoint's
                y = quantized_matmul(x.reshape(-1, x.shape[-1]), linear.weight, linear.bias, scale)
                return y.view(*x.shape[:-1], -1)

            module.register_forward_hook(hook)
    return model


@needs_gemm_i8
def test_greedy_equals_hf_on_the_quantized_model(tmp_path, tokenizer, monkeypatch):
    """fp32, a small token budget so prompts split into chunks, gemm_int8.c forced: HF's
    tokens with every linear's product quantized as the kernel quantizes it."""
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=16, quantization="int8",
              cpu_kernels="gemm.c")  # fmt: skip
    weights = llm.engine.runner.weights
    assert weights.quantization == "int8"
    # int8 layouts of every linear (lm_head too: a quarter of fp32's bytes, plus scales)
    fp32_linear_bytes = 4 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert weights.linear_bytes < 0.27 * fp32_linear_bytes
    texts = ["Hello there, how are you today?", "x", "One two three four"]
    assert_greedy_equals_quantized_hf(llm, model, [tokenizer(t).input_ids for t in texts], 10)


def assert_greedy_equals_quantized_hf(llm: LLM, model, prompts: list[list[int]], max_tokens: int) -> None:
    """`llm`'s greedy tokens are HF `generate`'s on `model` with fake_quantized products."""
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False
    )
    reference = fake_quantized(model)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, max_tokens, set())


@needs_gemm_i8
@pytest.mark.parametrize("name", ["llama-gqa4", "qwen2-bias"])
def test_native_loop_same_as_python_loop(name, tmp_path, tokenizer):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[name]).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=8, quantization="int8",
              cpu_kernels="gemm.c")  # fmt: skip
    native = llm.engine.runner.run_decoder.native
    assert native is not None and native.kernel == "int8 gemm.c"
    prompts = [tokenizer(p).input_ids for p in ["Hello there", "A longer prompt with more tokens in it", "x"]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    ours, theirs, native_steps = _both_loops(llm, prompts, params)
    _assert_same(ours, theirs)
    assert native_steps > 0
