"""8-bit linears on GPUs (replica/quantized_linear.py): quantization="int8" through
torch._int_mm and "fp8" through torch._scaled_mm.

Both entry points also run on a CPU (as reference loops), so the arithmetic, the padding,
the swap of a model's linears and the fp8 checkpoint's conversion are tested here on any
machine; the engine runs them only on CUDA, where the tests of it skip without a GPU."""

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gpu_path import TINY
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from replica.checkpoint_quantization import attach_weight_scales, checkpoint_quantization, dense_copy
from replica.config import EngineConfig
from replica.quantized_linear import (
    FP8,
    FP8_MAX,
    QuantizedLinear,
    fp8_supported,
    quantize_linears,
    quantize_rows,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and fp8_supported(torch.device("cuda"))),
    reason="needs a CUDA GPU with fp8 GEMMs (compute capability 8.9 or newer)",
)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def cpu_int_mm_is_exact() -> bool:
    """Whether torch's CPU `_int_mm` gives exact int32 sums here, measured on a product of
    full-range int8s. Where oneDNN runs it with AVX2 alone (no VNNI: an AVX2-only EPYC,
    or ONEDNN_MAX_CPU_ISA=AVX2 on a Zen 4), it multiplies u8 by s8 in pairs summed in 16
    bits, which saturate: most sums of such a product come out wrong. The engine never
    runs this module on a CPU (replica/cpu/int8.py is its CPU int8), so only the CPU
    runs of its int8 tests depend on it."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (256, 64), generator=g, dtype=torch.int8)
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


needs_exact_cpu_int_mm = pytest.mark.skipif(
    not cpu_int_mm_is_exact(),
    reason="torch's CPU _int_mm is inexact on this CPU (measured: oneDNN's AVX2 path)",
)


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[:, None]


def reference(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """What the layer computes, in float64: x quantized per token, times its dequantized
    weight, plus bias."""
    xq, xs = quantize_rows(x.reshape(-1, layer.in_features), layer.kind)
    y = dequantized(xq, xs) @ dequantized(layer.weight, layer.weight_scale).T
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["int8", "fp8"]),
    rows=st.integers(1, 8),
    cols=st.integers(1, 64),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    zero_row=st.booleans(),
)
def test_quantize_rows_is_within_half_a_step(kind, rows, cols, magnitude, zero_row):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * magnitude
    if zero_row:
        x[0] = 0
    q, scale = quantize_rows(x, kind)
    limit = 127 if kind == "int8" else FP8_MAX
    assert q.dtype == (torch.int8 if kind == "int8" else FP8)
    torch.testing.assert_close(scale, x.abs().amax(dim=1) / limit)
    assert (q.float().abs() <= limit).all()
    assert q.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0].eq(limit).all()  # the largest hits the limit
    error = (dequantized(q, scale) - x.double()).abs()
    if kind == "int8":
        assert (error <= scale.double()[:, None] / 2 * (1 + 1e-6)).all()
    else:  # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value, or 2^-10 * scale below 2^-6
        bound = torch.maximum(x.double().abs() * 2**-4, scale.double()[:, None] * 2**-10)
        assert (error <= bound * (1 + 1e-6)).all()
    if zero_row:
        assert (q[0].float() == 0).all() and scale[0] == 0


@pytest.mark.parametrize(
    ("device", "kind"),
    [
        pytest.param("cpu", "int8", marks=needs_exact_cpu_int_mm),
        ("cpu", "fp8"),
        pytest.param("cuda", "int8", marks=needs_cuda),
        pytest.param("cuda", "fp8", marks=needs_cuda),
    ],
)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 70),  # across the padding to 32 rows and to whole 16s
    shape=st.sampled_from([(64, 32), (48, 96), (256, 64)]),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_quantized_linear_matches_a_dequantize_then_matmul_reference(device, kind, rows, shape, bias, dtype):
    if kind == "fp8" and device == "cuda" and not fp8_supported(torch.device(device)):
        pytest.skip("this GPU has no fp8 GEMMs")
    g = torch.Generator().manual_seed(rows)
    k, n = shape
    linear = torch.nn.Linear(k, n, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    layer = QuantizedLinear(linear.to(device), kind)
    x = torch.randn(1, rows, k, generator=g).to(dtype).to(device)
    y = layer(x)
    assert y.shape == (1, rows, n) and y.dtype == dtype
    expected = reference(x, layer)
    # int8: exact int32 sums, then two fp32 multiplies and the rounding to `dtype`; fp8:
    # fp32 sums rounded to bf16 (row-wise scaled fp8 GEMMs write bf16).
    ulp = 2**-8 if kind == "fp8" or dtype == torch.bfloat16 else 2**-20
    torch.testing.assert_close(y.double(), expected, rtol=ulp, atol=ulp * expected.abs().amax().item())
    # ...and within a few percent of the unquantized product.
    exact = x.double() @ linear.weight.double().to(device).T + (
        0 if linear.bias is None else linear.bias.double()
    )
    rms = ((y.double() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
    assert rms < (0.02 if kind == "int8" else 0.06)


@pytest.fixture
def tiny(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY).eval()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


class FakeQuantized(torch.nn.Module):
    """The oracle's linear: x and W quantized as QuantizedLinear quantizes them, then
    dequantized and multiplied in float (no 8-bit GEMM)."""

    def __init__(self, linear: torch.nn.Linear, kind: str):
        super().__init__()
        self.kind, self.linear = kind, linear
        self.w = dequantized(*quantize_rows(linear.weight.detach(), kind)).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]), self.kind)
        y = dequantized(xq, xs).float() @ self.w.T
        if self.kind == "fp8":
            y = y.bfloat16()  # as the fp8 GEMM writes it
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", [pytest.param("int8", marks=needs_exact_cpu_int_mm), "fp8"])
def test_quantize_linears_swaps_the_decoders_linears_and_lm_head(kind, tiny, tokenizer):
    """A model whose linears are swapped generates what the same model with fake-quantized
    linears generates; the embeddings and norms stay in float."""
    _, model = tiny
    oracle = copy.deepcopy(model)
    embed = model.get_input_embeddings().weight.detach().clone()
    assert quantize_linears(model, kind) == TINY.num_hidden_layers * 7 + 1
    assert isinstance(model.get_output_embeddings(), QuantizedLinear)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert torch.equal(model.get_input_embeddings().weight, embed)  # tied to lm_head, which is copied
    for name, module in list(oracle.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(oracle.get_submodule(parent) if parent else oracle, child, FakeQuantized(module, kind))
    for text in ["Hello there, how are you today?", "The sky is"]:
        prompt = tokenizer(text).input_ids
        assert greedy(model, prompt, 10) == greedy(oracle, prompt, 10)


def test_fp8_is_accepted_and_refused_on_cpu_by_name(tiny):
    path, _ = tiny
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization='fp8' runs on GPUs with fp8 GEMMs"):
        LLM(str(path), dtype="float32", device="cpu", quantization="fp8")


@pytest.mark.parametrize(
    ("scheme", "kind", "fmt"),
    [
        ("FP8_DYNAMIC", "fp8", "float-quantized"),
        ("FP8", "fp8", "float-quantized"),
        ("W8A8", "int8", "int-quantized"),
    ],
)
def test_a_checkpoint_converts_to_its_own_8_bit_weights(scheme, kind, fmt, tiny, tmp_path, tokenizer):
    """A compressed-tensors checkpoint (made by the compressed-tensors package: FP8_DYNAMIC
    per channel, FP8 per tensor, W8A8 int8 per channel) is recognised, an fp8 one refused
    on a CPU before anything is converted, and its dense copy, loaded in bf16 as a GPU
    loads it, gives QuantizedLinear the checkpoint's own weights and scales, bit for bit."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is a dev dependency")
    from safetensors import safe_open

    from bench.compressed_checkpoint import save_compressed

    _, model = tiny
    checkpoint = tmp_path / scheme
    quantized = save_compressed(model, checkpoint, tokenizer, scheme)
    assert json.loads((checkpoint / "config.json").read_text())["quantization_config"]["format"] == fmt
    assert checkpoint_quantization(checkpoint) == kind
    if kind == "fp8":
        with pytest.raises(ValueError, match="quantization='fp8' runs on GPUs"):
            LLM(str(checkpoint), dtype="float32", device="cpu")
        assert not (tmp_path / "cache" / "models").exists()  # refused before converting

    dense = dense_copy(checkpoint, kind)
    loaded = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16).eval()
    attach_weight_scales(loaded, dense)
    quantize_linears(loaded, kind)
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for name, weight in quantized.items():
            layer = loaded.get_submodule(name)
            assert weight.dtype == (FP8 if kind == "fp8" else torch.int8)
            assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8)), name
            scale = f.get_tensor(f"{name}.weight_scale").float().reshape(-1)
            assert torch.equal(layer.weight_scale, scale.expand(weight.shape[0])), name


@needs_cuda
@pytest.mark.parametrize("kind", ["int8", pytest.param("fp8", marks=needs_fp8_gpu)])
def test_engine_greedy_equals_hf_with_the_same_quantized_linears_on_cuda(kind, tiny, tokenizer):
    """kvserve on CUDA (auto backend, CUDA graphs for decode) against HF `generate` on the
    GPU with the same QuantizedLinear swapped in; the linears hold a third of bf16's bytes
    or less (int8 or e4m3 plus a scale per row, against fp32 here)."""
    path, model = tiny
    reference = copy.deepcopy(model).cuda()
    quantize_linears(reference, kind)
    prompts = [tokenizer(t).input_ids for t in ["Hello there, how are you today?", "The sky is", "x"]]
    expected = [greedy(reference, p, 12) for p in prompts]
    llm = LLM(
        str(path), dtype="float32", device="cuda", quantization=kind, num_kv_blocks=64, max_model_len=256
    )
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.weights.quantization == kind
    assert (
        sum(isinstance(m, QuantizedLinear) for m in runner.model.modules()) == TINY.num_hidden_layers * 7 + 1
    )
    dense_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert runner.weights.linear_bytes <= 0.3 * dense_bytes
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
