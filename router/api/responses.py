"""OpenAI's Responses API (`POST /v1/responses`), stateless core plus a small store,
as vLLM serves it.

A Responses request is translated into the chat request kvserve already serves
(router/api/protocol.py's ChatCompletionRequest), so templating, tool calls, structured
outputs and sampling limits are the chat endpoint's, not a second copy. The replica's
chunks go through the same Choices as chat does, and router/api/responses_renderer.py
turns them into output items and, for streams, the Responses event sequence.
`previous_response_id` continues a conversation kept in router/api/response_store.py."""

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from router.api.protocol import ChatCompletionRequest, Integer, Number, main_error
from router.api.response_store import ResponseStore
from router.generation import APIError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The fields kvserve acts on. Items, tools and tool_choice stay loose here and are
    checked by hand below, so an image part or a web_search tool gets a 400 that names
    it rather than pydantic's account of every union branch that did not match."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Integer | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    parallel_tool_calls: bool | None = None
    speculative: StrictBool | None = None  # kvserve's, as on /v1/chat/completions: false opts out
    # Refused with a 400 when set: kvserve has no background jobs or server-side
    # conversations or prompt templates, and silently ignoring them would mislead.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


@dataclass
class Turn:
    """One request, translated: the chat request to run and what the answer echoes."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    history: list[dict]  # chat messages before this response, instructions left out
    tools: list[dict]  # as the response echoes them (the flat Responses form)


def prepare(body: ResponsesRequest, store: ResponseStore) -> Turn:
    """The chat request for `body`, after the stored conversation it continues."""
    for name in ("conversation", "prompt"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} is not supported; continue with previous_response_id", name)
    if body.background:
        raise APIError(400, "background responses are not supported", "background")
    history: list[dict] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"previous response with id {body.previous_response_id!r} not found (kvserve keeps "
                "responses in one ingress replica's memory for a limited time)",
                "previous_response_id",
                "not_found_error",
            )
        history = list(stored.messages)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    history += items_to_messages(items, "input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if not history:
        raise APIError(400, "input must hold at least one item", "input")
    tools = [_function_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools or ())]
    chat = {
        "model": body.model,
        "messages": system + history,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "user": body.user,
        "tools": [
            {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
            for t in tools
        ]
        or None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "speculative": body.speculative,
    }
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        first = main_error(list(e.errors()))
        raise APIError(400, f"{first.get('msg', 'invalid request')}") from None
    return Turn(body, request, history, tools)


def items_to_messages(items: list[dict], where: str) -> list[dict]:
    """Responses input items as chat messages. A function_call joins the assistant turn
    just before it, as the model wrote text and calls in one turn; output items passed
    back as input therefore render as the model produced them."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(
                    400, f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{at}.role"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{at}.{key} must be a string", f"{at}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{at}.call_id must be a string", f"{at}.call_id")
            output = _text(item.get("output"), f"{at}.output")
            messages.append({"role": "tool", "content": output, "tool_call_id": item["call_id"]})
        else:
            raise APIError(
                400,
                f"{at}: input items of type {kind!r} are not supported; kvserve takes message, "
                "function_call and function_call_output items",
                f"{at}.type",
            )
    return messages


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at} must be a string or a list of text parts", at)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{at}[{i}]: only text content parts (input_text, output_text) are supported, "
                f"got type {kind!r}",
                f"{at}[{i}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _function_tool(tool: dict, at: str) -> dict:
    if tool.get("type") != "function":
        raise APIError(
            400,
            f"{at}: tools of type {tool.get('type')!r} are not supported; only function tools are",
            f"{at}.type",
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f"{at}.name must be a non-empty string", f"{at}.name")
    if not isinstance(tool.get("parameters"), dict | None):
        raise APIError(400, f"{at}.parameters must be a JSON schema object", f"{at}.parameters")
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    """Responses' tool_choice in chat's form: {"type": "function", "name"} becomes
    {"type": "function", "function": {"name"}}."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: TextConfig | None) -> dict | None:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    schema = {
        "name": form.name,
        "description": form.description,
        "schema": form.schema_,
        "strict": form.strict,
    }
    return {"type": "json_schema", "json_schema": schema}


def stored(store: ResponseStore, response_id: str) -> dict:
    """GET /v1/responses/{id}: the stored Response, or a 404."""
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"response with id {response_id!r} not found", "response_id", "not_found_error")
    return entry.response
