import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica import sampler
from replica.cpu import build
from replica.cpu import ops as cpu_ops
from replica.request import Request
from replica.sampler import SamplingBatch, _filtered_probs, _kept, filtered_probs, sample
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


def _tokens(logits, batch, fused_sample=None) -> list[int]:
    return sample(logits, batch, fused_sample=fused_sample).resolve()[0]


# The CPU engine samples through its fused kernel: the same tests hold for it and for the
# torch path.
PATHS = [pytest.param(None, id="torch")]
if build.compiler() is not None:
    PATHS.append(pytest.param(cpu_ops.sample, id="cpu-kernel"))


def _logits(rows: int, seed: int = 0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def seeded():
    """Rows without a seed of their own draw from torch's global generator: seeded for
    the test and given back after it, so that a test of what sampling draws draws the
    same every run. Each such test states its chance of failing a correct sampler with
    another seed (exact binomial tails, added over its tokens)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def _assert_frequencies(tokens: torch.Tensor, expected: torch.Tensor, atol: float = 0.03) -> None:
    """No token outside expected's support, and every token's frequency within atol of
    its probability."""
    assert set(tokens.unique().tolist()) <= set(expected.nonzero()[:, 0].tolist())
    freq = torch.bincount(tokens, minlength=V).double() / len(tokens)
    assert (freq - expected).abs().max() <= atol, (freq[:6], expected[:6])


@pytest.mark.parametrize("fused_sample", PATHS)
def test_greedy_is_argmax(fused_sample):
    logits = _logits(4)
    batch, _ = _batch([SamplingParams(temperature=0)] * 4)
    assert _tokens(logits, batch, fused_sample) == logits.argmax(-1).tolist()
    # Greedy rows beside sampled ones still take the argmax.
    batch, _ = _batch([SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2)
    assert _tokens(logits, batch, fused_sample)[::2] == logits.argmax(-1)[::2].tolist()


@pytest.mark.parametrize("fused_sample", PATHS)
def test_top_k_1_and_tiny_top_p_are_greedy(fused_sample):
    logits = _logits(4, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)] * 2
    batch, _ = _batch(params)
    assert _tokens(logits, batch, fused_sample) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("fused_sample", PATHS)
def test_top_k_restricts_support(fused_sample, seeded):
    # One token in all 200 draws: sum of p^200 over the three kept tokens, 1.5e-71.
    logits = _logits(1, seed=2).repeat(200, 1)
    batch, _ = _batch([SamplingParams(temperature=2.0, top_k=3)] * 200)
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens = set(_tokens(logits, batch, fused_sample))
    assert tokens <= allowed and len(tokens) > 1


@pytest.mark.parametrize("fused_sample", PATHS)
def test_min_p_restricts_support(fused_sample, seeded):
    # Token 8 (p = 0.38 of the kept two) missing from all 300 draws: 0.62^300, 2e-62.
    logits = torch.full((300, V), -10.0)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.5  # p ~ 0.38, kept by min_p=0.3 relative to the top token
    logits[:, 9] = 2.0  # p ~ 0.03 of the top: dropped
    batch, _ = _batch([SamplingParams(temperature=1.0, min_p=0.3)] * 300)
    assert set(_tokens(logits, batch, fused_sample)) == {7, 8}


@pytest.mark.parametrize("fused_sample", PATHS)
def test_seeded_rows_are_reproducible_whatever_the_batch(fused_sample, seeded):
    logits = _logits(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=123)
    steps = 10  # one token in all 10 draws: sum of p^10 over the 50, 3.5e-10 for another seed
    alone, _ = _batch([p], seeds={0: 123})
    first = [_tokens(logits, alone, fused_sample)[0] for _ in range(steps)]
    again, _ = _batch([p], seeds={0: 123})
    second = [_tokens(logits, again, fused_sample)[0] for _ in range(steps)]
    mixed, _ = _batch([SamplingParams(temperature=1.0), p], seeds={1: 123})
    third = [_tokens(logits.repeat(2, 1), mixed, fused_sample)[1] for _ in range(steps)]
    # A top-p neighbour changes what the batch filters; the seeded row draws the same.
    with_top_p, _ = _batch([SamplingParams(temperature=1.0, top_p=0.5), p], seeds={1: 123})
    fourth = [_tokens(logits.repeat(2, 1), with_top_p, fused_sample)[1] for _ in range(steps)]
    assert first == second == third == fourth
    assert len(set(first)) > 1


@pytest.mark.parametrize("fused_sample", PATHS)
def test_sampling_follows_the_distribution(fused_sample, seeded):
    """8000 draws: a frequency's binomial sd is at most sqrt(0.6 x 0.4 / 8000) = 0.0055,
    so atol 0.03 is 5.5 sd. A correct sampler fails with another seed with probability
    4.5e-8 (exact binomial tails of the three tokens, added); with 4000 draws, 1.4e-4."""
    draws = 8000
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3), dtype=torch.double)
    logits = probs.float().clamp_min(1e-30).log().repeat(draws, 1)
    batch, _ = _batch([SamplingParams(temperature=1.0)] * draws)
    _assert_frequencies(torch.tensor(_tokens(logits, batch, fused_sample)), probs)


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


def _filters(rows: int, vocab: int, top_k, top_p, min_p) -> SamplingBatch:
    """A batch whose rows all ask for the same filters (None: not asked)."""
    column = lambda value, dtype: None if value is None else torch.full((rows,), value, dtype=dtype)  # noqa: E731
    return SamplingBatch(
        temperature=torch.ones(rows),
        top_k=column(top_k, torch.long),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        generators=[None] * rows,
        all_greedy=False,
        penalties=None,
        logprobs=[None] * rows,
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_candidates_keep_what_sorting_the_vocabulary_keeps(data):
    """Wherever _kept says a row's kept tokens all lie among its k most likely, they are the
    tokens _filtered_probs (which sorts the whole vocabulary) keeps, with its probabilities;
    filtered_probs, which verification reads, is its distribution whole and normalised.
    Ties at the boundary may keep a different one of equal tokens, so the probabilities
    are compared as sorted lists, and the ids only where no two probabilities are equal
    (logits 0 and 5e-15 differ, their float32 probabilities do not)."""
    vocab = data.draw(st.integers(2, 40), label="vocab")
    values = st.floats(-8, 8, allow_nan=False) | st.sampled_from([-1.0, 0.0, 2.5])  # ties too
    logits = torch.tensor(data.draw(st.lists(values, min_size=vocab, max_size=vocab)))[None, :]
    top_k = data.draw(st.none() | st.integers(1, vocab), label="top_k")
    top_p = data.draw(st.none() | st.floats(1e-3, 1.0, exclude_max=True), label="top_p")
    min_p = data.draw(st.none() | st.floats(1e-3, 1.0, exclude_max=True), label="min_p")
    k = data.draw(st.integers(1, vocab), label="k")
    batch = _filters(1, vocab, top_k or vocab, top_p, min_p)
    reference = _filtered_probs(logits, batch)[0]
    ties = len(set(logits.softmax(dim=-1)[0].tolist())) < vocab

    # Verification's whole distribution, through candidates of any sizes or the vocabulary.
    candidates = tuple(sorted(data.draw(st.lists(st.integers(1, vocab), max_size=2), label="candidates")))
    with unittest.mock.patch.object(sampler, "CANDIDATES", candidates):
        whole = filtered_probs(logits, batch)[0]
    normalised = reference / reference.sum()
    assert torch.allclose(whole.sort().values, normalised.sort().values, atol=1e-5)
    assert ties or torch.allclose(whole, normalised, atol=1e-5)

    top_probs, ids = logits.softmax(dim=-1).topk(k, dim=-1)
    weights, covered = _kept(top_probs, batch, vocab)
    assert weights[0, 0] > 0  # the most likely token is always kept
    assert covered.item() or k < vocab  # with every token a candidate, nothing lies beyond
    if not covered.item():
        assert (weights[0] > 0).sum() <= (reference > 0).sum()  # the row needs its vocabulary
        return
    kept = weights[0][weights[0] > 0]
    expected = reference[reference > 0]  # weights: min_p leaves them unnormalised
    assert len(kept) == len(expected)
    assert torch.allclose(
        (kept / kept.sum()).sort().values, (expected / expected.sum()).sort().values, atol=1e-5
    )
    if not ties:
        assert set(ids[0][weights[0] > 0].tolist()) == set(reference.nonzero()[:, 0].tolist())


@pytest.mark.parametrize("candidates", [sampler.CANDIDATES, (2,), (3, 6)])
def test_filtered_sampling_follows_the_filtered_distribution(candidates, monkeypatch, seeded):
    """Drawn through the candidates or, where they do not hold a row's kept tokens, the
    whole vocabulary: each row's tokens follow _filtered_probs, and an unfiltered row in
    the same batch follows its softmax."""
    monkeypatch.setattr(sampler, "CANDIDATES", candidates)
    _check_filtered_distribution(None)


@pytest.mark.parametrize("penalised", [False, True])
def test_fused_filtered_sampling_follows_the_filtered_distribution(penalised, seeded):
    """The same through the CPU engine's kernel, alone or after penalties (which leave
    these logits as they are: nothing has been generated)."""
    _check_filtered_distribution(cpu_ops.sample, penalised)


def _check_filtered_distribution(fused_sample, penalised: bool = False) -> None:
    """8000 draws of each of the four rows: a frequency's binomial sd is at most
    sqrt(0.44 x 0.56 / 8000) = 0.0055 (the top_p row's first token), so atol 0.03 is
    5.4 sd. A correct sampler fails with another seed with probability 1.7e-7 (exact
    binomial tails of the four rows' 15 kept tokens, added); with 4000 draws, 5.1e-4."""
    penalty = dict(presence_penalty=0.5) if penalised else {}
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04] + [0.0] * (V - 6))
    params = [
        SamplingParams(temperature=1.0, top_p=0.75, **penalty),  # keeps 3 tokens
        SamplingParams(temperature=1.0, top_k=4, **penalty),
        SamplingParams(temperature=1.0, min_p=0.2, **penalty),  # keeps 4 (0.06 < 0.2 * 0.35)
        SamplingParams(temperature=1.0, **penalty),
    ]
    copies, steps = 200, 40  # the four rows 200 times over in a batch, sampled 40 times: 8000 draws each
    logits = probs.clamp_min(1e-30).log().repeat(len(params) * copies, 1)
    batch, _ = _batch(params * copies)
    assert (batch.penalties is not None) == penalised
    tokens = torch.tensor([_tokens(logits, batch, fused_sample) for _ in range(steps)]).view(-1, len(params))
    for row, p in enumerate(params):
        one = _filters(1, V, p.top_k or V, p.top_p if p.top_p < 1 else None, p.min_p or None)
        expected = _filtered_probs(logits[:1], one)[0].double()
        expected /= expected.sum()  # min_p leaves weights unnormalised
        _assert_frequencies(tokens[:, row], expected)
