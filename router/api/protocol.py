"""OpenAI request schemas (pydantic), as the SDKs and agent frameworks send them.

These models only check shapes. An explicit null means "the default", as in OpenAI's
API. Value limits (temperature, top_p, n, ...) live in one place, SamplingParams, which
the front end (router/api/frontend.py) builds from `sampling_fields()` for HTTP and gRPC."""

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)


def _not_a_boolean(value: Any) -> Any:
    """JSON's true and false are not numbers, though pydantic's lax mode reads them as 1 and 0."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


Number = Annotated[float, BeforeValidator(_not_a_boolean)]
Integer = Annotated[int, BeforeValidator(_not_a_boolean)]
TokenId = Annotated[Integer, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        return self


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only on an assistant turn with tool_calls")
        return self

    def template_message(self) -> dict:
        """The message as chat templates read it: content as one string, tool calls
        with their arguments as objects (Hermes, Qwen and Llama templates use them so)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    class Function(BaseModel):
        name: str

    type: Literal["function"]
    function: Function


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # absent or empty: the served model, as in vLLM
    max_tokens: Integer | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: Integer | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Integer | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None  # accepted, as OpenAI's; not used
    # Beyond OpenAI, as in vLLM:
    top_k: Integer | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: each prompt token's logprob and top-n alternatives, returned as a
    # top-level `prompt_logprobs` list (None first, then token id -> logprob, rank, token).
    prompt_logprobs: Integer | None = None
    # With the server's --speculative-config, false opts this request out of speculation.
    # Strict: a lax bool would read "no" or 0 as false; anything but a boolean is a 400.
    speculative: StrictBool | None = None
    # Under --scheduling-policy priority, lower values are served first; not a sampling field.
    priority: Integer | None = None

    def sampling_fields(self) -> dict:
        """The SamplingParams fields the client set (nulls left out), except max_tokens,
        logprobs and structured outputs, which depend on the endpoint."""
        fields = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "stop_token_ids",
                "ignore_eos",
                "logit_bias",
                "stop",
                "speculative",
            )
            if getattr(self, name) is not None
        }
        if self.n is not None:
            fields["n"] = self.n
        return fields

    def guided(self) -> dict | None:
        """vLLM's guided_* extensions, as StructuredOutputs fields."""
        given = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise ValueError("give at most one of guided_json, guided_regex, guided_choice, guided_grammar")
        if isinstance(given.get("json"), str):
            given["json"] = _json_or_text(given["json"])
        return given or None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    # One prompt, or as OpenAI and vLLM take them a batch of prompts, whose choices come
    # in prompt order. A batch of one is one prompt (lm-eval's local-completions sends [[ids]]).
    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Integer | None = None
    echo: bool | None = False
    best_of: Integer | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _batch_of_one(self) -> "CompletionRequest":
        if self.is_batch and len(self.prompt) == 1:
            self.prompt = self.prompt[0]
        return self

    @property
    def is_batch(self) -> bool:
        return isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)

    def batch(self) -> list["CompletionRequest"]:
        """Each prompt of a batch as a request of its own."""
        return [self.model_copy(update={"prompt": p}) for p in self.prompt] if self.is_batch else [self]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = None
    logprobs: bool | None = False
    top_logprobs: Integer | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; several calls are always allowed

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        return tools

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only, as in vLLM
    add_generation_prompt: bool = True  # messages only

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter: an adapter's PEFT folder, served as `lora_name`."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter (its optional lora_int_id is not needed here)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every 4xx and 5xx answer carries."""

    error: ErrorDetail


def main_error(errors: list[dict]) -> dict:
    """The error to report among pydantic's: our own checks' messages ("only text
    content parts are supported") say more than a union's other branches ("Input
    should be a valid string")."""
    ours = [e for e in errors if e.get("type") == "value_error"]
    return (ours or errors or [{}])[0]


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
