"""4-bit checkpoints (replica/packed_checkpoints.py), made here from a small random model:
GPTQ and AWQ written as AutoGPTQ's and AutoAWQ's packers lay them out (bench/packed_checkpoint.py),
compressed-tensors' W4A16 by the compressed-tensors package itself. Each loads in 4 bits, its weights equal
its format's dequantization (exactly where the zero is a power of two; within the fp16
rounding of -scale * zero otherwise), and the engine's greedy tokens equal HF `generate`
on the weights it loaded."""

import json

import pytest
import torch
from conftest import hf_greedy
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.compressed_checkpoint import save_compressed
from bench.packed_checkpoint import PROJECTIONS, save_packed
from kvserve import LLM, SamplingParams
from replica.cpu import group_quant, linear_kernels
from replica.cpu.group_quant import GroupQuantWeight
from replica.model_loader import ModelNotFoundError

needs_kernels = pytest.mark.skipif(
    not group_quant.group_gemm_available(), reason="gemm_group.c needs AVX2, FMA and F16C"
)
CONFIG = LlamaConfig(
    vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
)  # fmt: skip
GROUP = 128


def _write(method: str, directory, tokenizer, symmetric: bool) -> dict:
    """The random model as a `method` checkpoint; returns each linear's format
    dequantization (fp32 [n, k]) by module name."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG).eval()
    return save_packed(model, method, directory, tokenizer, symmetric, GROUP)


def _compressed(directory, tokenizer, symmetric: bool) -> dict:
    """compressed-tensors' own W4A16 checkpoint; its dequantization by the package's unpacking."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG).eval()
    save_compressed(model, directory, tokenizer, "W4A16" if symmetric else "W4A16_ASYM")
    reference = {}
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        for layer in range(CONFIG.num_hidden_layers):
            for projection in PROJECTIONS:
                name = f"model.layers.{layer}.{projection}"
                shape = torch.Size(f.get_tensor(f"{name}.weight_shape").tolist())
                q = unpack_from_int32(f.get_tensor(f"{name}.weight_packed"), 4, shape).float()
                scale = f.get_tensor(f"{name}.weight_scale").float()
                zero = torch.zeros_like(scale)
                if not symmetric:
                    zero = unpack_from_int32(
                        f.get_tensor(f"{name}.weight_zero_point"), 4, scale.shape, 0
                    ).float()
                expand = lambda t: t.repeat_interleave(GROUP, 1)  # noqa: E731
                reference[name] = (q - expand(zero)) * expand(scale)
    return reference


# Symmetric GPTQ (exact: its zero, stored minus one, is 8), AWQ (always with zero points)
# and compressed-tensors' asymmetric W4A16 (its zero points packed down the rows).
CASES = [("gptq", True), ("awq", False), ("w4a16", False)]


@pytest.fixture(params=CASES, ids=[f"{m}-{'sym' if s else 'asym'}" for m, s in CASES])
def checkpoint(request, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    method, symmetric = request.param
    directory = tmp_path / "checkpoint"
    if method == "w4a16":
        reference = _compressed(directory, tokenizer, symmetric)
    else:
        reference = _write(method, directory, tokenizer, symmetric)
    return method, symmetric, directory, reference


def _loaded(llm: LLM) -> dict[str, GroupQuantWeight]:
    """The 4-bit weights the engine runs, by projection (q/k/v and gate/up split again)."""
    fused = llm.engine.runner.run_decoder
    weights = {}
    for layer, (attention, mlp) in enumerate(zip(fused.attentions, fused.mlps, strict=True)):
        prefix = f"model.layers.{layer}"
        qkv = attention.qkv.layout(linear_kernels.GROUP_GEMM_C)[0].dequantize()
        q_rows, kv_rows = (
            attention.num_heads * attention.head_dim,
            attention.num_kv_heads * attention.head_dim,
        )
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
        gate, up = mlp.gate_up.layout(linear_kernels.GROUP_GEMM_C)[0].dequantize().chunk(2)
        o = attention.o_proj.layout(linear_kernels.GROUP_GEMM_C)[0].dequantize()
        down = mlp.down.layout(linear_kernels.GROUP_GEMM_C)[0].dequantize()
        for projection, w in zip(PROJECTIONS, (q, k, v, o, gate, up, down), strict=True):
            weights[f"{prefix}.{projection}"] = w
    return weights


@needs_kernels
def test_loads_in_4_bits_as_its_format_dequantizes(checkpoint, hf_greedy_model_factory):
    method, symmetric, directory, reference = checkpoint
    llm = LLM(str(directory), dtype="float32", cpu_kernels="gemm.c", kv_cache_memory_gb=0.05)
    assert llm.engine.runner.weights.quantization == method
    loaded = _loaded(llm)
    for name, expected in reference.items():
        ours = loaded[name]
        if method == "gptq" and symmetric:  # -8 * scale is exact in fp16
            assert torch.equal(ours, expected), name
        else:  # scales (and -scale * zero) rounded to fp16: 2^-11 of each term
            bound = 2**-10 * (expected.abs() + reference_terms(expected)) + 1e-7
            assert ((ours - expected).abs() <= bound).all(), name
    # Greedy tokens: HF `generate` on the weights the engine loaded, the exact kernel's product.
    model = hf_greedy_model_factory(loaded)
    tokens = llm.engine.tokenizer.encode("The weather today is")
    out = llm.generate(
        [tokens], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == hf_greedy(model, tokens, 12, set())


def reference_terms(w: torch.Tensor) -> torch.Tensor:
    """A bound on |scale * zero| for each weight: the largest |w| in its group of GROUP
    (both terms are at most the group's range)."""
    groups = w.view(w.shape[0], -1, GROUP).abs().amax(dim=2, keepdim=True)
    return groups.expand(-1, -1, GROUP).reshape(w.shape) * 2


@pytest.fixture
def hf_greedy_model_factory():
    def build(weights: dict[str, torch.Tensor]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIG).eval()  # the same seed: the same embeddings
        with torch.no_grad():
            for name, w in weights.items():
                model.get_submodule(name).weight.copy_(w)
        return model

    return build


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, "GPTQ with 3 bits"),
        ({"desc_act": True, "permute": True}, "act-order"),
    ],
)
def test_gptq_variants_it_cannot_run_are_refused(change, message, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    directory = tmp_path / "gptq"
    _write("gptq", directory, tokenizer, True)
    config = json.loads((directory / "config.json").read_text())
    if change.pop("permute", False):  # act-order: groups no longer in input order
        from safetensors.torch import load_file

        state = load_file(str(directory / "model.safetensors"))
        for name in state:
            if name.endswith(".g_idx"):
                state[name] = state[name].flip(0).contiguous()
        save_file(state, str(directory / "model.safetensors"))
    config["quantization_config"].update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelNotFoundError, ValueError), match=message):
        LLM(str(directory), dtype="float32")
