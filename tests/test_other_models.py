"""Any local HF directory works: small seeded random models of other families and
shapes (GQA ratios, q/k norms, q/k/v biases, head_dim != hidden/heads) against HF
generate, through both CPU attention backends. Llama, Qwen2 and Qwen3 run as
kvserve's fused CPU decoder; Gemma keeps transformers' decoder around the C kernels."""

import pytest
import torch
from conftest import hf_greedy
from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, Qwen2Config, Qwen3Config

from kvserve import LLM, SamplingParams

CONFIGS = {
    "llama-gqa4": LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "qwen3": Qwen3Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
    ),
    "qwen2-bias": Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "gemma": GemmaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
    ),
}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_model_matches_hf(name, backend, tmp_path, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [tokenizer(p).input_ids for p in ["Hello there", "A longer prompt with more tokens in it", "x"]]
    expected = [hf_greedy(model, p, 12, set()) for p in prompts]

    llm = LLM(
        str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=8, attention_backend=backend
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_gguf_path_loads(model_path):
    from replica.model_loader import bundled_gguf_path, resolve_model

    assert resolve_model(str(bundled_gguf_path())) == model_path
