"""Priority scheduling on the bundled model in fp32: waiting requests are admitted by
(priority, arrival), the lowest-priority running request is preempted first, greedy
output does not depend on priority, and an engine that does not schedule by priority
refuses a non-zero one, as vLLM does. The API checks show `priority` crossing from the
OpenAI SDK's extra_body and from gRPC to the engine's input."""

import asyncio

import openai
import pytest

from kvserve import LLM, SamplingParams
from replica.request import Request
from router.api.frontend import FrontEnd
from router.api.grpc_api import chat_body, completion_body
from router.api.protocol import CompletionRequest
from router.api.protos import kvserve_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "The sky is"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def one_at_a_time(model_path) -> LLM:
    """Schedules by priority and runs one request at a time, so admission order shows."""
    return LLM(str(model_path), dtype="float32", scheduling_policy="priority", max_num_seqs=1)


def test_waiting_requests_are_admitted_by_priority_then_arrival(one_at_a_time):
    engine = one_at_a_time.engine
    ids = [
        engine.add_request(p, GREEDY, priority=rank) for p, rank in zip(PROMPTS, [1, 0, 1, -1], strict=True)
    ]
    started: list[str] = []
    while engine.has_unfinished():
        started += [d.request_id for d in engine.step() if d.request_id not in started]
    assert [ids.index(i) for i in started] == [3, 1, 0, 2]


def test_greedy_output_does_not_depend_on_priority(one_at_a_time, llm_fp32):
    ranked = one_at_a_time.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[2, 0, 1, -3])
    plain = llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_the_lowest_priority_running_request_is_preempted_first(model_path, policy):
    """Two requests that each fit alone in 6 blocks but not together. The older one has
    the lower priority: under priority it is the victim; under fcfs (all at 0) the newer."""
    llm = LLM(str(model_path), dtype="float32", scheduling_policy=policy, num_kv_blocks=6)
    engine = llm.engine
    assert engine.config.block_size == 16
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)  # 30 + 60 tokens: 6 blocks
    older_id = engine.add_request(list(range(100, 130)), params, priority=1 if policy == "priority" else 0)
    older: Request = engine._requests[older_id]
    engine.step()  # the older one's prefill, before the newer one arrives
    newer: Request = engine._requests[engine.add_request(list(range(200, 230)), params)]
    finished: list[Request] = []
    while engine.has_unfinished():
        engine.step()
        finished += [r for r in (older, newer) if r.is_finished and r not in finished]
    victim, survivor = (older, newer) if policy == "priority" else (newer, older)
    assert victim.num_preemptions >= 1 and survivor.num_preemptions == 0
    assert finished == [survivor, victim]
    assert all(r.num_output_tokens == 60 for r in finished)
    assert engine.kv.num_free_blocks == 6


def test_only_the_priority_policy_takes_a_nonzero_priority(llm_fp32, one_at_a_time):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm_fp32.engine.add_request("Hi", GREEDY, priority=1)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm_fp32.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=[0, -1])
    assert not llm_fp32.engine.has_unfinished()
    with pytest.raises(ValueError, match="priority must be an integer"):
        one_at_a_time.engine.add_request("Hi", GREEDY, priority="high")
    with pytest.raises(ValueError, match="priorities"):
        one_at_a_time.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=[0])


def test_priority_reaches_the_engine_input_from_http_and_grpc(tokenizer):
    """A request attribute beside the sampling fields, which travel to the replica with them."""
    frontend = FrontEnd(None, None, MODEL, tokenizer, len(tokenizer))
    http = asyncio.run(frontend.completion_input(CompletionRequest(prompt="Hi", priority=-2)))
    assert http.request.priority == -2
    grpc = asyncio.run(
        frontend.completion_input(completion_body(pb.GenerateRequest(prompt="Hi", priority=3)))
    )
    assert grpc.request.priority == 3
    chat = chat_body(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")], priority=4))
    assert asyncio.run(frontend.chat_input(chat)).request.priority == 4
    assert asyncio.run(frontend.completion_input(CompletionRequest(prompt="Hi"))).request.priority == 0


def test_priority_crosses_the_openai_sdk_to_a_replica(agent_app):
    """The shared app schedules by priority: a request with one is served, and gives the
    same greedy text as without; a priority that is no integer is a 400."""
    client = openai.OpenAI(base_url=f"{agent_app}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    plain = client.completions.create(**kwargs)
    urgent = client.completions.create(**kwargs, extra_body={"priority": -5})
    assert urgent.choices[0].text == plain.choices[0].text
    ask = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, extra_body={"priority": 3})
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.completions.create(**kwargs, extra_body={"priority": "high"})
