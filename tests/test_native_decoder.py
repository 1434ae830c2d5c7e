"""decoder.c's whole-step loop (NativeDecoder) against FusedDecoder's Python loop over
the same kernels: in bf16 and in fp32 the two must give the same tokens and the same
logprobs, bit for bit, through chunked prefill, prefix-cache hits, decode batches, and
the last layer's cut to the rows that sample. Models it does not cover keep the Python
loop."""

import pytest
import torch
from test_other_models import CONFIGS
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from replica.attention.context import ForwardContext, get_forward_context
from replica.cpu import ops
from replica.kv_quant import KVScale


def _gemm_c_runs(dtype: str) -> None:
    """Skips unless gemm.c has a kernel for `dtype` on this CPU (the native loop runs only
    gemm.c's GEMMs)."""
    if dtype == "bfloat16" and not ops.bf16_gemm_available():
        pytest.skip("gemm.c's bf16 kernel needs AVX512-BF16")
    if dtype == "float32" and not ops.f32_gemm_available():
        pytest.skip("gemm.c's fp32 kernel needs AVX2 and FMA")


DTYPES = ["bfloat16", "float32"]


def _both_loops(llm: LLM, prompts, params) -> tuple[list, list, int]:
    """(native outputs, Python-loop outputs, steps the native loop ran) for one workload.
    Every step whose attention the C kernel does entirely must run natively: the LLMs here
    force gemm.c for every linear, so the linears never send a step to the Python loop."""
    fused = llm.engine.runner.run_decoder
    native, runs = fused.native, []
    forward = native.forward

    def counted(*args):
        _, fresh_runs = ops.step_layout(get_forward_context().metadata)
        out = forward(*args)
        assert (out is not None) == (not fresh_runs)
        runs.append(out is not None)
        return out

    native.forward = counted
    try:
        ours = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.kv.pool.reset_prefix_cache()
        fused.native = None
        theirs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        fused.native = native
        native.forward = forward
    return ours, theirs, sum(runs)


def _assert_same(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the top alternatives' too


@pytest.fixture(scope="module", params=DTYPES)
def bundled(request, model_path):
    _gemm_c_runs(request.param)
    # A small token budget splits prompts into chunks; prefix caching gives cache hits.
    return LLM(str(model_path), dtype=request.param, kv_cache_memory_gb=0.1, block_size=16,
               max_num_batched_tokens=96, max_num_seqs=8, cpu_kernels="gemm.c")  # fmt: skip


def test_bundled_model_same_as_python_loop(bundled, tokenizer):
    assert bundled.engine.runner.run_decoder.native is not None
    texts = ["The capital of France is", "Write a haiku about paged memory. " * 6, "x", "1, 2, 3,"]
    prompts = [tokenizer(t).input_ids for t in texts]
    prompts.append(prompts[1][:40] + tokenizer(" and then").input_ids)  # shares full blocks with prompts[1]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (9, 20, 5, 14, 11)
    ]
    ours, theirs, native_steps = _both_loops(bundled, prompts, params)
    _assert_same(ours, theirs)
    # Once every prompt is in the cache (two steps of at most 96 tokens), at least the
    # longest request's last 18 tokens come from decode-only steps.
    assert native_steps >= 18


def test_a_new_cache_list_is_bound_anew(bundled):
    """The layers' struct array is rebuilt for another list of caches or scales, and only
    then; a rebuilt one points at the new caches and holds the new scales."""
    runner, native = bundled.engine.runner, bundled.engine.runner.run_decoder.native
    kernels = native._step_kernels(1)
    shape = native._bind(ForwardContext(runner.kv_caches, None, None, runner.kv_scales), kernels)
    layers = native._layers
    assert native._bind(ForwardContext(runner.kv_caches, None, None, runner.kv_scales), kernels) is shape
    assert native._layers is layers
    moved, scales = runner.kv_layout.allocate(2), [KVScale(0.5, 0.25)] * len(runner.kv_caches)
    native._bind(ForwardContext(moved, None, None, scales), kernels)
    bound = [(layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale) for layer in native._layers]
    assert bound == [(k.data_ptr(), v.data_ptr(), 0.5, 0.25) for k, v in moved]
    native._bind(ForwardContext(runner.kv_caches, None, None, runner.kv_scales), kernels)
    assert [layer.k_cache for layer in native._layers] == [k.data_ptr() for k, _ in runner.kv_caches]


@pytest.mark.parametrize("dtype", DTYPES)
def test_steps_where_no_row_samples(dtype, model_path, tokenizer):
    """One sequence at a time and 16 tokens a step: a long prompt's first steps are
    chunks that sample nothing, so the last layer keeps no rows at all."""
    _gemm_c_runs(dtype)
    llm = LLM(
        str(model_path), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=1,
        cpu_kernels="gemm.c",
    )  # fmt: skip
    prompts = [tokenizer("Paged memory, " * 20).input_ids, tokenizer("Hi").input_ids]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    ours, theirs, native_steps = _both_loops(llm, prompts, params)
    _assert_same(ours, theirs)
    assert native_steps >= len(prompts[0]) // 16 + 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["llama-gqa4", "qwen2-bias"])
def test_random_models_same_as_python_loop(name, dtype, tmp_path, tokenizer):
    _gemm_c_runs(dtype)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype=dtype, block_size=4, max_num_batched_tokens=8, cpu_kernels="gemm.c")
    assert llm.engine.runner.run_decoder.native is not None
    prompts = [tokenizer(p).input_ids for p in ["Hello there", "A longer prompt with more tokens in it", "x"]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    ours, theirs, native_steps = _both_loops(llm, prompts, params)
    _assert_same(ours, theirs)
    assert native_steps > 0


def test_models_it_does_not_cover_keep_the_python_loop(tmp_path, tokenizer, model_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS["qwen3"]).save_pretrained(tmp_path)  # q/k norms
    tokenizer.save_pretrained(tmp_path)
    assert LLM(str(tmp_path), dtype="float32").engine.runner.run_decoder.native is None
    # Linears with no gemm.c layout (oneDNN's everywhere) are calls the C loop cannot make.
    forced_onednn = LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.1, cpu_kernels="onednn")
    assert forced_onednn.engine.runner.run_decoder.native is None
