"""OpenAI's Responses API (`POST /v1/responses`), stateless core plus a small store,
as vLLM serves it.

A Responses request is translated into the chat request kvserve already serves
(router/api/protocol.py's ChatCompletionRequest), so templating, tool calls, structured
outputs and sampling limits are the chat endpoint's, not a second copy. The replica's
chunks go through the same Choices as chat does; ResponseBuilder turns them into
output items and, for streams, the Responses event sequence. The non-streamed answer
is built by the same builder with its events dropped, so both paths agree exactly.
`previous_response_id` continues a conversation kept in router/api/response_store.py."""

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from router.api.frontend import Choices
from router.api.protocol import ChatCompletionRequest, main_error
from router.api.response_store import ResponseStore
from router.api.tool_calls import ParsedCall
from router.generation import APIError, Generation
from wire.messages import StreamChunk

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
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
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


class ResponseBuilder:
    """Builds a Response from the replica's chunks, item by item, and says each step as
    Responses stream events. Text opens a message item, and each tool call closes it and
    adds a function_call item; whitespace-only text next to calls (the newlines around
    `<tool_call>` blocks) opens no item of its own."""

    def __init__(self, turn: Turn, model: str, choices: Choices):
        self.turn, self.model, self.choices = turn, model, choices
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.status = "in_progress"
        self.output: list[dict] = []
        self.error: dict | None = None
        self._message: dict | None = None  # the message item text goes to
        self._pending = ""  # whitespace not yet placed in an item
        self._sequence = 0

    def start(self) -> list[dict]:
        return [self._event("response.created"), self._event("response.in_progress")]

    def feed(self, chunk: StreamChunk) -> list[dict]:
        delta = self.choices.add(chunk)
        events = self._add_text(delta.text) if delta.text else []
        for call in delta.calls:
            events += self._close_message() + self._add_call(call)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    def fail(self, error: APIError) -> list[dict]:
        self.status = "failed"
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.error = {"code": code, "message": error.message}
        alert = self._event("error", code=error.kind, message=error.message, param=error.param)
        return [alert, self._event("response.failed")]

    def response(self) -> dict:
        """The Response object as it stands."""
        body = self.turn.body
        form = body.text.format if body.text is not None and body.text.format is not None else None
        text_format = form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}
        usage = None
        if self.status != "in_progress":
            used = self.choices.usage()
            usage = {
                "input_tokens": used["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": used["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": used["total_tokens"],
            }
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        choice = body.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "name": choice["name"]}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "incomplete_details": incomplete,
            "error": self.error,
            "model": self.model,
            "output": copy.deepcopy(self.output),
            "usage": usage,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tools": self.turn.tools,
            "tool_choice": choice or "auto",
            "text": {"format": text_format},
            "previous_response_id": body.previous_response_id,
            "store": body.store is not False,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "metadata": body.metadata or {},
            "user": body.user,
        }

    def conversation(self) -> list[dict]:
        """The chat messages after this response, for a follow-up to continue."""
        return self.turn.history + items_to_messages(self.output, "output")

    def _event(self, kind: str, **fields) -> dict:
        if kind.startswith("response.") and not fields:
            fields = {"response": self.response()}
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def _add_text(self, text: str, force: bool = False) -> list[dict]:
        """force: open a message even for whitespace, which then is the whole answer."""
        events = []
        if self._message is None:
            self._pending += text
            if not self._pending.strip() and not force:
                return []
            text, self._pending = self._pending, ""
            events = self._open_message()
            if not text:
                return events
        part = self._message["content"][0]
        part["text"] += text
        where = {"item_id": self._message["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return events + [self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict]:
        item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        self.output.append(item)
        self._message = item
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return [
            self._event(
                "response.output_item.added", output_index=where["output_index"], item={**item, "content": []}
            ),
            self._event("response.content_part.added", **where, content_index=0, part=part),
        ]

    def _close_message(self, status: str = "completed") -> list[dict]:
        item, self._message, self._pending = self._message, None, ""
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        return [
            self._event(
                "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
            ),
            self._event("response.content_part.done", **where, content_index=0, part=part),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _add_call(self, call: ParsedCall) -> list[dict]:
        item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}  # fmt: skip
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = [self._event("response.output_item.added", output_index=where["output_index"], item=item)]
        item["arguments"], item["status"] = call.arguments, "completed"
        return events + [
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, arguments=call.arguments),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _finish(self, finish_reason: str) -> list[dict]:
        cut = finish_reason == "length"
        events = []
        if not self.output:  # no text and no call: still one (perhaps empty) message
            events += self._add_text("", force=True)
        events += self._close_message("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        return events + [self._event("response.incomplete" if cut else "response.completed")]


def _store(builder: ResponseBuilder, store: ResponseStore) -> None:
    if builder.turn.body.store is not False and builder.status in ("completed", "incomplete"):
        store.put(builder.id, builder.response(), builder.conversation())


async def collect(builder: ResponseBuilder, generation: Generation, store: ResponseStore) -> dict:
    """The whole Response, not streamed; a failure is an HTTP error, as for chat."""
    try:
        async for chunk in generation.chunks():
            builder.feed(chunk)
    finally:
        generation.cancel()
    _store(builder, store)
    return builder.response()


async def sse(builder: ResponseBuilder, generation: Generation, store: ResponseStore) -> AsyncIterator[str]:
    """The Responses event stream. The status line is long gone when a replica fails
    mid-stream, so the failure arrives as an `error` event and `response.failed`.
    Closing early (client gone) cancels the replica stream."""
    try:
        for event in builder.start():
            yield _sse_event(event)
        try:
            async for chunk in generation.chunks():
                for event in builder.feed(chunk):
                    yield _sse_event(event)
        except APIError as e:
            for event in builder.fail(e):
                yield _sse_event(event)
        else:
            _store(builder, store)
    finally:
        generation.cancel()


def _sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def stored(store: ResponseStore, response_id: str) -> dict:
    """GET /v1/responses/{id}: the stored Response, or a 404."""
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"response with id {response_id!r} not found", "response_id", "not_found_error")
    return entry.response
