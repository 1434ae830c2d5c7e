"""Anthropic's Messages API against a real Serve app, through the official `anthropic`
SDK unchanged, as Claude-Code-style agents call it: whole and streamed messages agree,
stop reasons and usage are right, forced tool calls always fit their schema, a tool
result goes back in the next turn, and errors arrive in Anthropic's shape.

The bundled 135M model is deterministic under greedy decoding but not smart, so the
assertions are on structure and on agreement between paths, not on what it says."""

import json
import re

import anthropic
import httpx
import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a storyteller."
PROMPT = "Tell me a long story about a dragon and a knight."
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a time zone.",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK's create() has no temperature parameter any more; the API, and kvserve, take one.
GREEDY = {"temperature": 0}
RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


@pytest.fixture(scope="module")
def client(agent_app) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_app, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def story(client) -> anthropic.types.Message:
    """The greedy answer that the streamed and stop-sequence requests are checked against."""
    return client.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        extra_body=GREEDY,
    )


def streamed(client, **request) -> tuple[anthropic.types.Message, list]:
    """The final message and the raw events, as the SDK's stream helper sees them."""
    with client.messages.stream(**request) as stream:
        events = [event for event in stream if event.type in RAW_EVENTS]
        return stream.get_final_message(), events


def test_message_usage_and_count_tokens(client, agent_app, story):
    assert story.id.startswith("msg_") and story.type == "message" and story.role == "assistant"
    assert story.model == MODEL
    assert [block.type for block in story.content] == ["text"] and story.content[0].text
    assert (story.stop_reason, story.stop_sequence) == ("max_tokens", None)
    assert story.usage.output_tokens == 12
    counted = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": PROMPT}]
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    tokenized = httpx.post(f"{agent_app}/tokenize", json={"messages": messages}, timeout=60).json()
    assert story.usage.input_tokens == counted.input_tokens == tokenized["count"]
    # Tools are part of the prompt, and so of its count.
    with_tools = client.messages.count_tokens(model="", messages=WEATHER_QUESTION, tools=[WEATHER])
    without = client.messages.count_tokens(messages=WEATHER_QUESTION, model="")
    assert with_tools.input_tokens > without.input_tokens + 20


def test_stream_equals_the_whole_message(client, story):
    final, events = streamed(
        client,
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    assert final.content[0].text == story.content[0].text and len(final.content) == 1
    assert (final.stop_reason, final.stop_sequence) == ("max_tokens", None)
    assert final.usage.model_dump() == story.usage.model_dump()
    order = " ".join(event.type for event in events)
    block = r"content_block_start( content_block_delta)+ content_block_stop"
    assert re.fullmatch(rf"message_start {block} message_delta message_stop", order), order
    assert events[0].message.usage.input_tokens == story.usage.input_tokens


def test_stop_sequences_whole_and_streamed(client, story):
    text = story.content[0].text
    word = " " + text.split()[2]  # a word well inside the greedy text
    cut = text.find(word)
    request = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "extra_body": GREEDY,
        "stop_sequences": ["never appears", word],
    }
    whole = client.messages.create(**request)
    final, _ = streamed(client, **request)
    for message in (whole, final):
        assert message.content[0].text == text[:cut]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
        assert message.usage.output_tokens < 12


@pytest.mark.parametrize(
    "tool_choice, name",
    [({"type": "any"}, None), ({"type": "tool", "name": "get_time"}, "get_time")],
)
def test_forced_tool_use_fits_the_schema(client, tool_choice, name):
    message = client.messages.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=60,
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in (name or call.name) and isinstance(call.input, dict)
    schema = {tool["name"]: tool["input_schema"] for tool in (WEATHER, TIME)}[call.name]
    jsonschema.validate(call.input, schema)


def test_streamed_tool_use_and_a_tool_result_round_trip(client):
    request = {
        "model": MODEL,
        "messages": WEATHER_QUESTION,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": 60,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**request)
    final, events = streamed(client, **request)
    [call] = [block for block in whole.content if block.type == "tool_use"]
    [streamed_call] = [block for block in final.content if block.type == "tool_use"]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert pieces and all(
        e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta"
    )
    assert json.loads("".join(pieces)) == streamed_call.input == call.input
    assert streamed_call.name == call.name == "get_weather" and final.stop_reason == "tool_use"
    assert final.usage.model_dump() == whole.usage.model_dump()

    def conversation(result: str) -> list[dict]:
        turn = {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}
        answer = {
            "type": "tool_result",
            "tool_use_id": call.id,
            "content": [{"type": "text", "text": result}],
        }
        return [
            *WEATHER_QUESTION,
            {"role": "assistant", "content": [turn]},
            {"role": "user", "content": [answer]},
        ]

    reply = client.messages.create(
        model=MODEL, messages=conversation("Sunny, 24 C."), tools=[WEATHER], max_tokens=8, extra_body=GREEDY
    )
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    short = client.messages.count_tokens(model=MODEL, messages=conversation("Sunny, 24 C."), tools=[WEATHER])
    longer = client.messages.count_tokens(
        model=MODEL, messages=conversation("Sunny, 24 C, light wind from the west."), tools=[WEATHER]
    )
    assert reply.usage.input_tokens == short.input_tokens < longer.input_tokens  # the result is in the prompt


def test_errors_in_anthropics_shape(client):
    question = [{"role": "user", "content": "Hi"}]
    # max_tokens is required, as in Anthropic's API; the SDK's create() would not send such a body.
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": MODEL, "messages": question}, cast_to=object)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", messages=question, max_tokens=4)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=MODEL,
            messages=question,
            max_tokens=4,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "no_such_tool"},
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "no_such_tool" in info.value.body["error"]["message"]
