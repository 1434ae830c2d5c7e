"""OpenAI's Responses API (/v1/responses) through the official SDK, on the shared agent
app: its answers must equal the chat endpoint's for the same conversation, stream the
same text, call tools, hold a JSON schema and continue stored conversations."""

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from router.api.response_store import ResponseStore

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
ASK = "What is the weather in Paris?"
GREEDY = {"model": MODEL, "temperature": 0}
CALL_WEATHER = dict(input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=40, **GREEDY)


@pytest.fixture(scope="module")
def client(agent_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_app + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def weather_call(client):
    """One greedy required call of get_weather, shared: constrained decoding is the
    slowest thing here on CPU."""
    return client.responses.create(**CALL_WEATHER)


def strictly(model, value):
    """The SDK builds its objects without validation; this checks them against its types."""
    return TypeAdapter(model).validate_python(
        value.model_dump(mode="json", by_alias=True, exclude_unset=True)
    )


def as_input(items) -> list[dict]:
    """Output items passed back as input, as clients chaining statelessly do."""
    return [item.model_dump(exclude_none=True) for item in items]


def test_text_equals_the_chat_completion_and_is_cut_by_max_output_tokens(client):
    response = client.responses.create(input="Name three colours.", max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Name three colours."}], max_tokens=8, **GREEDY
    )
    strictly(Response, response)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.error is None
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert response.output_text == chat.choices[0].message.content != ""
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and item.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.max_output_tokens == 8 and response.temperature == 0 and response.store is True


def test_instructions_are_a_system_message(client):
    response = client.responses.create(
        input="Name three colours.", instructions="Answer in French.", max_output_tokens=6, **GREEDY
    )
    chat = client.chat.completions.create(
        messages=[
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Name three colours."},
        ],
        max_tokens=6,
        **GREEDY,
    )
    assert response.instructions == "Answer in French."
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_deltas_join_to_the_whole_text(client):
    kwargs = dict(input="Name three colours.", max_output_tokens=8, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    for event in events:
        strictly(ResponseStreamEvent, event)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert len({e.item_id for e in deltas} | {events[-2].item.id}) == 1


def check_calls(response, tools: list[dict]) -> list:
    assert response.status == "completed", response.output
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.output_text == ""
    schemas = {tool["name"]: tool["parameters"] for tool in tools}
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    return calls


def test_required_and_named_tool_choice_call_valid_functions(client, weather_call):
    check_calls(weather_call, [WEATHER])
    assert weather_call.tool_choice == "required" and weather_call.tools[0].name == "get_weather"
    named = client.responses.create(
        input=ASK,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=40,
        **GREEDY,
    )
    assert {call.name for call in check_calls(named, [WEATHER, ADD])} == {"add"}
    assert named.tool_choice.name == "add"


def test_streamed_function_call_events(client, weather_call):
    with client.responses.stream(**CALL_WEATHER) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:
        strictly(ResponseStreamEvent, event)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (call,) = [item for item in final.output if item.type == "function_call"]
    (expected,) = [item for item in weather_call.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (expected.name, expected.arguments)
    assert events[-3].arguments == call.arguments


def test_function_call_output_round_trip(client, weather_call):
    """A tool's result goes back as a function_call_output item: the prompt is the one the
    chat endpoint renders for the same turns, stateless or continued by id."""
    first = weather_call
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    stateless = client.responses.create(
        input=[{"role": "user", "content": ASK}, *as_input(first.output), result],
        tools=[WEATHER],
        max_output_tokens=6,
        **GREEDY,
    )
    continued = client.responses.create(
        input=[result], previous_response_id=first.id, tools=[WEATHER], max_output_tokens=6, **GREEDY
    )
    chat = client.chat.completions.create(
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]},
        ],
        tools=[
            {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
        ],
        max_tokens=6,
        **GREEDY,
    )
    for response in (stateless, continued):
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.output_text == (chat.choices[0].message.content or "")


def test_json_schema_text_format(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=40,
        **GREEDY,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(input="My name is Ada.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    stateless = client.responses.create(
        input=[
            {"role": "user", "content": "My name is Ada."},
            *as_input(first.output),
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is my name?"}],
            },
        ],
        max_output_tokens=6,
        **GREEDY,
    )
    alone = client.responses.create(input="What is my name?", max_output_tokens=6, **GREEDY)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == stateless.usage.input_tokens > alone.usage.input_tokens
    assert second.output_text == stateless.output_text
    third = client.responses.create(
        input="Thanks.", previous_response_id=second.id, max_output_tokens=2, **GREEDY
    )
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    fetched = client.responses.retrieve(first.id)
    assert (fetched.id, fetched.output_text, fetched.status) == (first.id, first.output_text, first.status)


def test_unknown_or_unstored_previous_response_is_404(client):
    unstored = client.responses.create(input="Hi", store=False, max_output_tokens=2, **GREEDY)
    for response_id in ("resp_does_not_exist", unstored.id):
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.create(input="Hi", previous_response_id=response_id, max_output_tokens=2)
        assert error.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)


@pytest.mark.parametrize(
    "bad",
    [
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": [{"role": "tool", "content": "hi"}]},
        {"input": "Hi", "tools": [{"type": "web_search"}]},
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
        {"input": "Hi", "tool_choice": {"type": "function", "name": "missing"}, "tools": [ADD]},
        {"input": []},
    ],
)
def test_bad_requests_are_400(client, bad):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, max_output_tokens=2, **bad)
    assert error.value.body["message"]


def test_store_evicts_the_oldest_past_its_count_and_age():
    now = [0.0]
    store = ResponseStore(max_responses=2, max_age_s=10, clock=lambda: now[0])
    for i in range(3):
        now[0] = i
        store.put(f"resp_{i}", {"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert store.get("resp_0") is None and len(store) == 2
    assert store.get("resp_1").messages == [{"role": "user", "content": "1"}]
    now[0] = 11.5  # resp_1, stored at 1, is past 10 s; resp_2, stored at 2, is not
    assert store.get("resp_1") is None and store.get("resp_2") is not None
    now[0] = 12.0
    assert len(store) == 0
