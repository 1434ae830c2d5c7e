"""A pinned serving replica's cores (replica/cpu/affinity.py): its steady cores for
ordinary steps (every core where its kernels share work), every core of the process for
bursts of prefill, and back after."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from conftest import hf_greedy

from kvserve import LLM, SamplingParams
from replica.cpu.affinity import BURST_MIN_TOKENS, CorePlan, pin_process
from replica.cpu.ops import f32_gemm_available

USABLE = sorted(os.sched_getaffinity(0))


@pytest.fixture
def restore_pinning():
    """The test process's threads and torch thread count as they were."""
    threads = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    num_threads = torch.get_num_threads()
    yield
    for thread_id, cores in threads.items():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(thread_id, cores)
    torch.set_num_threads(num_threads)


def test_auto_bursts_onto_every_core_and_a_list_of_cores_is_kept_to():
    plan = CorePlan.resolve("auto")
    assert plan.steady == (USABLE[1:] or USABLE)
    assert plan.burst == USABLE
    # Kernels that share work out as threads come free run every step on every core.
    plan = CorePlan.resolve("auto", kernels_share_work=True)
    assert plan.steady == plan.burst == USABLE
    for shares in (False, True):
        plan = CorePlan.resolve([USABLE[-1]], kernels_share_work=shares)
        assert plan.steady == plan.burst == [USABLE[-1]]


def test_kernels_share_work_where_every_linear_runs_gemm_c(model_path):
    """gemm.c's threads take panels as they come free; oneDNN gives each a fixed share."""
    if not f32_gemm_available():
        pytest.skip("gemm.c's fp32 kernel needs AVX2 and FMA")
    limits = dict(dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=16)
    assert LLM(str(model_path), cpu_kernels="gemm.c", **limits).engine.kernels_share_work()
    assert not LLM(str(model_path), cpu_kernels="onednn", **limits).engine.kernels_share_work()


@pytest.mark.skipif(len(USABLE) < 2, reason="bursts need a core beyond the steady ones")
def test_long_prefills_burst_onto_every_core_and_decodes_stay_steady(
    model_path, hf_model, tokenizer, restore_pinning, monkeypatch
):
    llm = LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25)
    plan = CorePlan.resolve("auto")
    pin_process(plan.steady)
    runner = llm.engine.runner
    runner.use_cores(plan)
    seen = []  # (tokens, the engine thread's cores, torch threads) of each forward
    forward = runner._forward_packed

    def recording(token_ids, *args, **kwargs):
        seen.append((sum(map(len, token_ids)), sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
        return forward(token_ids, *args, **kwargs)

    monkeypatch.setattr(runner, "_forward_packed", recording)
    long_prompt = tokenizer("Paged memory, " * 200)["input_ids"][: BURST_MIN_TOKENS + 40]
    short_prompt = tokenizer("The capital of France is")["input_ids"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt in (long_prompt, short_prompt):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        # Greedy output is the oracle's, whichever cores and thread count ran the step.
        assert out.token_ids == hf_greedy(hf_model, prompt, 6, eos_ids=set())

    steady, burst = (plan.steady, len(plan.steady)), (plan.burst, len(plan.burst))
    assert [(cores, threads) for _, cores, threads in seen] == [burst] + [steady] * 11
    assert [tokens for tokens, _, _ in seen] == [len(long_prompt)] + [1] * 5 + [len(short_prompt)] + [1] * 5
    # Between steps, the engine is back on its steady cores.
    assert sorted(os.sched_getaffinity(0)) == plan.steady
    assert torch.get_num_threads() == len(plan.steady)


# Prints the process's thread count before a thread runs a parallel region with two
# threads, after it, and (release) after it ends its workers, while that thread lives.
OPENMP_POOL = """
import os, sys, threading, torch
from replica.cpu.affinity import release_openmp_threads
torch.set_num_threads(2)
release = sys.argv[1] == "release"
threads = lambda: len(os.listdir("/proc/self/task"))
counts, done = [threads()], threading.Event()
def work():
    torch.ones(512, 512) @ torch.ones(512, 512)
    counts.append(threads())
    if release:
        assert release_openmp_threads()
        counts.append(threads())
    done.set()
thread = threading.Thread(target=work)
thread.start()
done.wait()
print(*counts)
thread.join()
"""


def openmp_pool_threads(release: bool) -> list[int]:
    command = [sys.executable, "-c", OPENMP_POOL, "release" if release else "keep"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return [int(n) for n in run.stdout.split()]


@pytest.mark.skipif(len(USABLE) < 2, reason="a parallel region of two threads needs two cores")
def test_a_thread_that_lives_on_ends_its_openmp_workers():
    """libgomp keeps a thread's OpenMP workers while the thread lives, and sleeps at
    barriers once workers outnumber the cores (release_openmp_threads): a thread done
    with torch work ends them."""
    before, during = openmp_pool_threads(release=False)
    assert during == before + 2  # the thread and its worker
    before, during, after = openmp_pool_threads(release=True)
    assert during == before + 2 and after == before + 1  # the worker has ended
