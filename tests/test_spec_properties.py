"""Speculative decoding's invariants: the scheduler with proposed tokens (any interleaving
of add, propose, step with any number accepted, abort and preempt) keeps the block
accounting exact, gives back the blocks of rejected tokens and publishes hashes of
accepted tokens only; n-gram proposals continue an earlier match; verification samples
exactly the target's distribution (chi-square over thousands of seeded draws from a
small seeded model's logits); and a request whose proposals fail pauses, then tries again."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from scipy.stats import chisquare
from test_scheduler_properties import BLOCK_SIZE, SchedulerMachine
from transformers import LlamaConfig, LlamaForCausalLM

from kvcache.hashing import ROOT_HASH, hash_full_blocks
from replica.request import FinishReason, Request
from replica.spec_decode.acceptance import SpeculationState
from replica.spec_decode.ngram import propose_ngram
from replica.spec_decode.verify import verify
from wire.sampling_params import SamplingParams


class SpecSchedulerMachine(SchedulerMachine):
    """The base machine's rules and invariants, plus proposals and partial acceptance."""

    @rule(data=st.data())
    def propose(self, data):
        for request in self.scheduler.running:
            room = request.max_tokens - request.num_output_tokens - 1
            if request.num_computed_tokens == request.num_tokens - 1 and room > 0:
                request.spec_token_ids = data.draw(st.lists(st.integers(0, 2), max_size=min(room, 4)))

    @rule(data=st.data())
    def step(self, data):
        plan = self.scheduler.schedule()
        sampling = [item for item in plan.scheduled if item.produces_token]
        self.scheduler.advance(plan)
        for item in sampling:
            request = item.request
            k = item.num_spec_tokens
            accepted = data.draw(st.integers(0, k))
            self.scheduler.reject_proposed(request, k - accepted)
            request.token_ids += request.spec_token_ids[:accepted] + [data.draw(st.integers(0, 2))]
            request.spec_token_ids = []
            assert request.num_computed_tokens == request.num_tokens - 1
            if request.num_output_tokens >= request.max_tokens:
                self.scheduler.finish(request, FinishReason.LENGTH)
                del self.live[request.request_id]

    @invariant()
    def rejected_blocks_are_given_back_and_only_accepted_tokens_hashed(self):
        for request in self.scheduler.running:
            held = len(self.kv.block_ids(request.request_id))
            assert held == -(-request.num_computed_tokens // BLOCK_SIZE)
            hashes = self.kv._requests[request.request_id].hashes
            known = request.token_ids[: len(hashes) * BLOCK_SIZE]
            assert hashes == hash_full_blocks(known, BLOCK_SIZE, ROOT_HASH)


SpecSchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSpecScheduler = SpecSchedulerMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    k=st.integers(1, 5),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_ngram_proposal_continues_the_latest_longest_match(tokens, k, min_n, extra):
    max_n = min_n + extra
    proposal = propose_ngram(tokens, k, min_n, max_n)
    matches = []  # (n, start of the match) for every earlier occurrence of a suffix
    for n in range(min_n, min(max_n, len(tokens) - 1) + 1):
        suffix = tokens[-n:]
        matches += [(n, i) for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
    if not matches:
        assert proposal == []
        return
    n, start = max(matches)  # the longest suffix, then its latest occurrence
    assert proposal == tokens[start + n : start + n + k]


def test_acceptance_pauses_after_a_poor_window_then_resumes():
    state = SpeculationState()
    for _ in range(3):
        state.record(4, 3, window=16, min_rate=0.5, backoff=3)
        assert state.ready()
    for _ in range(4):
        state.record(4, 0, window=16, min_rate=0.5, backoff=3)
    # The last 16 proposed tokens had 3 accepted: under half.
    ready = []
    for _ in range(4):
        ready.append(state.ready())
        state.tick()
    assert ready == [False, False, False, True]


VOCAB = 12


def _tiny_logits(seed: int, context: list[int]) -> torch.Tensor:
    """Next-token logits of a small seeded random Llama at every position of context."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        return model(torch.tensor([context])).logits[0] * 3  # sharper than at init


def _request(params: SamplingParams, seed: int) -> Request:
    return Request("r", [0], params, max_tokens=8, generator=torch.Generator().manual_seed(seed))


def _expected_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p as the sampler applies them, written out plainly."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (params.top_k and rank >= params.top_k) or (rank and mass >= params.top_p):
            break
        keep[token] = True
        mass += float(probs[token])
    probs = probs * keep
    if params.min_p:
        probs = probs * (probs >= params.min_p * probs.max())
    return probs / probs.sum()


# Each chi-square check fails a correct verifier with probability ALPHA, by the chi-square
# approximation. Every expected count here is about 50 or more (the sparsest check: some
# 900 tokens after the draft model's likeliest accepted one, over 12). 1e7 simulated
# multinomials of that check (870 draws) failed 1.02e-3, 1.1e-4, 1.1e-5 and 1.6e-6 of the
# time where the approximation says 1e-3 to 1e-6: it holds to within about 2x this far
# out. A test makes two such checks: about 2e-7 for another seed, under 1e-6 with that
# error (at alpha 1e-3, 2e-3).
ALPHA = 1e-7
# A 99% chance of catching a given error needs 1.6-1.8x the noncentrality at alpha 1e-7
# that it needs at 1e-3 (11 to 2 degrees of freedom), so 1.8x the 4000 trials that kept
# that chance at 1e-3.
TRIALS = 7200


def _assert_distributed_as(counts: torch.Tensor, probs: torch.Tensor) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was sampled"
    expected = probs[support].double()
    expected = expected / expected.sum() * counts.sum()
    assert chisquare(counts[support].double(), expected).pvalue > ALPHA


def _check_rejection_sampling(params: SamplingParams, draft_seed: int | None, trials: int = TRIALS):
    """Draws a proposal of one token from q (a second seeded model, or a point mass at a
    fixed token for an n-gram proposal), verifies it against the target, and counts the
    first token emitted and, when the proposal was accepted, the one after it. The
    request's generator (seed 3) and the proposals' (seed 4) make every run draw alike."""
    context = [1, 5, 7]
    target_first = _tiny_logits(0, context)[-1]
    target_after = {d: _tiny_logits(0, [*context, d])[-1] for d in range(VOCAB)}
    if draft_seed is None:
        q = None
        draft_token = int(_expected_probs(target_first, params).argsort()[-2])  # the second likeliest
    else:
        q = torch.softmax(_tiny_logits(draft_seed, context)[-1], dim=-1)
    request = _request(params, seed=3)
    draws = torch.Generator().manual_seed(4)
    first = torch.zeros(VOCAB, dtype=torch.long)
    after: dict[int, torch.Tensor] = {}
    for _ in range(trials):
        if q is not None:
            draft_token = int(torch.multinomial(q, 1, generator=draws))
        logits = torch.stack([target_first, target_after[draft_token]])
        result = verify(logits, [draft_token], None if q is None else q[None], request)
        first[result.token_ids[0]] += 1
        if result.num_accepted:
            after.setdefault(draft_token, torch.zeros(VOCAB, dtype=torch.long))[result.token_ids[1]] += 1
    _assert_distributed_as(first, _expected_probs(target_first, params))
    token, counts = max(after.items(), key=lambda kv: int(kv[1].sum()))
    assert counts.sum() > 300  # about 900 to 2500; 300 or fewer: under 1e-120
    _assert_distributed_as(counts, _expected_probs(target_after[token], params))


def test_draft_model_proposals_leave_the_target_distribution():
    _check_rejection_sampling(SamplingParams(temperature=1.0), draft_seed=1)


def test_ngram_proposals_leave_the_filtered_target_distribution():
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)
    _check_rejection_sampling(params, draft_seed=None)


def test_ngram_proposals_leave_the_min_p_target_distribution():
    """min_p leaves weights that do not sum to 1: accepting the draft with its weight as
    p(d) would accept it too rarely."""
    _check_rejection_sampling(SamplingParams(temperature=1.0, min_p=0.8), draft_seed=None)  # keeps 3 of 12


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.full((4, VOCAB), -math.inf)
    for row, token in enumerate([3, 4, 9, 1]):
        logits[row, token] = 0.0
    request = _request(SamplingParams(temperature=0), seed=0)
    result = verify(logits, [3, 4, 5], None, request)
    assert result.token_ids == [3, 4, 9] and result.num_accepted == 2
    assert verify(logits, [3, 4, 9], None, request).token_ids == [3, 4, 9, 1]
