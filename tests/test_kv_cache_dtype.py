"""kv_cache_dtype="fp8": the engine argument, the cache's size, the calibrated per-layer
scales, and the engine's output through every CPU backend, on real weights.

The kernels' own fp8 tests (bytes written, attention against the torch reference) are in
test_fp8_kv_cpu.py and test_triton_attention.py."""

import math
from pathlib import Path

import pytest
import torch
from conftest import save_random_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from replica.attention import choose_backend
from replica.config import EngineConfig
from replica.cpu import linear_kernels

GPL = Path("/usr/share/common-licenses/GPL-3")


def test_kv_cache_dtype_is_checked():
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype must be one of \('auto', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)",
    ):
        EngineConfig(kv_cache_dtype="int8")


def test_backends_that_cannot_read_the_cache_are_skipped_or_refused():
    installed = frozenset({"flash_attn", "triton"})
    assert choose_backend("auto", "cuda", torch.bfloat16, installed) == "flash_attn"
    fp8 = torch.float8_e4m3fn
    assert choose_backend("auto", "cuda", torch.bfloat16, installed, kv_dtype=torch.bfloat16) == "flash_attn"
    assert choose_backend("auto", "cuda", torch.bfloat16, installed, kv_dtype=fp8) == "triton"
    with pytest.raises(ValueError, match="flash-attn backend reads only a KV cache in the model's dtype"):
        choose_backend("flash_attn", "cuda", torch.bfloat16, installed, kv_dtype=fp8)
    with pytest.raises(
        ValueError, match="Triton kernels read a bfloat16 KV cache only beside a bfloat16 model"
    ):
        choose_backend("triton", "cuda", torch.float32, installed, kv_dtype=torch.bfloat16)
    assert choose_backend("auto", "cuda", torch.float32, installed, kv_dtype=torch.bfloat16) == "torch"


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory, tokenizer):
    return save_random_llama(tmp_path_factory.mktemp("random-llama"), tokenizer)


def test_fp8_blocks_double_bf16s_at_the_same_memory(random_llama, caplog):
    """The scheduler counts blocks, so the fp8 cache's are what doubles: twice bf16's and
    four times fp32's in the same kv_cache_memory_gb (a bf16 cache beside a float32 model
    holds twice fp32's). The start-up log says so."""
    blocks = {}
    for dtype, kv in (
        ("bfloat16", "auto"),
        ("float32", "auto"),
        ("bfloat16", "fp8"),
        ("float32", "fp8_e5m2"),
        ("float32", "bfloat16"),
    ):
        with caplog.at_level("INFO", logger="replica.model_runner"):
            llm = LLM(str(random_llama), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gb=0.01)
        blocks[dtype, kv] = llm.engine.runner.num_blocks
        expected = {"auto": dtype, "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bfloat16": kv}[kv]
        assert f"KV cache: {expected}, {blocks[dtype, kv]} blocks" in caplog.text
    bf16, fp32 = blocks["bfloat16", "auto"], blocks["float32", "auto"]
    assert 2 * bf16 <= blocks["bfloat16", "fp8"] <= 2 * bf16 + 1
    assert 4 * fp32 <= blocks["float32", "fp8_e5m2"] <= 4 * fp32 + 3
    assert 2 * fp32 <= blocks["float32", "bfloat16"] <= 2 * fp32 + 1


def test_every_layer_gets_calibrated_scales(random_llama):
    """An fp8 cache's layers each get a finite positive scale pair; other caches keep 1."""
    runner = LLM(
        str(random_llama), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_gb=0.01
    ).engine.runner
    assert len(runner.kv_scales) == runner.num_layers
    for scale in runner.kv_scales:
        for s in (scale.k, scale.v):
            assert math.isfinite(s) and s > 0
    unscaled = LLM(str(random_llama), dtype="float32", kv_cache_memory_gb=0.01).engine.runner
    assert all(s.k == s.v == 1.0 for s in unscaled.kv_scales)


def _perplexity(llm: LLM, token_ids: list[int]) -> float:
    out = llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


# The C backend's linears, pinned to one whose result for a row does not depend on how
# many rows its step has (gemm.c): a prefix-cache hit prefills fewer rows than the first
# pass, and oneDNN, which the timings may choose above some row count, rounds another
# way there; a key one rounding step apart in fp8 (6%) then changes later tokens.
ROW_INVARIANT = "gemm.c" if linear_kernels.can_run("gemm.c", torch.float32, 576) else "torch"


@pytest.fixture(scope="module")
def fp8_engines(model_path):
    """e4m3 and e5m2 through the C kernels, and e4m3 through the torch reference backend."""
    engines = {
        kv: LLM(
            str(model_path), dtype="float32", kv_cache_dtype=kv, max_model_len=640, cpu_kernels=ROW_INVARIANT
        )
        for kv in ("fp8", "fp8_e5m2")
    }
    engines["fp8 torch"] = LLM(
        str(model_path), dtype="float32", kv_cache_dtype="fp8", attention_backend="torch", max_model_len=640
    )
    assert engines["fp8"].engine.runner.backend.name == "cpu"
    return engines


def test_fp8_perplexity_stays_close_to_the_unquantized_cache(llm_fp32, fp8_engines):
    """On held-out text no one tuned on (the first 512 tokens of the GPL): e4m3 within the
    issue's 2%, through the C kernels and the torch reference alike, and e5m2 (2 mantissa
    bits, a rounding step of up to 25%) within 12%: it measured 6-8.3% over the linear
    kernels and machines seen, 8% on the nose with gemm.c. The backends' tokens are not
    compared: their linears round fp32 differently, and an fp8 element near a rounding
    boundary then lands one step apart (6% of its value), which later layers amplify."""
    token_ids = llm_fp32.tokenizer.encode(GPL.read_text())[:512]
    base = _perplexity(llm_fp32, token_ids)
    assert _perplexity(fp8_engines["fp8"], token_ids) <= 1.02 * base
    assert _perplexity(fp8_engines["fp8 torch"], token_ids) <= 1.02 * base
    assert _perplexity(fp8_engines["fp8_e5m2"], token_ids) <= 1.12 * base


def test_the_prefix_cache_serves_fp8_blocks_unchanged(fp8_engines):
    """A second pass over the same prompts reads their blocks from the prefix cache and
    gives the same tokens; every block is free afterwards; the answer is still right."""
    preamble = (
        "You are a helpful assistant who answers questions about geography, science and "
        "programming briefly, accurately and in plain English, without repeating the question. "
    )  # over two blocks
    prompts = [preamble + q for q in ("The capital of France is", "Water boils at", "def fibonacci(n):")]
    params = SamplingParams(max_tokens=16, temperature=0)
    llm = fp8_engines["fp8"]
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hits = llm.engine.stats().kv.prefix_cache_hits
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == first
    stats = llm.engine.stats()
    assert stats.kv.prefix_cache_hits > hits
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
    assert "Paris" in llm.tokenizer.decode(first[0])


@settings(max_examples=15, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 20)), min_size=1, max_size=8),
    e5m2=st.booleans(),
)
def test_fp8_engine_finishes_everything_and_frees_every_block(tiny_fp8_engines, requests, e5m2):
    """Any batch on an fp8 cache of 12 blocks of 4 tokens, so requests wait and are
    preempted: each gets the tokens it asked for, and every block comes back."""
    llm = tiny_fp8_engines["fp8_e5m2" if e5m2 else "fp8"]
    prompts = [[100 + (7 * i + j) % 300 for j in range(n)] for i, (n, _) in enumerate(requests)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [m for _, m in requests]
    stats = llm.engine.stats()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks == 12


@pytest.fixture(scope="module")
def tiny_fp8_engines(random_llama):
    return {
        kv: LLM(str(random_llama), dtype="float32", kv_cache_dtype=kv, num_kv_blocks=12, block_size=4)
        for kv in ("fp8", "fp8_e5m2")
    }
