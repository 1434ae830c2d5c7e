"""The random-weight Llama models the GPU benchmarks run (bench.gpu, bench.quantized_gemm,
bench.lora --device cuda): seeded weights in bf16 with the bundled tokenizer, so that no
download is needed. Its vocabulary is smaller than the model's, so prompts are token ids
and out-of-vocabulary output ids decode to nothing."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from replica.model_loader import bundled_tokenizer_path

LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=4096,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def build_model(path: Path, shape: dict, device: str) -> None:
    """Saves a model of `shape` to `path`, unless one is there already."""
    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.2B weights is much faster on the GPU
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(bundled_tokenizer_path()).save_pretrained(path)
    del model
