import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.cpu import build
from replica.cpu import ops as cpu_ops
from replica.request import Request
from replica.sampler import sample
from replica.sampling_state import SamplingState
from wire.sampling_params import SamplingParams

V = 50


def _batch(params: list[SamplingParams], outputs=None, seeds=None):
    requests = []
    for i, p in enumerate(params):
        seed = (seeds or {}).get(i)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        r = Request(str(i), [1, 2, 3], p, max_tokens=10, generator=generator)
        r.token_ids += (outputs or {}).get(i, [])
        requests.append(r)
    return SamplingState(len(params), V, torch.device("cpu")).batch(requests), requests


def _tokens(logits, batch, temperature_sample=None) -> list[int]:
    return sample(logits, batch, temperature_sample=temperature_sample).resolve()[0]


# Batches that only set temperatures go through the CPU engine's fused kernel: the same
# tests hold for it and for the torch path.
PATHS = [pytest.param(None, id="torch")]
if build.compiler() is not None:
    PATHS.append(pytest.param(cpu_ops.sample, id="cpu-kernel"))


def _logits(rows: int, seed: int = 0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature_sample", PATHS)
def test_greedy_is_argmax(temperature_sample):
    logits = _logits(4)
    batch, _ = _batch([SamplingParams(temperature=0)] * 4)
    assert _tokens(logits, batch, temperature_sample) == logits.argmax(-1).tolist()
    # Greedy rows beside sampled ones still take the argmax.
    batch, _ = _batch([SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2)
    assert _tokens(logits, batch, temperature_sample)[::2] == logits.argmax(-1)[::2].tolist()


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(4, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)] * 2
    batch, _ = _batch(params)
    assert _tokens(logits, batch) == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = _logits(1, seed=2).repeat(200, 1)
    batch, _ = _batch([SamplingParams(temperature=2.0, top_k=3)] * 200)
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens = set(_tokens(logits, batch))
    assert tokens <= allowed and len(tokens) > 1


def test_min_p_restricts_support():
    logits = torch.full((300, V), -10.0)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.5  # p ~ 0.38, kept by min_p=0.3 relative to the top token
    logits[:, 9] = 2.0  # p ~ 0.03 of the top: dropped
    batch, _ = _batch([SamplingParams(temperature=1.0, min_p=0.3)] * 300)
    assert set(_tokens(logits, batch)) == {7, 8}


@pytest.mark.parametrize("temperature_sample", PATHS)
def test_seeded_rows_are_reproducible_whatever_the_batch(temperature_sample):
    logits = _logits(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=123)
    alone, _ = _batch([p], seeds={0: 123})
    first = [_tokens(logits, alone, temperature_sample)[0] for _ in range(5)]
    again, _ = _batch([p], seeds={0: 123})
    second = [_tokens(logits, again, temperature_sample)[0] for _ in range(5)]
    mixed, _ = _batch([SamplingParams(temperature=1.0), p], seeds={1: 123})
    third = [_tokens(logits.repeat(2, 1), mixed, temperature_sample)[1] for _ in range(5)]
    # A top-p neighbour sends the batch down the torch path; the seeded row draws the same.
    with_top_p, _ = _batch([SamplingParams(temperature=1.0, top_p=0.5), p], seeds={1: 123})
    fourth = [_tokens(logits.repeat(2, 1), with_top_p, temperature_sample)[1] for _ in range(5)]
    assert first == second == third == fourth
    assert len(set(first)) > 1


@pytest.mark.parametrize("temperature_sample", PATHS)
def test_sampling_follows_the_distribution(temperature_sample):
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log().repeat(4000, 1)
    batch, _ = _batch([SamplingParams(temperature=1.0)] * 4000)
    tokens = torch.tensor(_tokens(logits, batch, temperature_sample))
    freq = torch.bincount(tokens, minlength=V)[:3].float() / 4000
    assert torch.allclose(freq, probs[:3], atol=0.03)


def test_penalties_discourage_repeats():
    logits = torch.zeros(3, V)
    logits[:, 5] = 1.0
    logits[:, 6] = 0.9
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0, frequency_penalty=0.1),
        SamplingParams(temperature=0, presence_penalty=0.5),
    ]
    batch, _ = _batch(params, outputs={0: [5], 1: [5, 5], 2: [5]})
    assert _tokens(logits, batch) == [6, 6, 6]
    batch, _ = _batch([SamplingParams(temperature=0, frequency_penalty=0.01)], outputs={0: [5, 5]})
    assert _tokens(logits[:1], batch) == [5]  # 1.0 - 0.02 > 0.9


def test_logprobs_are_raw_log_softmax():
    logits = _logits(2, seed=4)
    batch, _ = _batch([SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)])
    tokens, logprobs = sample(logits, batch).resolve()
    reference = torch.log_softmax(logits[0], -1)
    lp = logprobs[0]
    assert lp.token_id == tokens[0]
    assert abs(lp.logprob - reference[lp.token_id].item()) < 1e-5
    assert list(lp.top_logprobs) == reference.topk(3).indices.tolist()
    assert logprobs[1] is None


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("sample"), st.integers(0, 2), st.integers(0, V - 1)),
            st.tuples(st.just("preempt"), st.integers(0, 2), st.just(0)),
        ),
        max_size=30,
    )
)
def test_incremental_penalty_counts_equal_a_recount(ops):
    """Counts kept step by step (and rebuilt after a preemption) equal counting each
    request's whole history, and `seen` is exactly its prompt and outputs."""
    penalized = SamplingParams(temperature=0, frequency_penalty=0.5)
    requests = [Request(str(i), [i, 10 + i], penalized, max_tokens=100) for i in range(3)]
    state = SamplingState(4, V, torch.device("cpu"))
    for op, i, token in ops:
        request = requests[i]
        if op == "preempt":
            state.remove(request.request_id)
            continue
        state.batch([request])  # takes (or rebuilds) the request's slot
        state.record([request], torch.tensor([token]))
        request.token_ids.append(token)
    for request in requests:
        batch = state.batch([request])
        outputs = torch.tensor(request.output_token_ids, dtype=torch.long)
        assert torch.equal(batch.penalties.output_counts[0], torch.bincount(outputs, minlength=V).float())
        expected_seen = torch.zeros(V, dtype=torch.bool)
        expected_seen[request.prompt_token_ids + request.output_token_ids] = True
        assert torch.equal(batch.penalties.seen[0], expected_seen)
    assert state.num_slots_in_use == 3


def test_a_reused_slot_starts_clean():
    state = SamplingState(1, V, torch.device("cpu"))
    first = Request("a", [1], SamplingParams(temperature=0, presence_penalty=1.0), max_tokens=5)
    state.batch([first])
    state.record([first], torch.tensor([7]))
    state.remove("a")
    second = Request("b", [2], SamplingParams(temperature=0.5, repetition_penalty=1.2), max_tokens=5)
    batch = state.batch([second])
    assert not batch.penalties.output_counts.any()
    assert batch.penalties.seen[0].nonzero().flatten().tolist() == [2]
    assert batch.penalties.presence.item() == 0 and batch.temperature.item() == 0.5
