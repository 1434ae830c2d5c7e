"""Resuming a request from the output another replica already streamed (what migration
sends): the engine must go on exactly where the first run was, for greedy, seeded,
penalised, stop-string and grammar-constrained requests, in fp32 on the bundled model."""

import json

import pytest

from kvserve import SamplingParams
from replica.engine import Engine

PROMPT = "Write a short story about a lighthouse keeper."


def run(engine: Engine, params: SamplingParams, resume: list[int] | None = None) -> dict:
    """One request alone in the engine: its new tokens, the text each step sent, and
    its last delta."""
    request_id = engine.add_request(PROMPT, params, resume_token_ids=resume)
    tokens, texts, final = [], [], None
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == request_id and len(delta.new_token_ids) == 1
            tokens += delta.new_token_ids
            texts.append(delta.new_text)
            if delta.finished:
                final = delta
    return {"tokens": tokens, "texts": texts, "text": "".join(texts), "final": final}


CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
    "seeded-fused": SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=24, temperature=0.7, seed=3, frequency_penalty=0.8, presence_penalty=0.3, ignore_eos=True
    ),
    "logprobs": SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_goes_on_exactly_where_the_first_left_off(llm_fp32, case):
    engine = llm_fp32.engine
    params = CASES[case]
    full = run(engine, params)
    assert len(full["tokens"]) == params.max_tokens
    for k in (1, 7, params.max_tokens - 1):
        sent = full["tokens"][:k]
        rest = run(engine, params, resume=sent)
        assert rest["tokens"] == full["tokens"][k:], (case, k)
        assert "".join(full["texts"][:k]) + rest["text"] == full["text"]  # what the client sees
        assert rest["final"].num_output_tokens == params.max_tokens  # usage counts them once
        assert rest["final"].output.token_ids == full["tokens"]
        assert rest["final"].output.text == full["text"]
        # The first run left prompt and output in the prefix cache; only the prompt's
        # part counts as cached prompt tokens (ingress metrics take the difference).
        assert rest["final"].num_cached_tokens <= rest["final"].num_prompt_tokens


def test_resumed_requests_go_on_exactly_inside_a_batch(llm_fp32):
    """Sixteen requests, greedy and seeded, all moved after two tokens at once (as when
    their replica dies) into one batch: each goes on as it did undisturbed.

    The resumed batch prefills the two tokens that the first one decoded, and fp32 GEMMs
    round differently at other row counts, so the logits differ in their last bits. A
    draw over the whole vocabulary then lands on a neighbouring token whenever it falls
    that close to one of its ~49k interval boundaries; over top_k = 20 candidates it
    practically never does, while a wrong generator state or context still changes the
    draws."""
    engine = llm_fp32.engine
    prompts = [f"Story {i}: once upon a time, in a town by the sea," for i in range(16)]
    seeds = [None] * 8 + list(range(8))
    params = [
        # top_k leaves the greedy rows' argmax as it is.
        SamplingParams(
            max_tokens=32, ignore_eos=True, temperature=0.8 if seed is not None else 0, top_k=20, seed=seed
        )
        for seed in seeds
    ]

    def batch(resume: list[list[int]] | None) -> list[list[int]]:
        ids = [
            engine.add_request(prompt, p, resume_token_ids=resume[i] if resume else None)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids
        return [tokens[i] for i in ids]

    undisturbed = batch(None)
    resumed = batch([tokens[:2] for tokens in undisturbed])
    assert resumed == [tokens[2:] for tokens in undisturbed]


def test_a_resumed_request_keeps_a_stop_string_that_spans_the_cut(llm_fp32):
    """The stop string begins in the tokens already sent and ends after them: the first
    run held its beginning back, and so must the resumed run."""
    engine = llm_fp32.engine
    free = run(engine, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    text = free["text"]
    # A stop string from the model's own text whose first two characters come out at
    # least one token before its last: cut the request between the two.
    for start in range(len(text) // 3, len(text) - 6):
        stop = text[start : start + 6]
        params = SamplingParams(max_tokens=40, temperature=0, stop=[stop], ignore_eos=True)
        stopped = run(engine, params)
        decoded = [engine.tokenizer.decode(stopped["tokens"][:k]) for k in range(len(stopped["tokens"]))]
        cuts = [k for k in range(1, len(stopped["tokens"])) if stop[:2] in decoded[k]]
        if stop.strip() and stopped["final"].finish_reason == "stop" and cuts:
            break
    else:
        raise AssertionError(f"no stop string in {text!r} spans two tokens")
    k = cuts[0]
    sent = "".join(stopped["texts"][:k])
    assert not sent.endswith(stop[:2])  # held back
    rest = run(engine, params, resume=stopped["tokens"][:k])
    assert sent + rest["text"] == stopped["text"]
    assert rest["tokens"] == stopped["tokens"][k:]
    assert rest["final"].finish_reason == "stop"
    with pytest.raises(ValueError, match="already end"):  # the ingress never moves a finished stream
        engine.add_request(PROMPT, params, resume_token_ids=stopped["tokens"])


def test_a_resumed_request_keeps_its_grammar_state(llm_fp32):
    engine = llm_fp32.engine
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=64, temperature=0, structured_outputs={"json": schema})
    full = run(engine, params)
    assert full["final"].finish_reason == "stop"
    json.loads(full["final"].output.text)
    k = len(full["tokens"]) // 2
    rest = run(engine, params, resume=full["tokens"][:k])
    assert rest["tokens"] == full["tokens"][k:]
    assert rest["final"].output.text == full["final"].output.text


def test_bad_resume_token_ids_are_refused(llm_fp32):
    engine = llm_fp32.engine
    params = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request(PROMPT, params, resume_token_ids=[-1])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(PROMPT, params, resume_token_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="n = 1"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, n=2), resume_token_ids=[1])
    assert not engine.has_unfinished()
