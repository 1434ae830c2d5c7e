"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's echo + logprobs) against HF
transformers' fp32 log-softmax over the same tokens: in the engine (chunked prefill,
preemption, a cached prefix), over HTTP with the openai SDK as lm-eval calls it, and
over gRPC."""

import grpc
import pytest
import torch
from conftest import AGENT_APP, SERVE_GRPC_PORT

from kvserve import LLM, SamplingParams
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4
PROMPT = (
    "Paged attention keeps the keys and values of every sequence in fixed-size blocks, "
    "so the memory a batch wastes stays under one block per sequence."
)


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, V]: row j is the fp32 log-softmax that predicts token j + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_engine_entries(entries, token_ids: list[int], reference: torch.Tensor, k: int) -> None:
    """Every prompt token's entry: its logprob, its rank and the top-k ids, as HF has them."""
    assert len(entries) == len(token_ids) and entries[0] is None
    for j, entry in enumerate(entries[1:], start=1):
        row = reference[j - 1]
        assert entry.token_id == token_ids[j]
        assert abs(entry.logprob - row[token_ids[j]].item()) < TOLERANCE
        # Tokens within the tolerance of the prompt token's logprob may rank either side.
        assert (
            int((row > entry.logprob + TOLERANCE).sum())
            < entry.rank
            <= int((row > entry.logprob - TOLERANCE).sum()) + 1
        )
        assert list(entry.top_logprobs) == row.topk(k).indices.tolist()
        for token, value in entry.top_logprobs.items():
            assert abs(value - row[token].item()) < TOLERANCE


def test_engine_prompt_logprobs_match_hf_with_a_cached_prefix(llm_fp32, hf_model):
    """A prompt-logprobs request recomputes a prefix another request cached (cached
    blocks have no logits) and still publishes its blocks for the requests after it."""
    tokens = llm_fp32.engine.tokenizer(PROMPT).input_ids
    other = tokens[:32] + llm_fp32.engine.tokenizer(" Then decoding is bound by bandwidth.").input_ids
    greedy = SamplingParams(max_tokens=1, temperature=0)
    assert llm_fp32.generate([tokens], greedy)[0].prompt_logprobs is None
    outputs = llm_fp32.generate(
        [tokens, other], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    )
    for output, ids in zip(outputs, [tokens, other], strict=True):
        assert output.num_cached_tokens == 0
        check_engine_entries(output.prompt_logprobs, ids, hf_logprobs(hf_model, ids), k=3)
    assert llm_fp32.generate([other], greedy)[0].num_cached_tokens >= 32
    only_own = llm_fp32.generate([tokens[:5]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert [e.top_logprobs for e in only_own.prompt_logprobs[1:]] == [{}] * 4


def test_engine_prompt_logprobs_across_chunks_and_preemption(model_path, hf_model):
    """Chunks of at most 8 tokens, async scheduling, and a KV cache so small (7 blocks of
    4 tokens) that the prompt-logprobs request is preempted in the middle of its
    prefill, several times: each entry is computed once, and all of them match HF."""
    llm = LLM(
        str(model_path),
        dtype="float32",
        max_num_batched_tokens=8,
        block_size=4,
        num_kv_blocks=7,
        async_scheduling=True,
    )
    engine = llm.engine
    decoding = list(range(100, 106))
    prompt = list(range(200, 220))
    engine.add_request(decoding, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True), "decoding")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    engine.add_request(prompt, params, "prompt")
    first_deltas, outputs = [], {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.prompt_logprobs is not None:
                first_deltas.append((delta.request_id, delta.num_output_tokens))
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
    assert engine.scheduler.num_preemptions > 0
    assert first_deltas == [("prompt", 1)]  # once, with the first token
    check_engine_entries(outputs["prompt"].prompt_logprobs, prompt, hf_logprobs(hf_model, prompt), k=2)
    assert outputs["decoding"].prompt_logprobs is None
    assert engine.kv.num_free_blocks == 7


@pytest.fixture(scope="module")
def client(agent_app):
    import openai

    return openai.OpenAI(base_url=f"{agent_app}/v1", api_key="unused", max_retries=0)


def test_echo_with_logprobs_as_lm_eval_asks(client, hf_model, model_path):
    """lm-eval's local-completions loglikelihood request: token ids as a batch of one,
    echo, logprobs=1, max_tokens=1, temperature 0; and vLLM's max_tokens=0 echo."""
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(model_path)(PROMPT).input_ids
    reference = hf_logprobs(hf_model, tokens)
    expected = [reference[j - 1, t].item() for j, t in enumerate(tokens) if j]
    answer = client.completions.create(
        model=MODEL, prompt=[tokens], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text.startswith(PROMPT)
    assert len(logprobs.tokens) == len(tokens) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and logprobs.text_offset[0] == 0
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:-1], expected, strict=True)) < TOLERANCE
    for j, top in enumerate(logprobs.top_logprobs[1:-1], start=1):  # the token itself, then the top one
        assert max(top.values()) == pytest.approx(reference[j - 1].max().item(), abs=TOLERANCE)
    only_prompt = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert only_prompt.choices[0].text == PROMPT and only_prompt.usage.completion_tokens == 0
    echoed = only_prompt.choices[0].logprobs.token_logprobs
    assert len(echoed) == len(tokens)
    assert max(abs(a - b) for a, b in zip(echoed[1:], expected, strict=True)) < TOLERANCE
    batch = client.completions.create(
        model=MODEL, prompt=[tokens, tokens[:6]], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(tokens) + 1, 7]


def test_vllm_prompt_logprobs_field(client, hf_model, model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokens = tokenizer(PROMPT).input_ids
    reference = hf_logprobs(hf_model, tokens)
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    for j, position in enumerate(entries[1:], start=1):
        row, own = reference[j - 1], position[str(tokens[j])]
        assert abs(own["logprob"] - row[tokens[j]].item()) < TOLERANCE
        assert own["rank"] == int((row > row[tokens[j]]).sum()) + 1
        assert {int(t) for t in position} == {tokens[j], *row.topk(2).indices.tolist()}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and chat.usage.prompt_tokens == len(
        chat.model_extra["prompt_logprobs"]
    )


def test_grpc_prompt_logprobs(agent_app, hf_model, model_path):
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(model_path)(PROMPT).input_ids
    reference = hf_logprobs(hf_model, tokens)
    with grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}") as channel:
        request = pb.GenerateRequest(
            model=MODEL,
            prompt=PROMPT,
            params=pb.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
        )
        answer = pb_grpc.LLMStub(channel).Generate(request, metadata=[("application", AGENT_APP)])
    entries = answer.prompt_logprobs  # after the first token, which has none
    assert [e.token_id for e in entries] == tokens[1:]
    assert max(abs(e.logprob - reference[j, e.token_id].item()) for j, e in enumerate(entries)) < TOLERANCE
