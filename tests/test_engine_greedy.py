"""The oracle: greedy output equals HF transformers `generate` token for token (fp32)."""

import pytest
import torch
from conftest import hf_greedy

from kvserve import LLM, SamplingParams

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List the three primary colors of light:",
    "Translate to French: I would like a cup of coffee, please.",
    "The quick brown fox jumps over the lazy dog. " * 6 + "What did the fox do?",
    "In the beginning of the twentieth century, physics changed forever when Albert Einstein "
    "published his papers on special relativity, the photoelectric effect and Brownian motion. "
    "Summarise their importance in one sentence:",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids), "prompts should have different lengths"
    return ids


@pytest.fixture(scope="module")
def expected(hf_model, prompt_ids, llm_fp32):
    eos = set(llm_fp32.engine.eos_token_ids)
    return [hf_greedy(hf_model, ids, MAX_NEW, eos) for ids in prompt_ids]


def _generate(llm: LLM, prompt_ids):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    return [o.token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]


def test_matches_hf_with_ample_cache(llm_fp32, prompt_ids, expected):
    assert _generate(llm_fp32, prompt_ids) == expected
    assert llm_fp32.engine.stats().num_preemptions == 0


def test_torch_backend_matches_hf(model_path, prompt_ids, expected):
    """The default on CPU is kvserve's C kernels; the portable torch backend stays exact too."""
    llm = LLM(str(model_path), dtype="float32", attention_backend="torch")
    assert llm.engine.runner.backend.name == "torch"
    assert _generate(llm, prompt_ids) == expected


def test_matches_hf_with_chunked_prefill(model_path, prompt_ids, expected):
    budget = 16
    assert max(len(p) for p in prompt_ids) > 3 * budget
    llm = LLM(str(model_path), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert _generate(llm, prompt_ids) == expected


def test_matches_hf_under_preemption(model_path, prompt_ids, expected):
    # 10 blocks of 16 tokens hold the longest request alone but not all eight at once.
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=10, block_size=16)
    assert max(len(p) for p in prompt_ids) + MAX_NEW <= 10 * 16
    assert _generate(llm, prompt_ids) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks


def test_static_policy_matches_hf(model_path, prompt_ids, expected):
    llm = LLM(str(model_path), dtype="float32", scheduling_policy="static", max_num_seqs=3)
    assert _generate(llm, prompt_ids) == expected


def test_prefix_cache_hits_and_identical_output(model_path, llm_fp32):
    system = "You are a careful assistant. Answer briefly and precisely. " * 4
    first, second = system + "What is the boiling point of water?", system + "Name a prime number."
    params = SamplingParams(max_tokens=16, temperature=0)
    llm_fp32.generate(first, params, use_tqdm=False)
    before = llm_fp32.engine.stats().kv.prefix_cache_hits
    (cached,) = llm_fp32.generate(second, params, use_tqdm=False)
    assert cached.num_cached_tokens >= 32
    assert llm_fp32.engine.stats().kv.prefix_cache_hits > before

    no_cache = LLM(str(model_path), dtype="float32", enable_prefix_caching=False)
    (uncached,) = no_cache.generate(second, params, use_tqdm=False)
    assert uncached.num_cached_tokens == 0
    assert cached.token_ids == uncached.token_ids


def test_repetition_penalty_matches_hf(hf_model, prompt_ids, llm_fp32):
    """HF's repetition penalty covers the prompt and the output, as kvserve's does; the
    counts kvserve keeps incrementally must give the same greedy tokens."""
    prompts = prompt_ids[2:5]
    with torch.no_grad():
        expected = [
            hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                repetition_penalty=1.3,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            for ids in prompts
        ]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    got = [o.token_ids for o in llm_fp32.generate(prompts, params, use_tqdm=False)]
    assert got == expected  # (these prompts reach MAX_NEW before any EOS)
