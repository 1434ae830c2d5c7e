"""Async scheduling (the next step launches before the previous step's tokens are read)
must change nothing a user sees: same tokens, text, logprobs and finish reasons as the
synchronous engine, under preemption, chunked prefill and aborts, and nothing leaks."""

import pytest

from kvserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List the three primary colors of light:",
    "The quick brown fox jumps over the lazy dog. " * 5 + "What did the fox do?",
    "Hi",
]


def _params(stop_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=20, temperature=0),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=20, temperature=0, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2
        ),
        SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]),
        SamplingParams(max_tokens=7, temperature=1.0, top_k=5, seed=11, frequency_penalty=0.4),
        SamplingParams(max_tokens=1, temperature=0),
    ]


def _engine(model_path, async_scheduling: bool) -> LLM:
    # 8 blocks of 16 tokens cannot hold all six requests at once (preemption), and a
    # 24-token budget chunks the long prompt.
    return LLM(
        str(model_path),
        dtype="float32",
        num_kv_blocks=8,
        block_size=16,
        max_num_batched_tokens=24,
        async_scheduling=async_scheduling,
    )


def _summary(outputs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def _logprobs(outputs) -> list[float]:
    return [lp.logprob for o in outputs for lp in o.outputs[0].logprobs or []]


def _assert_nothing_leaked(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert not engine.has_unfinished()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
    assert engine.sampling.num_slots_in_use == 0


@pytest.fixture(scope="module")
def engines(model_path):
    return _engine(model_path, False), _engine(model_path, True)


def test_async_matches_sync(engines, llm_fp32):
    sync, async_ = engines
    assert async_.engine.async_scheduling and not sync.engine.async_scheduling
    # A stop string from the model's own text, so that the stop really triggers.
    (reference,) = llm_fp32.generate(PROMPTS[3], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    stop_text = reference.text[len(reference.text) // 2 :][:3]
    params = _params(stop_text)

    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    got = async_.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    # To float precision: a request that stopped stays one extra step in the async
    # engine's batch, and a GEMM over another batch size rounds differently.
    assert len(_logprobs(expected)) == 20
    assert _logprobs(got) == pytest.approx(_logprobs(expected), abs=1e-3)
    assert expected[3].finish_reason == "stop"
    assert sync.engine.stats().num_preemptions > 0 and async_.engine.stats().num_preemptions > 0
    _assert_nothing_leaked(sync)
    _assert_nothing_leaked(async_)


def test_abort_while_a_token_is_in_flight(engines):
    sync, async_ = engines
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = {o.prompt: o.token_ids for o in sync.generate(PROMPTS[:3], params, use_tqdm=False)}

    engine = async_.engine
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(4):
        for delta in engine.step():
            seen[delta.request_id] += delta.new_token_ids
    assert engine._in_flight is not None  # the abort lands while a token is launched
    assert engine.abort(ids[0])
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id != ids[0], "an aborted request produced a token"
            seen[delta.request_id] += delta.new_token_ids
    for request_id, prompt in zip(ids[1:], PROMPTS[1:3], strict=True):
        assert seen[request_id] == expected[prompt]
    assert seen[ids[0]] == expected[PROMPTS[0]][: len(seen[ids[0]])]
    _assert_nothing_leaked(async_)


def test_async_defaults_off_on_cpu(llm_fp32):
    """On a CPU the host and the 'device' are the same cores: nothing to overlap."""
    assert llm_fp32.engine.async_scheduling is False
