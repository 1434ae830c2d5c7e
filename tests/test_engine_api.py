"""Engine behaviour through the offline API, on the real bundled model unless a test
builds its own."""

import pytest
from conftest import save_random_llama

from kvserve import LLM, SamplingParams
from replica.model_loader import ModelNotFoundError


def test_seeded_sampling_is_reproducible(llm_fp32):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    prompt = "Once upon a time, by the sea,"
    (a,) = llm_fp32.generate(prompt, params, use_tqdm=False)
    # Same seed inside a different batch: same tokens.
    others = [SamplingParams(max_tokens=5, temperature=1.0)] * 3
    outs = llm_fp32.generate(["Hello", prompt, "Once"], [others[0], params, others[1]], use_tqdm=False)
    assert outs[1].token_ids == a.token_ids
    (c,) = llm_fp32.generate(
        prompt,
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert c.token_ids != a.token_ids


def test_max_tokens_finishes_with_length(llm_fp32):
    (out,) = llm_fp32.generate(
        "Count: 1, 2, 3,", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


def test_stop_string_finishes_with_stop_and_is_cut(llm_fp32):
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=24, temperature=0)
    (full,) = llm_fp32.generate(prompt, greedy, use_tqdm=False)
    text = full.text
    # A stop string that starts mid-output, taken from the model's own greedy text.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert stop.strip()
    cut = text.index(stop)
    (stopped,) = llm_fp32.generate(
        prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]), use_tqdm=False
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_eos_and_stop_token_ids(llm_fp32):
    (out,) = llm_fp32.generate(
        "The capital of France is", SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
    )
    stop_token = out.token_ids[3]
    (stopped,) = llm_fp32.generate(
        "The capital of France is",
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(stop_token) + 1]
    chat = llm_fp32.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False
    )[0]
    assert chat.finish_reason == "stop"
    assert chat.token_ids[-1] in llm_fp32.engine.eos_token_ids
    assert chat.text.strip()


def test_logprobs_returned_per_token(llm_fp32):
    (out,) = llm_fp32.generate(
        "Hello", SamplingParams(max_tokens=4, temperature=0, logprobs=2), use_tqdm=False
    )
    assert len(out.outputs[0].logprobs) == 4
    for token, lp in zip(out.token_ids, out.outputs[0].logprobs, strict=True):
        assert lp.token_id == token
        assert lp.logprob <= 0
        assert len(lp.top_logprobs) == 2
        assert lp.top_logprobs[token] == pytest.approx(lp.logprob)  # greedy token is the top-1


def test_abort_frees_blocks(llm_fp32):
    engine = llm_fp32.engine
    total = engine.stats().kv.num_total_blocks
    rid = engine.add_request("Tell me a story.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().kv.num_free_blocks < total
    assert engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.stats().kv.num_free_blocks == total
    assert not engine.abort(rid)


def test_stream_deltas_add_up(llm_fp32):
    engine = llm_fp32.engine
    engine.add_request("List some fruits:", SamplingParams(max_tokens=30, temperature=0))
    pieces, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            last = out
    assert last.finished and "".join(pieces) == last.output.text
    assert last.num_output_tokens == len(last.output.token_ids)


@pytest.mark.parametrize(
    "prompt, message",
    [("", "empty"), ([], "empty"), ([10**9], "token ids"), ("word " * 9000, "context window")],
)
def test_bad_prompts_are_clear_errors(llm_fp32, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm_fp32.engine.add_request(prompt)
    assert not llm_fp32.engine.has_unfinished()


def test_a_bad_prompt_in_a_batch_admits_none(llm_fp32):
    with pytest.raises(ValueError, match="empty"):
        llm_fp32.generate(["fine", ""], use_tqdm=False)
    assert not llm_fp32.engine.has_unfinished()
    assert llm_fp32.generate([], use_tqdm=False) == []


def test_duplicate_request_id_rejected(llm_fp32):
    engine = llm_fp32.engine
    engine.add_request("a", SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b", SamplingParams(max_tokens=1), request_id="dup")
    engine.abort("dup")


def test_max_tokens_clipped_to_context_window(model_path):
    llm = LLM(str(model_path), dtype="float32", max_model_len=40)
    prompt = [1] * 30
    (out,) = llm.generate(
        prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert len(out.token_ids) == 10
    assert out.finish_reason == "length"


def test_missing_model_and_unknown_args_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(str(tmp_path))
    with pytest.raises(TypeError, match="unknown engine arguments: bogus"):
        LLM(None, bogus=1)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(None, scheduling_policy="fifo")
    with pytest.raises(ValueError, match="generation_config"):
        LLM(None, generation_config="vllm")


def test_warm_up_leaves_no_trace(llm_fp32):
    """A serving replica warms its engine at start-up; its dummy requests must leave no
    cached blocks, no counts and no change in what real requests get."""
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = "The three primary colours are"
    (before,) = llm_fp32.generate(prompt, params, use_tqdm=False)
    engine = llm_fp32.engine
    counters = engine.stats().kv.prefix_cache_queries, engine.stats().kv.prefix_cache_hits
    engine.warm_up(num_tokens=96)
    stats = engine.stats()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
    assert engine.kv.cached_prefix_summary(16) == []
    assert (stats.kv.prefix_cache_queries, stats.kv.prefix_cache_hits) == counters
    assert engine.sampling.num_slots_in_use == 0
    (after,) = llm_fp32.generate(prompt, params, use_tqdm=False)
    assert after.token_ids == before.token_ids and after.num_cached_tokens == 0


def test_the_bundled_models_sampling_is_the_default_of_a_call_without_params(llm_fp32):
    assert llm_fp32.get_default_sampling_params() == SamplingParams(temperature=0.2, top_p=0.9)


def test_a_call_without_params_samples_as_the_models_generation_config_says(tmp_path, tokenizer):
    """top_k=1 in the file makes sampling at temperature 1.5 greedy; SamplingParams' own
    defaults would sample a small random model's flat distributions instead."""
    from transformers import GenerationConfig

    save_random_llama(tmp_path, tokenizer, vocab_size=len(tokenizer))
    GenerationConfig(do_sample=True, top_k=1, temperature=1.5).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=1.5)
    prompts = ["Once upon a time", "The capital of France is"]
    greedy = SamplingParams(temperature=0)  # max_tokens 16, as the default's
    assert [o.token_ids for o in llm.generate(prompts, use_tqdm=False)] == [
        o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)
    ]
    as_given = LLM(str(tmp_path), dtype="float32", generation_config="none")
    assert as_given.get_default_sampling_params() == SamplingParams()
