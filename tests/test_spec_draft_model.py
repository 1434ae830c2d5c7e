"""The draft-model proposer on real weights: with the target itself as the draft, greedy
proposals are HF's greedy continuation, also after a partial acceptance and rollback;
seeded sampled proposals are reproducible; draft KV is accounted for exactly."""

import pytest
import torch
from conftest import hf_greedy, save_random_llama

from replica.config import EngineConfig
from replica.request import Request
from replica.spec_decode.config import SpeculativeConfig
from replica.spec_decode.draft_model import DraftModelProposer
from replica.spec_decode.proposal import Proposal
from wire.sampling_params import SamplingParams

VOCAB = 49152
K = 4
# A small token budget: the catch-up of the longest prompt takes two forwards.
BUDGET = 16
PROMPTS = ["Hi", "The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tokenizer) -> str:
    """A seeded random Llama with the bundled model's vocabulary and tokenizer."""
    return str(save_random_llama(tmp_path_factory.mktemp("draft"), tokenizer))


def _proposer(target: str, draft: str, num_blocks: int) -> DraftModelProposer:
    # cpu_kernels="torch": no timing of linear kernels at load (the choice changes no result).
    config = EngineConfig(
        model=target, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=BUDGET, cpu_kernels="torch"
    )
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=K, model=draft)
    return DraftModelProposer(config, spec, target_vocab_size=VOCAB, num_blocks=num_blocks)


def _request(request_id: str, token_ids: list[int], temperature: float = 0.0, seed: int | None = None):
    generator = None
    if seed is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    params = SamplingParams(temperature=temperature, max_tokens=32, seed=seed)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        params=params,
        max_tokens=32,
        generator=generator,
    )


def _free_all(proposer: DraftModelProposer, requests: list[Request]) -> None:
    for request in requests:
        proposer.drop(request.request_id)
    stats = proposer.kv.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_self_draft_is_hf_greedy_and_catches_up_after_rollback(model_path, hf_model, tokenizer):
    proposer = _proposer(str(model_path), str(model_path), num_blocks=32)
    requests = [_request(str(i), tokenizer(p).input_ids) for i, p in enumerate(PROMPTS)]
    assert len({r.num_tokens for r in requests}) == len(requests)

    proposals = proposer.propose(requests, [K] * len(requests))
    for request, proposal in zip(requests, proposals, strict=True):
        assert proposal.probs is None
        assert proposal.token_ids == hf_greedy(hf_model, request.token_ids, K, set())

    # The target accepts two drafts and samples a token the draft did not propose.
    for request, proposal in zip(requests, proposals, strict=True):
        before = request.num_tokens
        other = (proposal.token_ids[2] + 1) % VOCAB
        request.token_ids += [*proposal.token_ids[:2], other]
        proposer.rollback(request.request_id, before + 2)

    # Request 1 sits this step out: no forward for it, its draft KV stays as it is.
    num_tokens = [K, 0, 2]
    proposals = proposer.propose(requests, num_tokens)
    assert proposals[1] == Proposal([], None)
    for request, proposal, k in zip(requests, proposals, num_tokens, strict=True):
        if k:
            assert proposal.token_ids == hf_greedy(hf_model, request.token_ids, k, set())
    _free_all(proposer, requests)


def test_seeded_sampled_proposals_reproducible(model_path, random_draft, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]

    def run() -> list[Proposal]:
        proposer = _proposer(str(model_path), random_draft, num_blocks=32)
        requests = [_request("g", prompts[0])]
        requests += [_request(f"s{i}", p, temperature=0.8, seed=i) for i, p in enumerate(prompts[1:])]
        first = proposer.propose(requests, [K] * len(requests))
        for request, proposal in zip(requests, first, strict=True):
            request.token_ids += proposal.token_ids
            proposer.rollback(request.request_id, request.num_tokens)
        second = proposer.propose(requests, [K] * len(requests))
        _free_all(proposer, requests)
        return first + second

    a, b = run(), run()
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and len(x.token_ids) == K
        assert (x.probs is None) == (y.probs is None)
        if x.probs is not None:
            assert torch.equal(x.probs, y.probs)
    assert a[0].probs is None and a[3].probs is None  # the greedy request
    for proposal in a[1:3] + a[4:]:
        probs = proposal.probs
        assert probs.shape == (K, VOCAB) and probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(K))
        assert (probs[torch.arange(K), torch.tensor(proposal.token_ids)] > 0).all()


def test_vocab_mismatch_names_both_sizes(model_path, tmp_path, tokenizer):
    save_random_llama(tmp_path, tokenizer, vocab_size=1000)  # the check reads only the config
    with pytest.raises(ValueError, match=r"1000.*49152"):
        _proposer(str(model_path), str(tmp_path), num_blocks=8)


def test_kv_accounting_and_no_blocks(model_path, random_draft):
    proposer = _proposer(str(model_path), random_draft, num_blocks=4)
    block = proposer.runner.block_size
    assert proposer.max_model_len == 4 * block

    fits = _request("fits", list(range(2 * block + 1)))  # needs 3 blocks with K - 1 drafts fed
    starved = _request("starved", list(range(block)))  # needs 2, 1 is left
    proposals = proposer.propose([fits, starved], [K, K])
    assert len(proposals[0].token_ids) == K
    assert proposals[1] == Proposal([], None)
    assert proposer.kv.block_ids("starved") == []
    assert proposer.kv.num_free_blocks == 1

    # Near the end of the window fewer tokens are proposed: fed positions stay below it.
    proposer.drop("fits")
    near_end = _request("near-end", list(range(4 * block - 2)))
    (proposal,) = proposer.propose([near_end], [K])
    assert len(proposal.token_ids) == 3
    _free_all(proposer, [fits, starved, near_end])


def test_rejected_drafts_are_rechecked_without_rollback(model_path, random_draft, tokenizer):
    """KV of a rejected draft is never reused, even where the engine skipped rollback():
    the next proposal's draft distributions are those after a rollback, bit for bit."""
    results = []
    for use_rollback in (True, False):
        proposer = _proposer(str(model_path), random_draft, num_blocks=32)
        request = _request("r", tokenizer(PROMPTS[2]).input_ids, temperature=1.0, seed=7)
        (first,) = proposer.propose([request], [K])
        before = request.num_tokens
        # The target rejects the first draft; the second happens to follow its own token.
        request.token_ids += [(first.token_ids[0] + 1) % VOCAB, first.token_ids[1]]
        if use_rollback:
            proposer.rollback("r", before)
        results.append(proposer.propose([request], [K])[0])
        _free_all(proposer, [request])
    assert results[0].token_ids == results[1].token_ids
    assert torch.equal(results[0].probs, results[1].probs)
