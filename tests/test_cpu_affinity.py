"""A pinned serving replica's cores (replica/cpu/affinity.py): its steady cores for
ordinary steps, every core of the process for bursts of prefill, and back after."""

import contextlib
import os

import pytest
import torch
from conftest import hf_greedy

from kvserve import LLM, SamplingParams
from replica.cpu.affinity import BURST_MIN_TOKENS, CorePlan, pin_process

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
    plan = CorePlan.resolve([USABLE[-1]])
    assert plan.steady == plan.burst == [USABLE[-1]]


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
