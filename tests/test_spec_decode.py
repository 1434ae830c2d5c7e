"""Speculative decoding through the engine: greedy output equals HF `generate` token for
token (fp32) with n-gram and draft-model proposals, under batching, chunked prefill,
preemption and prefix-cache hits; the output's other rules (logprobs, stop strings,
max_tokens, logit_bias, grammars, seeds) hold as without speculation; a request can opt
out; and proposals that keep failing pause."""

import pytest
from conftest import hf_greedy, save_random_llama

from kvserve import LLM, SamplingParams
from replica.spec_decode.ngram import propose_ngram
from wire.sampling_params import StructuredOutputs

LIST = ", ".join(["apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "honeydew", "kiwi"])
PROMPTS = [
    f"Repeat this list exactly: {LIST}.\nList: apple, banana,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3,",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "List the three primary colors of light:",
    "<p>Hello</p>\n<p>World</p>\n<p>Hello</p>\n<p>",
]
MAX_NEW = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# Small enough that 8 requests of about 60 tokens preempt each other; chunked prefill.
PRESSURE = {"num_kv_blocks": 24, "block_size": 8, "max_num_batched_tokens": 16, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(hf_model, prompt_ids, llm_fp32):
    eos = set(llm_fp32.engine.eos_token_ids)
    return [hf_greedy(hf_model, ids, MAX_NEW, eos) for ids in prompt_ids]


@pytest.fixture(scope="module")
def llm_ngram(model_path):
    return LLM(str(model_path), dtype="float32", speculative_config=NGRAM)


def _greedy(llm: LLM, prompt_ids, **params):
    params = SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0, **params})
    return llm.generate(prompt_ids, params, use_tqdm=False)


def test_ngram_greedy_equals_hf_under_pressure_and_prefix_hits(model_path, prompt_ids, expected):
    llm = LLM(str(model_path), dtype="float32", speculative_config=NGRAM, **PRESSURE)
    engine = llm.engine
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompt_ids)] == expected
    stats = engine.stats().spec_decode  # a copy
    assert engine.scheduler.num_preemptions > 0
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    # Rejected tokens' blocks came back: nothing is held once every request is done.
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    again = _greedy(llm, prompt_ids)  # prefix-cache hits this time
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == expected
    assert engine.speculator.stats.num_drafts > stats.num_drafts


def test_draft_model_that_is_the_target_has_every_token_accepted(model_path, prompt_ids, expected):
    spec = {"method": "draft_model", "model": str(model_path), "num_speculative_tokens": 3}
    llm = LLM(str(model_path), dtype="float32", speculative_config=spec, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompt_ids[:4])] == expected[:4]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    draft_kv = llm.engine.speculator.proposer.kv
    assert draft_kv.num_free_blocks == draft_kv.pool.num_blocks


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tokenizer):
    """An unrelated model with the bundled model's vocabulary: its proposals are noise."""
    return save_random_llama(tmp_path_factory.mktemp("random-draft"), tokenizer)


def test_random_draft_model_is_almost_always_rejected(model_path, prompt_ids, expected, random_draft):
    spec = {"method": "draft_model", "model": str(random_draft), "num_speculative_tokens": 3}
    llm = LLM(str(model_path), dtype="float32", speculative_config=spec, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompt_ids[:4])] == expected[:4]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens <= 0.1 * stats.num_draft_tokens


def test_failing_proposals_pause_and_resume(model_path, random_draft, tokenizer):
    spec = {
        "method": "draft_model",
        "model": str(random_draft),
        "num_speculative_tokens": 4,
        "acceptance_window": 8,
        "backoff_steps": 10,
    }
    llm = LLM(str(model_path), dtype="float32", speculative_config=spec)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm.generate([tokenizer("Once upon a time").input_ids], params, use_tqdm=False)
    # 8 tokens rejected in 2 proposals, a 10-step pause; then proposals again: 2, 10, 2, ...
    drafts = llm.engine.speculator.stats.num_drafts
    assert 4 <= drafts <= 8, drafts


def test_output_rules_hold_with_speculation(llm_ngram, llm_fp32, prompt_ids):
    """Logprobs, stop strings, max_tokens, logit_bias and a grammar, each as without."""
    cases = [
        {"logprobs": 3},
        {"stop": [" cherry"]},
        {"max_tokens": 5},
        {"logit_bias": {llm_fp32.tokenizer(" fig").input_ids[0]: -100.0}},
        # The prompts' repeats propose tokens the grammar cannot follow: it must reject them.
        {"structured_outputs": StructuredOutputs(regex=r"(apple|banana|cherry)(, (apple|banana)){0,8}")},
    ]
    for extra in cases:
        with_spec = _greedy(llm_ngram, prompt_ids[:3], **extra)
        without = _greedy(llm_fp32, prompt_ids[:3], **extra)
        for a, b in zip(with_spec, without, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, extra
            assert a.outputs[0].text == b.outputs[0].text
            assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
            if "logprobs" in extra:
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                    assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                    assert x.top_logprobs.keys() == y.top_logprobs.keys()
    assert llm_ngram.engine.speculator.stats.num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_opt_out_does_not_speculate(llm_ngram, prompt_ids):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=7)
    first = llm_ngram.generate(prompt_ids[:3], params, use_tqdm=False)
    second = llm_ngram.generate(prompt_ids[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]

    before = llm_ngram.engine.stats().spec_decode
    opted_out = SamplingParams(max_tokens=MAX_NEW, temperature=0, speculative=False)
    llm_ngram.generate(prompt_ids[:3], opted_out, use_tqdm=False)
    assert llm_ngram.engine.stats().spec_decode == before


def test_a_migrated_request_goes_on_exactly(llm_ngram, prompt_ids, expected):
    """Resumed from the output another replica streamed: proposals come from the whole
    history, and the rest of the output is what one run would have given."""
    engine = llm_ngram.engine
    drafts = engine.speculator.stats.num_drafts
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    request_id = engine.add_request(prompt_ids[0], params, resume_token_ids=expected[0][:8])
    tokens = []
    while engine.has_unfinished():
        tokens += [
            t for delta in engine.step() if delta.request_id == request_id for t in delta.new_token_ids
        ]
    assert tokens == expected[0][8:]
    assert engine.speculator.stats.num_drafts > drafts


def test_async_scheduling_runs_in_step_only_while_a_request_has_a_lead(model_path, prompt_ids, expected):
    """A proposal starts from a request's newest token, so a step that speculates cannot
    overlap the previous one. Under async scheduling a step runs in step only while the
    request's known tokens end in an n-gram match; other steps keep the overlap. The
    output is the same either way."""
    llm = LLM(str(model_path), dtype="float32", speculative_config=NGRAM, async_scheduling=True)
    engine = llm.engine
    in_step = overlapped = 0
    for ids, want in zip(prompt_ids[:4], expected[:4], strict=True):
        request_id = engine.add_request(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0))
        tokens = []
        while engine.has_unfinished():
            running = engine.scheduler.running
            known = [r.token_ids[: r.num_tokens - r.num_pending] for r in running]
            lead = any(propose_ngram(t, 1, min_n=2, max_n=4) for t in known)
            for delta in engine.step():
                assert delta.request_id == request_id
                tokens += delta.new_token_ids
            if lead:
                assert engine._in_flight is None
                in_step += 1
            elif engine._in_flight is not None:
                overlapped += 1
        assert tokens == want
    assert in_step > 0 and overlapped > 0, (in_step, overlapped)
    assert engine.speculator.stats.num_accepted_tokens > 0
