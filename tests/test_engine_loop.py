"""The engine's own thread (replica/server/engine_loop.py) on the real bundled model: calls run
between steps, outputs arrive through the callback, and a failed step reaches the error
callback without stopping the loop."""

import threading

import pytest

from kvserve import SamplingParams
from replica.server.engine_loop import EngineLoop

PROMPTS = ["The capital of France is", "def add(a, b):", "Three colours:"]


@pytest.fixture
def loop(llm_fp32, expected):
    """A loop over the session's fp32 engine, which nothing else may touch until it is
    stopped (the expected outputs are computed first)."""
    deltas, errors = [], []
    changed = threading.Condition()

    def on_outputs(outputs):
        with changed:
            deltas.extend(outputs)
            changed.notify_all()

    def on_step_error(error):
        with changed:
            errors.append(error)
            changed.notify_all()

    engine_loop = EngineLoop(llm_fp32.engine, on_outputs, on_step_error, idle_tick_s=0.01)
    yield engine_loop, deltas, errors, changed
    engine_loop.stop()


@pytest.fixture(scope="module")
def expected(llm_fp32) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0)
    return {o.prompt: o.token_ids for o in llm_fp32.generate(PROMPTS, params, use_tqdm=False)}


def _wait(changed, condition, timeout=60):
    with changed:
        assert changed.wait_for(condition, timeout), "timed out"


def test_streams_equal_offline_greedy(loop, llm_fp32, expected):
    engine_loop, deltas, _, changed = loop
    params = SamplingParams(max_tokens=10, temperature=0)
    ids = [
        engine_loop.call(llm_fp32.engine.add_request, p, params, f"loop-{i}") for i, p in enumerate(PROMPTS)
    ]
    ids = [future.result(timeout=30) for future in ids]
    _wait(changed, lambda: sum(d.finished for d in deltas) == len(PROMPTS))
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        assert [t for d in deltas if d.request_id == request_id for t in d.new_token_ids] == expected[prompt]
    assert not engine_loop.call(llm_fp32.engine.has_unfinished).result(timeout=30)


def test_a_failing_call_and_a_failing_step_leave_the_loop_running(loop, llm_fp32):
    engine_loop, deltas, errors, changed = loop
    engine = llm_fp32.engine
    with pytest.raises(ValueError):
        engine_loop.call(engine.add_request, []).result(timeout=30)  # empty prompt

    real_step = engine.step
    failed = []

    def step_failing_once():
        if not failed:
            failed.append(True)
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = step_failing_once
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        engine_loop.call(engine.add_request, "Hello", params, "fails").result(timeout=30)
        _wait(changed, lambda: errors)
        assert str(errors[0]) == "injected step failure"
        # The error callback decides what to abort; here nobody did, so the request goes on.
        _wait(changed, lambda: any(d.request_id == "fails" and d.finished for d in deltas))
    finally:
        engine.step = real_step
    assert engine_loop.is_alive()
    stats = engine_loop.call(engine.stats).result(timeout=30)
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
