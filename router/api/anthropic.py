"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as
llama.cpp and vLLM serve it, so that Claude-Code-style agents can use kvserve.

A Messages request is translated into the OpenAI `ChatCompletionRequest` that the front
end (router/api/frontend.py) already turns into engine input: system text becomes a system
message, `tool_use` blocks become assistant tool calls, `tool_result` blocks become tool
messages, and tools and tool_choice map onto OpenAI functions. One template, one
tokenizer path and one tool-call grammar therefore serve both APIs. MessagesRenderer
then renders the front end's choices as Anthropic's message object or its event stream
(router/api/respond.py sends them)."""

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from router.api.frontend import Choice, Choices
from router.api.protocol import ChatCompletionRequest, Integer, Number, main_error
from router.api.tool_calls import ParsedCall
from router.generation import APIError
from wire.messages import StreamChunk

MESSAGE_ROOT = "/v1/messages"

# Anthropic's error types by HTTP status; the status itself stays what kvserve answers.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class TextBlockParam(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: accepted, not used

    type: Literal["text"]
    text: str


class ToolUseBlockParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] = ""
    is_error: bool | None = None  # the text says what failed; templates have no flag for it

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam, Field(discriminator="type")
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "MessageParam":
        # As in Anthropic's API: the assistant calls tools, the user answers them.
        wrong = "tool_result" if self.role == "assistant" else "tool_use"
        if isinstance(self.content, list) and any(b.type == wrong for b in self.content):
            raise ValueError(f"{wrong} blocks are not allowed in {self.role} messages")
        return self


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, ...) are Anthropic's own


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> "ToolChoiceParam":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice needs a name exactly when its type is "tool"')
        return self


class CountTokensRequest(BaseModel):
    """What a prompt is made of; /v1/messages/count_tokens takes just this."""

    model_config = ConfigDict(extra="ignore")  # thinking, service_tier, ...: accepted, not used

    model: str | None = None  # absent or empty: the served model, as in vLLM
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ToolParam] | None) -> list[ToolParam] | None:
        names = [t.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return tools


class MessagesRequest(CountTokensRequest):
    max_tokens: Integer  # required, as Anthropic requires it
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Integer | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # accepted, as Anthropic's; not used
    speculative: StrictBool | None = None  # kvserve's, as on /v1/chat/completions: false opts out


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, which every 4xx and 5xx answer on these routes carries."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "a message, or its events with stream"},
    **{
        status: {"model": AnthropicErrorResponse, "description": kind.replace("_", " ")}
        for status, kind in _ERROR_TYPES.items()
        if status != 403
    },
}


def is_messages_path(path: str) -> bool:
    """The app is mounted under a route prefix (/myapp/v1/messages), so the end decides;
    paths below /v1/messages that kvserve lacks (batches) answer in Anthropic's shape too."""
    return path.rstrip("/").endswith(MESSAGE_ROOT) or f"{MESSAGE_ROOT}/" in path


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI chat request that the front end turns into engine input."""
    messages: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages += _chat_messages(message)
    payload: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        payload["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": choice.name}}
        payload["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}.get(choice.type, named)
        # One call unless the client allows several: small models repeat calls otherwise.
        payload["parallel_tool_calls"] = choice.disable_parallel_tool_use is False
    if isinstance(body, MessagesRequest):
        payload.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            stream=body.stream,
            speculative=body.speculative,
        )
    try:
        return ChatCompletionRequest.model_validate(payload)
    except ValidationError as e:
        first = main_error(list(e.errors()))
        raise APIError(400, first.get("msg", "invalid request")) from None


def _chat_messages(message: MessageParam) -> list[dict]:
    """One Anthropic turn as chat messages: a user turn's tool results come first, as
    the tool messages they are in OpenAI's shape, then its text as a user message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(b.text for b in message.content if b.type == "text")
    if message.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in message.content
            if b.type == "tool_use"
        ]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    results = [
        {"role": "tool", "content": b.text, "tool_call_id": b.tool_use_id}
        for b in message.content
        if b.type == "tool_result"
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _tool_use(call: ParsedCall) -> dict:
    """A parsed call as a tool_use block; its id follows from the call's, so the
    streamed and whole renderings agree."""
    value = json.loads(call.arguments)
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": value if isinstance(value, dict) else {"arguments": value},  # input is an object
    }


class MessagesRenderer:
    """One Messages answer, whole or as Anthropic's event stream, built from the front
    end's choices (one sample: Anthropic has no n). `decode` turns output ids into text
    off the event loop; it finds which stop sequence ended the text, which the engine cuts
    off without naming."""

    named_events = True
    ends_with_done = False

    def __init__(
        self,
        model: str,
        choices: Choices,
        stop_sequences: list[str] | None,
        decode: Callable[[list[int]], Awaitable[str]],
    ):
        self.id = "msg_" + uuid.uuid4().hex
        self.model, self.choices, self.decode = model, choices, decode
        self.stop_sequences = stop_sequences or []
        self.blocks = _Blocks()

    @property
    def sample(self) -> Choice:
        return self.choices.samples[0]

    async def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). A stop string that matched is still in the
        decoded output ids; the earliest one is the one the engine stopped at."""
        reason = self.sample.finish_reason
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        if reason == "stop" and self.stop_sequences:
            text = await self.decode(self.sample.token_ids)
            found = [(p, s) for s in self.stop_sequences if (p := text.find(s)) >= 0]
            if found:
                return "stop_sequence", min(found)[1]
        return "end_turn", None

    def usage(self) -> dict:
        usage = self.choices.usage()
        return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def add(self, chunk: StreamChunk) -> None:
        self.choices.add(chunk)

    async def whole(self) -> dict:
        """The whole message. Whitespace around tool calls is no text block, as when
        streamed; an answer with neither text nor calls has one empty text block."""
        calls = [_tool_use(call) for call in self.sample.calls]
        text = self.sample.text
        content = [] if calls and not text.strip() else [{"type": "text", "text": text}]
        return self._message(content + calls, await self.stop(), self.usage())

    def opening(self) -> list[dict]:
        usage = {"input_tokens": len(self.choices.input.request.prompt), "output_tokens": 0}
        return [
            {"type": "message_start", "message": self._message([], (None, None), usage)},
            {"type": "ping"},
        ]

    def feed(self, chunk: StreamChunk) -> list[dict]:
        delta = self.choices.add(chunk)
        return self.blocks.text(delta.text) + self.blocks.calls(delta.calls)

    def fail(self, error: APIError) -> list[dict]:
        return [error_body(error.status, error.message)]

    async def closing(self) -> list[dict]:
        events = self.blocks.finish()
        reason, sequence = await self.stop()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return events + [
            {"type": "message_delta", "delta": delta, "usage": self.usage()},
            {"type": "message_stop"},
        ]


class _Blocks:
    """Turns text and tool-call deltas into content block events. Whitespace-only text
    is held until something else follows it, so whitespace around tool calls makes no
    block, as in the whole message."""

    def __init__(self):
        self.index = -1
        self.text_open = False
        self.pending = ""

    def _start(self, block: dict) -> list[dict]:
        self.index += 1
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _close(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        return [{"type": "content_block_stop", "index": self.index}]

    def _text_delta(self, text: str) -> dict:
        return {
            "type": "content_block_delta",
            "index": self.index,
            "delta": {"type": "text_delta", "text": text},
        }

    def text(self, text: str) -> list[dict]:
        events: list[dict] = []
        if not self.text_open:
            self.pending += text
            if not self.pending.strip():
                return []
            text, self.pending = self.pending, ""
            events = self._start({"type": "text", "text": ""})
            self.text_open = True
        if text:
            events.append(self._text_delta(text))
        return events

    def calls(self, calls: list[ParsedCall]) -> list[dict]:
        events: list[dict] = []
        for call in calls:
            block = _tool_use(call)
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events += self._close() + self._start({**block, "input": {}})
            events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
            events.append({"type": "content_block_stop", "index": self.index})
            self.pending = ""
        return events

    def finish(self) -> list[dict]:
        """Closes the open block; with no block at all, the text there is (maybe none)."""
        if self.index < 0:
            self.text_open = True
            events = self._start({"type": "text", "text": ""})
            if self.pending:
                events.append(self._text_delta(self.pending))
            return events + self._close()
        return self._close()
