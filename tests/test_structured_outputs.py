"""Structured outputs, logit_bias and n > 1 in the engine, on the bundled model."""

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from router.api.tool_calls import parse, required_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path))  # bf16, as served


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON. Stop=}"}])


def json_params(seed: int, **extra) -> SamplingParams:
    return SamplingParams(
        max_tokens=200, temperature=1.0, seed=seed, structured_outputs={"json": PERSON}, **extra
    )


def test_json_schema_holds_under_batching_preemption_and_stop_strings(model_path, prompt):
    # 12 blocks of 16 tokens cannot hold every request at once: some are preempted. In
    # fp32, so that a greedy row's tokens do not depend on how its prefill was split
    # (after a preemption, say): in bf16 fresh prefills (SDPA) and chunks after cached
    # tokens (the C kernel) round differently.
    llm = LLM(str(model_path), num_kv_blocks=12, block_size=16, dtype="float32")
    constrained = [json_params(seed, stop=["}", '"']) for seed in range(6)]
    free = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 4
    outs = llm.generate([prompt] * 6 + ["Once upon a time"] * 4, constrained + free, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for out in outs[:6]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    # The unconstrained rows are untouched by their neighbours' masks.
    (alone,) = llm.generate("Once upon a time", free[0], use_tqdm=False)
    assert all(out.token_ids == alone.token_ids for out in outs[6:])
    stats = llm.engine.stats()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks


def test_regex_choice_and_json_object(llm, prompt):
    outs = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(
                max_tokens=20, temperature=1.0, seed=1, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}
            ),
            SamplingParams(
                max_tokens=20, temperature=1.0, seed=2, structured_outputs={"choice": ["red", "blue"]}
            ),
            SamplingParams(max_tokens=120, temperature=0, structured_outputs={"json_object": True}),
        ],
        use_tqdm=False,
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[0].text)
    assert outs[1].text in ("red", "blue")
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    else:  # a greedy object that outgrew max_tokens is the one way not to finish
        assert outs[2].text.startswith("{")


def test_required_tool_call_grammar_always_parses(llm):
    tools = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    ]
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}])
    grammar = required_grammar(tools, "add")
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs={"grammar": grammar})
        for s in range(8)
    ]
    for out in llm.generate([prompt] * 8, params, use_tqdm=False):
        content, calls = parse(out.text)
        assert content == "" and len(calls) == 1 and calls[0].name == "add", out.text
        assert set(json.loads(calls[0].arguments)) >= {"a", "b"}


def test_invalid_constraints_fail_at_submit(llm):
    for spec in ({"json": {"type": "objectx"}}, {"regex": "("}, {"grammar": "start: nope"}):
        with pytest.raises(ValueError, match="structured output"):
            llm.generate("Hi", SamplingParams(structured_outputs=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    assert not llm.engine.has_unfinished()


def test_logit_bias_forces_and_bans_tokens(llm):
    (forced,) = llm.generate(
        "Hello", SamplingParams(max_tokens=4, temperature=0, logit_bias={"28": 100}), use_tqdm=False
    )
    assert forced.token_ids == [28] * 4
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (plain,) = llm.generate("Hello", greedy, use_tqdm=False)
    banned = SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias={plain.token_ids[0]: -100}
    )
    (out,) = llm.generate("Hello", banned, use_tqdm=False)
    assert out.token_ids[0] != plain.token_ids[0]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hello", SamplingParams(logit_bias={10**9: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_n_samples_prefill_the_prompt_once(model_path):
    # fp32: in bf16, the group's batch of 3 and the lone request round differently
    # (kernels chosen by batch size), and at temperature 1 that can change a draw.
    llm = LLM(str(model_path), block_size=16, dtype="float32")
    prompt = list(range(100, 100 + 70))  # 4 full blocks and 6 tokens
    kv = llm.engine.kv
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The first sample prefilled 4 full blocks; the other two found all 4 cached.
    assert kv.prefix_cache_hits - hits == 2 * 4
    assert kv.prefix_cache_queries - queries == 3 * 4
    # Seeded samples draw from seed + index: sample 1 is what seed 6 gives alone.
    (alone,) = llm.generate(
        prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True), use_tqdm=False
    )
    assert out.outputs[1].token_ids == alone.token_ids
    assert not llm.engine.has_unfinished()
    assert kv.num_free_blocks == kv.stats().num_total_blocks


def test_aborting_n_samples_frees_everything(llm):
    engine = llm.engine
    request_id = engine.add_request(
        list(range(200, 260)), SamplingParams(n=4, max_tokens=50, ignore_eos=True)
    )
    engine.step()
    engine.step()
    assert engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.stats().num_total_blocks
    assert engine.sampling.num_slots_in_use == 0
    assert not engine._groups
