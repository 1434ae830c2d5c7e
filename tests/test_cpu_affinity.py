"""A pinned serving replica's cores (replica/cpu/affinity.py): every core of the process
for bursts of prefill and for steps whose kernels share work, its steady cores for the
others."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from conftest import hf_greedy

from kvserve import LLM, SamplingParams
from replica.cpu import affinity
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
    sizes = (1, BURST_MIN_TOKENS - 1, BURST_MIN_TOKENS)
    assert [plan.cores_for(n) for n in sizes] == [plan.steady, plan.steady, USABLE]
    # Steps whose kernels share work out as threads come free run on every core.
    plan = CorePlan.resolve("auto", shared_rows=16)
    assert [plan.cores_for(n) for n in (1, 16, 17, BURST_MIN_TOKENS)] == [USABLE, USABLE, plan.steady, USABLE]
    for shared_rows in (0, 16):
        plan = CorePlan.resolve([USABLE[-1]], shared_rows=shared_rows)
        assert plan.steady == plan.burst == [USABLE[-1]]
        assert {tuple(plan.cores_for(n)) for n in (1, 17, BURST_MIN_TOKENS)} == {(USABLE[-1],)}


def test_kernels_share_work_where_every_linear_runs_gemm_c(model_path):
    """gemm.c's threads take panels as they come free; oneDNN gives each a fixed share."""
    if not f32_gemm_available():
        pytest.skip("gemm.c's fp32 kernel needs AVX2 and FMA")
    limits = dict(dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=16)
    gemm_c = LLM(str(model_path), cpu_kernels="gemm.c", **limits).engine
    assert gemm_c.rows_sharing_work() == BURST_MIN_TOKENS - 1
    assert LLM(str(model_path), cpu_kernels="onednn", **limits).engine.rows_sharing_work() == 0


@pytest.mark.skipif(len(USABLE) < 2, reason="bursts need a core beyond the steady ones")
@pytest.mark.parametrize("sharing", [False, True], ids=["fixed-shares", "sharing-decodes"])
def test_each_step_runs_on_its_plans_cores_pinned_once_a_change(
    sharing, model_path, hf_model, tokenizer, restore_pinning, monkeypatch
):
    """A long prefill bursts onto every core; decodes run on every core where their kernels
    share work, else on the steady cores, as does a short prompt past the sharing rows.
    The process is pinned only where a step's cores differ from the last step's."""
    llm = LLM(str(model_path), dtype="float32", kv_cache_memory_gb=0.25)
    long_prompt = tokenizer("Paged memory, " * 200)["input_ids"][: BURST_MIN_TOKENS + 40]
    short_prompt = tokenizer("The capital of France is")["input_ids"]
    plan = CorePlan.resolve("auto", shared_rows=len(short_prompt) - 1 if sharing else 0)
    plan.pin_for_step(1)
    runner = llm.engine.runner
    runner.use_cores(plan)
    seen = []  # (tokens, the engine thread's cores, torch threads) of each forward
    forward = runner._forward_packed

    def recording(token_ids, *args, **kwargs):
        seen.append((sum(map(len, token_ids)), sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
        return forward(token_ids, *args, **kwargs)

    pins = []
    monkeypatch.setattr(runner, "_forward_packed", recording)
    monkeypatch.setattr(affinity, "pin_process", lambda cores: pins.append(cores) or pin_process(cores))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for prompt in (long_prompt, short_prompt):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        # Greedy output is the oracle's, whichever cores and thread count ran the step.
        assert out.token_ids == hf_greedy(hf_model, prompt, 6, eos_ids=set())

    tokens = [len(long_prompt)] + [1] * 5 + [len(short_prompt)] + [1] * 5
    assert [t for t, _, _ in seen] == tokens
    decode = USABLE if sharing else plan.steady
    expected = [USABLE] + [decode] * 5 + [plan.steady] + [decode] * 5
    assert [(cores, threads) for _, cores, threads in seen] == [(c, len(c)) for c in expected]
    changes = [cores for i, cores in enumerate(expected) if cores != (expected[i - 1] if i else decode)]
    assert pins == changes
    # Between steps, the engine stays on the cores of its last step, a decode's.
    assert sorted(os.sched_getaffinity(0)) == decode
    assert torch.get_num_threads() == len(decode)


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
