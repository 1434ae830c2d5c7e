"""What a new user meets on the embedded default, with no flags: tool calls work (the
bundled model's default chat template renders tools), a request without a model
(proto3's empty string over gRPC, an absent field over HTTP) means the served one, and
unset sampling fields take the model card's recommendation."""

import json

import grpc
import httpx
import openai
import pytest
from conftest import AGENT_APP, SERVE_GRPC_PORT
from transformers import AutoTokenizer

from replica.chat_template import BUNDLED_CHAT_TEMPLATE, chat_prompt_ids, load_chat_template
from replica.model_files import sampling_defaults
from replica.model_loader import bundled_tokenizer_path, resolve_model
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc

MODEL = "SmolLM2-135M-Instruct"
ADD = {
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
}


def test_the_default_template_renders_plain_chats_as_the_model_does():
    """Choosing the tools template for the bundled model changes no prompt without tools."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    template = load_chat_template(BUNDLED_CHAT_TEMPLATE)
    for messages in (
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."},
        ],
    ):
        assert chat_prompt_ids(tokenizer, messages, chat_template=template) == chat_prompt_ids(
            tokenizer, messages
        )


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_work_with_no_flags(agent_app, stream):
    client = openai.OpenAI(base_url=f"{agent_app}/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is 2 plus 3?"}]
    kwargs = dict(model=MODEL, messages=ask, tools=[ADD], tool_choice="required", max_tokens=40)
    kwargs["temperature"] = 0
    if stream:
        calls: dict[int, dict] = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            deltas = chunk.choices[0].delta.tool_calls if chunk.choices else None
            for call in deltas or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        called = list(calls.values())
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        called = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert called and all(c["name"] == "add" for c in called)
    assert all(isinstance(json.loads(c["arguments"])["a"], int) for c in called)


def test_an_absent_model_means_the_served_one(agent_app):
    body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0}
    absent = httpx.post(f"{agent_app}/v1/completions", json=body, timeout=60)
    named = httpx.post(f"{agent_app}/v1/completions", json={**body, "model": MODEL}, timeout=60)
    assert absent.status_code == 200, absent.text
    assert absent.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]
    other = httpx.post(f"{agent_app}/v1/completions", json={**body, "model": "other"}, timeout=60)
    assert other.status_code == 404

    with grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}") as channel:
        stub = pb_grpc.LLMStub(channel)
        meta = [("application", AGENT_APP)]
        params = pb.SamplingParams(max_tokens=4, temperature=0)
        unset = stub.Generate(pb.GenerateRequest(prompt="The sky is", params=params), metadata=meta)
        assert unset.text == absent.json()["choices"][0]["text"]
        chat = stub.Chat(
            pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")], params=params), metadata=meta
        )
        assert chat.usage.completion_tokens > 0
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(model="other", prompt="x", params=params), metadata=meta)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_unset_sampling_takes_the_model_cards_defaults(agent_app):
    """The bundled model's generation_config.json carries its model card's sampling; a
    request that sets neither field runs with it, one that sets them with its own. The
    Responses object reports the values the request ran with."""
    assert sampling_defaults(resolve_model(None)) == {"temperature": 0.2, "top_p": 0.9}
    client = openai.OpenAI(base_url=f"{agent_app}/v1", api_key="unused", max_retries=0)
    unset = client.responses.create(model=MODEL, input="Hi!", max_output_tokens=4, store=False)
    assert (unset.temperature, unset.top_p) == (0.2, 0.9)
    own = client.responses.create(
        model=MODEL, input="Hi!", max_output_tokens=4, store=False, temperature=1.0, top_p=0.5
    )
    assert (own.temperature, own.top_p) == (1.0, 0.5)
