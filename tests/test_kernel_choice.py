"""The CPU kernel selector (replica/cpu/kernel_choice.py): the fastest kernel per row
bucket from injected timings, dispatch on the step's row count with real kernels, the
per-machine timing cache, forced choices, and the engine's output with each kernel forced
against HF `generate`."""

import json

import pytest
import torch
from conftest import hf_greedy
from test_gpu_path import TINY
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from replica.config import EngineConfig
from replica.cpu import kernel_choice, linear_kernels
from replica.cpu.kernel_choice import KernelChooser, LinearChoice, LinearShape, buckets_up_to, fastest
from replica.cpu.layers import PackedLinear

RUNNABLE_FP32 = [k for k in linear_kernels.LINEAR_KERNELS if linear_kernels.can_run(k, torch.float32, 64)]


def test_fastest_kernel_per_row_count():
    buckets = (1, 8, 32, 128, 512)
    seconds = {
        "gemm.c": [1.0, 1.0, 6.0, 20.0, 80.0],
        "onednn": [2.0, 2.0, 4.0, 10.0, 40.0],
        "torch": [3.0, 3.0, 5.0, 9.0, 36.0],
    }
    choice = fastest(buckets, seconds)
    # From 8 to 32 rows gemm.c takes 1 + 5 e and oneDNN 2 + 2 e (e = (rows - 8) / 24):
    # oneDNN is faster from 16 rows on, and by more than the margin over gemm.c (the
    # default) from 19. From 32 to 128 rows torch (5 + 4 f, f = (rows - 32) / 96) overtakes
    # oneDNN (4 + 6 f) after 80 rows.
    assert choice.bounds == (18, 80, 512) and choice.kernels == ("gemm.c", "onednn", "torch")
    assert [choice.kernel_for(r) for r in (1, 18, 19, 80, 81, 512, 4096)] == [
        "gemm.c", "gemm.c", "onednn", "onednn", "torch", "torch", "torch",
    ]  # fmt: skip
    assert choice.describe() == "gemm.c at <=18 rows, onednn at <=80 rows, torch above"
    assert choice.used() == {"gemm.c", "onednn", "torch"}
    assert LinearChoice.forced("onednn").describe() == "onednn"
    # Another kernel must beat the default by more than the margin.
    assert fastest((1,), {"gemm.c": [1.0], "torch": [0.95]}).kernels == ("gemm.c",)
    assert fastest((1,), {"gemm.c": [1.0], "torch": [0.5]}).kernels == ("torch",)
    # Where gemm.c cannot run, oneDNN is the default.
    assert fastest((1,), {"onednn": [1.0], "torch": [0.95]}).kernels == ("onednn",)


def test_choice_between_buckets_follows_the_interpolated_times():
    """A kernel that loses at a bucket's upper end but wins well below it runs where it
    wins: the choice is not the upper bucket's winner for every row count under it."""
    seconds = {"gemm.c": [1.0, 4.0, 10.0], "onednn": [2.0, 5.0, 8.0]}
    choice = fastest((1, 32, 128), seconds)
    # gemm.c: 4 + 6 f, oneDNN: 5 + 3 f (f = (r - 32) / 96); 1.1 oneDNN < gemm.c from r = 86.
    assert choice.bounds == (85, 128) and choice.kernels == ("gemm.c", "onednn")
    assert kernel_choice.interpolated((1, 32, 128), seconds["gemm.c"], 80) == 7.0
    assert kernel_choice.interpolated((1, 32, 128), seconds["gemm.c"], 4096) == 10.0


def test_a_lone_win_between_two_buckets_is_not_taken():
    """A kernel ahead of the default at one inner bucket only (noise, in the timings seen)
    runs nowhere; ahead at two neighbouring buckets, it runs around them."""
    buckets = (1, 32, 128, 512, 2048)
    gemm_c = [1.0, 4.0, 10.0, 40.0, 160.0]
    lone = fastest(buckets, {"gemm.c": gemm_c, "onednn": [2.0, 5.0, 8.0, 48.0, 190.0]})
    assert lone.kernels == ("gemm.c",)
    pair = fastest(buckets, {"gemm.c": gemm_c, "onednn": [2.0, 5.0, 8.0, 32.0, 190.0]})
    assert pair.kernels == ("gemm.c", "onednn", "gemm.c")
    assert pair.kernel_for(128) == pair.kernel_for(512) == "onednn"


def test_buckets_cover_the_largest_step():
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(96) == (1, 8, 32, 64, 128)
    assert buckets_up_to(128) == (1, 8, 32, 64, 128)
    assert buckets_up_to(100_000) == kernel_choice.ROW_BUCKETS


def _scripted(monkeypatch, seconds: dict[str, list[float]]) -> list:
    """time_linears answers from `seconds` (one entry per bucket) and logs its calls."""
    calls = []

    def time_linears(kernels, shape, buckets):
        calls.append((kernels, shape, buckets))
        return {kernel: seconds[kernel][: len(buckets)] for kernel in kernels}

    monkeypatch.setattr(kernel_choice, "time_linears", time_linears)
    return calls


@pytest.mark.skipif(len(RUNNABLE_FP32) < 2, reason="needs two fp32 kernels that run here")
def test_injected_timings_decide_dispatch_and_layouts(monkeypatch, tmp_path):
    """Timings that make one kernel win small steps and another large ones: the packed
    linear keeps exactly those two layouts and runs each at its rows, with the right
    result."""
    small, large = RUNNABLE_FP32[:2]
    others = {k: [9.0] * 7 for k in RUNNABLE_FP32[2:]}
    _scripted(monkeypatch, {small: [1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 5.0], large: [2.0] * 7, **others})
    chooser = KernelChooser(max_rows=512, cache_dir=tmp_path)
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear.of(linear, chooser)
    # small (the default) takes 1 + 4 (r - 8) / 24 from 8 to 32 rows: large's 2 beats it
    # by more than the margin from 16 rows on.
    assert packed.choice.bounds == (15, 512)
    assert set(packed.layouts) == {small, large}

    ran = []
    real_run = linear_kernels.run

    def spy(kernel, *args):
        ran.append(kernel)
        return real_run(kernel, *args)

    monkeypatch.setattr(linear_kernels, "run", spy)
    for rows in (1, 15, 16, 700):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), linear(x), atol=2e-5, rtol=2e-5)
    assert ran == [small, small, large, large]
    assert f"{small} at <=15 rows, {large} above" in chooser.describe()


def test_timings_are_cached_per_machine(monkeypatch, tmp_path):
    calls = _scripted(monkeypatch, {k: [1.0 + i] * 8 for i, k in enumerate(linear_kernels.LINEAR_KERNELS)})
    shape = LinearShape(48, 64, torch.float32)
    first = KernelChooser(max_rows=32, cache_dir=tmp_path)
    chosen = first.linear(shape)
    assert len(calls) == 1 and calls[0][0] == RUNNABLE_FP32  # every kernel, in turns
    assert first.describe().startswith("cpu kernels (measured)")
    first.save()
    saved = json.loads(next(tmp_path.glob("timings_*.json")).read_text())
    assert saved["machine"]["cpu"] and "threads" in saved["machine"] and "onednn" in saved["machine"]

    second = KernelChooser(max_rows=32, cache_dir=tmp_path)
    assert second.linear(shape) == chosen
    assert len(calls) == 1  # nothing measured again
    assert second.describe().startswith("cpu kernels (cached)")
    second.linear(shape, max_rows=512)  # new buckets: measured
    assert len(calls) == 2 and calls[-1][2] == (1, 8, 32, 64, 128, 256, 512)

    # Another machine (here: another thread count) has its own timings.
    fingerprint = kernel_choice.fingerprint()
    monkeypatch.setattr(
        kernel_choice, "fingerprint", lambda: {**fingerprint, "threads": fingerprint["threads"] + 1}
    )
    KernelChooser(max_rows=32, cache_dir=tmp_path).linear(shape)
    assert len(calls) == 3


def test_real_timings_choose_a_runnable_kernel(tmp_path):
    chooser = KernelChooser(max_rows=8, cache_dir=tmp_path)
    choice = chooser.linear(LinearShape(96, 64, torch.float32, gated=True))
    assert choice.bounds[-1] == 8 and choice.used() <= set(RUNNABLE_FP32)
    by_sdpa = chooser.fresh_prefills_by_sdpa(4, 2, 16, 16, torch.float32)
    assert chooser.describe().endswith(f"fresh prefill attention: {'sdpa' if by_sdpa else 'c kernel'}")
    timings = chooser.timings["fresh prefill float32 4/2x16 block 16"]
    assert set(timings) == {"c", "sdpa"} and all(s > 0 for t in timings.values() for s in t.values())


def test_forced_choices():
    forced = KernelChooser("torch").linear(LinearShape(48, 64, torch.float32))
    assert forced == LinearChoice.forced("torch")
    assert KernelChooser("onednn").fresh_prefills_by_sdpa(4, 2, 16, 16, torch.float32)
    assert not KernelChooser("gemm.c").fresh_prefills_by_sdpa(4, 2, 16, 16, torch.float32)
    # gemm.c's bf16 kernel takes pairs of columns, on any CPU.
    with pytest.raises(ValueError, match="cpu_kernels='gemm.c' cannot run a linear bfloat16 48x63 here"):
        KernelChooser("gemm.c").linear(LinearShape(48, 63, torch.bfloat16))
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        EngineConfig(cpu_kernels="mkl")


@pytest.mark.parametrize("kernel", ["auto", *linear_kernels.LINEAR_KERNELS])
def test_greedy_equals_hf_with_each_kernel_forced(kernel, tmp_path, tokenizer, monkeypatch):
    """fp32, a small token budget so prompts split into chunks: every kernel gives HF's
    tokens."""
    if kernel != "auto" and kernel not in RUNNABLE_FP32:
        pytest.skip(f"{kernel} cannot run float32 on this CPU")
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=16, cpu_kernels=kernel)
    prompts = [tokenizer(t).input_ids for t in ["Hello there, how are you today?", "x", "One two three four"]]
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 10, set())
