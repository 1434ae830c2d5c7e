import torch

from replica.request import Request
from replica.sampler import SamplingBatch, sample
from replica.sampling_params import SamplingParams

V = 50


def _batch(params: list[SamplingParams], outputs=None, seeds=None):
    requests = []
    for i, p in enumerate(params):
        r = Request(str(i), [1, 2, 3], p, max_tokens=10)
        r.token_ids += (outputs or {}).get(i, [])
        requests.append(r)
    generators = []
    for i in range(len(params)):
        seed = (seeds or {}).get(i)
        generators.append(None if seed is None else torch.Generator().manual_seed(seed))
    return SamplingBatch.from_requests(requests, generators, V, torch.device("cpu")), requests


def _logits(rows: int, seed: int = 0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits(4)
    batch, _ = _batch([SamplingParams(temperature=0)] * 4)
    assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(4, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)] * 2
    batch, _ = _batch(params)
    assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = _logits(1, seed=2).repeat(200, 1)
    batch, _ = _batch([SamplingParams(temperature=5.0, top_k=3)] * 200)
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens = set(sample(logits, batch).token_ids)
    assert tokens <= allowed and len(tokens) > 1


def test_min_p_restricts_support():
    logits = torch.full((300, V), -10.0)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.5  # p ~ 0.38, kept by min_p=0.3 relative to the top token
    logits[:, 9] = 2.0  # p ~ 0.03 of the top: dropped
    batch, _ = _batch([SamplingParams(temperature=1.0, min_p=0.3)] * 300)
    assert set(sample(logits, batch).token_ids) == {7, 8}


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = _logits(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=123)
    alone, _ = _batch([p], seeds={0: 123})
    first = [sample(logits, alone).token_ids[0] for _ in range(5)]
    again, _ = _batch([p], seeds={0: 123})
    second = [sample(logits, again).token_ids[0] for _ in range(5)]
    mixed, _ = _batch([SamplingParams(temperature=1.0), p], seeds={1: 123})
    third = [sample(logits.repeat(2, 1), mixed).token_ids[1] for _ in range(5)]
    assert first == second == third


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log().repeat(4000, 1)
    batch, _ = _batch([SamplingParams(temperature=1.0)] * 4000)
    tokens = torch.tensor(sample(logits, batch).token_ids)
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
    assert sample(logits, batch).token_ids == [6, 6, 6]
    batch, _ = _batch([SamplingParams(temperature=0, frequency_penalty=0.01)], outputs={0: [5, 5]})
    assert sample(logits[:1], batch).token_ids == [5]  # 1.0 - 0.02 > 0.9


def test_logprobs_are_raw_log_softmax():
    logits = _logits(2, seed=4)
    batch, _ = _batch([SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)])
    out = sample(logits, batch)
    reference = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert abs(lp.logprob - reference[lp.token_id].item()) < 1e-5
    assert list(lp.top_logprobs) == reference.topk(3).indices.tolist()
    assert out.logprobs[1] is None
