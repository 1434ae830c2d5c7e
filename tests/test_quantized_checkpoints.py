"""Pre-quantized checkpoints (replica/checkpoint_quantization.py): compressed-tensors
W8A8-INT8 checkpoints, made by the compressed-tensors package itself from small random
models and from the bundled model, run as quantization="int8" with the checkpoint's own
int8 weights; formats kvserve cannot run are refused with an error that names them."""

import json

import pytest
import torch
from test_gpu_path import TINY
from test_int8 import assert_greedy_equals_quantized_hf, needs_gemm_i8
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.compressed_checkpoint import save_compressed
from kvserve import LLM, SamplingParams
from replica.model_loader import ModelNotFoundError


@pytest.fixture
def tiny(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(TINY).eval()


def _checkpoint_scale(checkpoint, name: str, rows: int) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        scale = f.get_tensor(f"{name}.weight_scale").float().reshape(-1)
    return scale.expand(rows) if scale.numel() == 1 else scale


def test_the_checkpoints_int8_weights_are_the_ones_that_run(tiny, tmp_path, tokenizer):
    """torch's int8 kernel keeps its weights as they are: they must be the checkpoint's
    int8 weights and scales, q/k/v side by side as one GEMM takes them."""
    checkpoint = tmp_path / "w8a8"
    quantized = save_compressed(tiny, checkpoint, tokenizer)
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    llm = LLM(str(checkpoint), dtype="float32", cpu_kernels="torch")
    assert llm.engine.runner.weights.quantization == "int8"
    qkv = llm.engine.runner.run_decoder.attentions[1].qkv.layout("int8 torch")[0]
    names = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(qkv.weight, torch.cat([quantized[n] for n in names]))
    scales = [_checkpoint_scale(checkpoint, n, quantized[n].shape[0]) for n in names]
    assert torch.equal(qkv.scale, torch.cat(scales))


@needs_gemm_i8
def test_greedy_equals_hf_on_the_dequantized_checkpoint(tiny, tmp_path, tokenizer):
    """HF `generate` on the checkpoint's weights dequantized, each product quantized as
    gemm_int8.c quantizes it (the checkpoint's weight scales; lm_head, which the
    checkpoint leaves in float, with kvserve's own)."""
    reference = AutoModelForCausalLM.from_config(TINY).eval()
    reference.load_state_dict(tiny.state_dict())
    checkpoint = tmp_path / "w8a8"
    quantized = save_compressed(tiny, checkpoint, tokenizer)
    with torch.no_grad():
        for name, q in quantized.items():
            module = reference.get_submodule(name)
            module.weight_scale = _checkpoint_scale(checkpoint, name, q.shape[0])
            module.weight.copy_(q.float() * module.weight_scale[:, None])
    llm = LLM(str(checkpoint), dtype="float32", block_size=4, max_num_batched_tokens=16, cpu_kernels="gemm.c")
    prompts = [tokenizer(t).input_ids for t in ["Hello there, how are you today?", "x"]]
    assert_greedy_equals_quantized_hf(llm, reference, prompts, 8)


@needs_gemm_i8
def test_a_w8a8_checkpoint_of_the_bundled_model(model_path, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    save_compressed(model, tmp_path / "w8a8", tokenizer)
    llm = LLM(str(tmp_path / "w8a8"), dtype="float32", kv_cache_memory_gb=0.1)
    assert llm.engine.runner.weights.quantization == "int8"
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )
    assert "Paris" in out[0].text


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "GPTQ with 8 bits"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized with 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantized with 'fp8'"),
    ],
)
def test_other_formats_are_refused_by_name(quantization_config, message, tiny, tmp_path, tokenizer):
    tiny.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config_path = tmp_path / "model" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ModelNotFoundError, match=message):
        LLM(str(tmp_path / "model"), dtype="float32")


@pytest.mark.parametrize(
    ("scheme", "message"),
    [("W8A16", "group_0's weights are 8-bit int")],
)
def test_compressed_tensors_schemes_it_cannot_run_are_refused(scheme, message, tmp_path, tokenizer):
    torch.manual_seed(0)
    # Every linear's rows a whole number of 4-bit groups of 128.
    wider = LlamaConfig(**{**TINY.to_dict(), "hidden_size": 128, "intermediate_size": 256, "head_dim": 32})
    save_compressed(AutoModelForCausalLM.from_config(wider).eval(), tmp_path / scheme, tokenizer, scheme)
    with pytest.raises(
        ModelNotFoundError, match=f"compressed-tensors checkpoint kvserve cannot run: {message}"
    ):
        LLM(str(tmp_path / scheme), dtype="float32")
