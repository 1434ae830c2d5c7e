"""What SDKs and agent frameworks send, through the official openai client and LangChain
against a real Serve app on the bundled model: structured outputs, tool calls, n > 1,
content parts and nulls."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import SERVE_HTTP_PORT, undeploy
from ray import serve

from deployments.app import build_app
from wire.messages import ReplicaReport

APP = "surface-test"
MODEL = "SmolLM2-135M-Instruct"
BASE = f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string", "maxLength": 12}},
                "required": ["kind", "name"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(ray_cluster, model_path):
    config = {
        "app_name": APP,
        "model": str(model_path),
        "served_model_name": MODEL,
        "chat_template": "chatml_tools",  # SmolLM2's own template renders no tools
        "engine_args": {"kv_cache_memory_gb": 0.25},
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
    undeploy(APP)


def replica_stats() -> ReplicaReport:
    return serve.get_deployment_handle("LLMServer", app_name=APP).stats.remote().result()


def test_json_schema_answers_validate_under_mixed_load(client):
    def constrained(seed: int) -> dict:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Invent a person with pets, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        assert out.choices[0].finish_reason == "stop"
        return json.loads(out.choices[0].message.content)

    def free(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, seed=seed)
        return out.choices[0].text

    with ThreadPoolExecutor(30) as pool:
        people = [pool.submit(constrained, seed) for seed in range(20)]
        stories = [pool.submit(free, seed) for seed in range(10)]
        answers = [f.result() for f in people]
        assert all(f.result() for f in stories)
    for answer in answers:
        jsonschema.validate(answer, PERSON)
    # json_object and vLLM's guided_choice.
    obj = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=200, seed=1
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(
        model=MODEL, prompt="Yes or no?", extra_body={"guided_choice": ["yes", "no"]}, max_tokens=5
    )
    assert choice.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_always_call(client, stream):
    def call(seed: int) -> tuple[list[tuple[str, dict]], str]:
        choice = {"type": "function", "function": {"name": "add"}} if seed % 2 else "required"
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=100)
        if not stream:
            out = client.chat.completions.create(**kwargs).choices[0]
            calls = out.message.tool_calls or []
            assert all(c.id.startswith("call_") for c in calls)
            return [(c.function.name, json.loads(c.function.arguments)) for c in calls], out.finish_reason
        calls, finish = {}, None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(call, range(20)))
    for seed, (calls, finish) in enumerate(results):
        assert finish == "tool_calls" and len(calls) == 1, (seed, calls)
        name, arguments = calls[0]
        if seed % 2:
            assert name == "add" and set(arguments) >= {"a", "b"}
            assert all(isinstance(arguments[k], int) for k in ("a", "b"))
        else:
            assert name in ("add", "get_weather")


def test_tool_results_go_back_into_the_conversation(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=20)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = httpx.post(f"{BASE}/tokenize", json={"model": MODEL, "messages": messages}).json()
    rendered = httpx.post(f"{BASE}/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]}).json()
    assert "<tool_response>" in rendered["prompt"] and call.function.name in rendered["prompt"]


def test_n_returns_n_choices_and_prefills_once(client):
    prompt = "List three colours of the rainbow, then three fruits, then three animals:" * 2
    before = replica_stats()
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=3,
        max_tokens=6,
        seed=2,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    after = replica_stats()
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 3 * 6  # the prompt counts once
    full_blocks = out.usage.prompt_tokens // before.block_size
    assert after.prefix_cache_queries - before.prefix_cache_queries == 3 * full_blocks
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * full_blocks
    # Streaming: every choice's chunks carry its index, and each finishes once.
    finishes = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=5, stream=True):
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    best = client.completions.create(
        model=MODEL, prompt="Hi", n=1, max_tokens=4, extra_body={"best_of": 3, "ignore_eos": True}
    )
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 3 * 4  # every sample generated counts


def test_content_parts_nulls_and_openai_extras(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Say hi"}, {"type": "text", "text": "!"}]}
        ],
        max_tokens=4,
        temperature=None,
        top_p=None,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        user="someone",
        logit_bias={"28": 100},
        max_completion_tokens=3,
    )
    assert out.usage.completion_tokens == 3
    echoed = client.completions.create(model=MODEL, prompt="Echo me", echo=True, max_tokens=2, temperature=0)
    assert echoed.choices[0].text.startswith("Echo me")
    with pytest.raises(openai.BadRequestError, match="only text"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    with pytest.raises(openai.BadRequestError, match="structured output"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )


def test_langchain_structured_output_and_tools(client):
    import langchain_openai
    from pydantic import BaseModel, Field

    # min_length: the schema, and so the grammar, rules out the empty name a sampled
    # answer can otherwise give.
    class Pet(BaseModel):
        kind: str = Field(min_length=1, max_length=10)
        name: str = Field(min_length=1, max_length=12)

    chat = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{BASE}/v1",
        api_key="unused",
        max_tokens=200,
        temperature=0.7,
        max_retries=0,
        seed=0,
    )
    pet = chat.with_structured_output(Pet, method="json_schema").invoke("Invent a pet.")
    assert isinstance(pet, Pet) and pet.name

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    reply = chat.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "add"
    assert set(reply.tool_calls[0]["args"]) == {"a", "b"}
