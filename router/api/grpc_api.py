"""The gRPC API (router/api/protos/kvserve.proto), served by Ray Serve's gRPC proxy from the
same ingress deployment as HTTP. Requests become the HTTP API's pydantic models and go
through the same front end (router/api/frontend.py), so both APIs accept, default and
refuse exactly the same things; errors map onto gRPC status codes with the same
messages."""

import json
from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError
from ray.serve.grpc_util import RayServegRPCContext

from router.api.frontend import Choice, ChoiceDelta, Choices, EngineInput, FrontEnd
from router.api.protocol import ChatCompletionRequest, CompletionRequest, main_error
from router.api.protos import kvserve_pb2 as pb
from router.generation import APIError, Generation
from wire.messages import LogprobEntry

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "speculative",
)


def sampling_fields(params: pb.SamplingParams) -> dict:
    """The fields the client set, named as in the HTTP API (logprobs aside)."""
    fields = {name: getattr(params, name) for name in OPTIONAL_FIELDS if params.HasField(name)}
    fields.update(stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
    fields["ignore_eos"] = params.ignore_eos
    if params.logit_bias:
        fields["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.HasField("response_format"):
        fields.update(_response_format(params.response_format))
    if params.HasField("prompt_logprobs"):
        fields["prompt_logprobs"] = params.prompt_logprobs
    return fields


def _response_format(response_format: pb.ResponseFormat) -> dict:
    """As the HTTP API's response_format, or vLLM's guided_* fields."""
    kind = response_format.WhichOneof("format")
    if kind == "json_schema":
        try:
            schema = json.loads(response_format.json_schema)
        except ValueError:
            raise APIError(400, "response_format.json_schema is not valid JSON") from None
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
        }
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "regex":
        return {"guided_regex": response_format.regex}
    if kind == "choice":
        return {"guided_choice": list(response_format.choice.choices)}
    if kind == "grammar":
        return {"guided_grammar": response_format.grammar}
    return {}


def completion_body(request: pb.GenerateRequest) -> CompletionRequest:
    prompt = request.prompt if request.WhichOneof("input") == "prompt" else list(request.prompt_token_ids.ids)
    fields = sampling_fields(request.params)
    if request.params.HasField("logprobs"):
        fields["logprobs"] = request.params.logprobs
    fields["priority"] = request.priority
    return CompletionRequest.model_validate({"model": request.model, "prompt": prompt, **fields})


def chat_body(request: pb.ChatRequest) -> ChatCompletionRequest:
    fields = sampling_fields(request.params)
    if request.params.HasField("logprobs"):
        fields.update(logprobs=True, top_logprobs=request.params.logprobs)
    messages = [_message(m) for m in request.messages]
    if request.tools:
        fields["tools"] = [_tool(t) for t in request.tools]
    if request.tool_choice in ("none", "auto", "required"):
        fields["tool_choice"] = request.tool_choice
    elif request.tool_choice:
        fields["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice}}
    fields["priority"] = request.priority
    return ChatCompletionRequest.model_validate({"model": request.model, "messages": messages, **fields})


def _message(m: pb.ChatMessage) -> dict:
    message = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
        message.update(tool_calls=calls, content=m.content or None)
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


def _tool(tool: pb.Tool) -> dict:
    try:
        parameters = json.loads(tool.parameters) if tool.parameters else None
    except ValueError:
        raise APIError(400, f"tool {tool.name!r}: parameters is not valid JSON") from None
    function = {"name": tool.name, "description": tool.description or None, "parameters": parameters}
    return {"type": "function", "function": function}


def validation_message(e: ValidationError) -> str:
    first = main_error(e.errors())
    where = ".".join(str(p) for p in first.get("loc", ())) or "request"
    return f"{where}: {first.get('msg', 'invalid value')}"


class GrpcAPI:
    """The RPCs over the front end. The ingress deployment (router/api/http.py) has a
    method per RPC name, which Serve's gRPC proxy calls, and each calls one of these."""

    def __init__(self, frontend: FrontEnd):
        self.frontend = frontend

    async def list_models(self, grpc_context: RayServegRPCContext) -> pb.ListModelsResponse:
        """The base model, then its LoRA adapters, which requests name as their model."""
        if not self._authorized(grpc_context):
            return pb.ListModelsResponse()
        names = [self.frontend.model_name] + [lora.lora_name for lora in await self.frontend.adapters.all()]
        return pb.ListModelsResponse(models=[pb.Model(id=name, owned_by="kvserve") for name in names])

    async def unary(self, request, grpc_context: RayServegRPCContext, chat: bool) -> pb.GenerateResponse:
        """Generate and Chat: the whole answer."""
        started = await self._start(request, grpc_context, chat)
        if started is None:
            return pb.GenerateResponse()
        generation, choices = started
        try:
            async for chunk in generation.chunks():
                choices.add(chunk)
        except APIError as e:
            return _fail(grpc_context, e)
        finally:
            generation.cancel()
        result = [_choice(c) for c in choices.result()]
        first = result[0]
        return pb.GenerateResponse(
            id=generation.first.request_id,
            model=self.frontend.response_model(choices.input),
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            logprobs=first.logprobs,
            usage=pb.Usage(**choices.usage()),
            tool_calls=first.tool_calls,
            choices=result,
            prompt_logprobs=_prompt_logprobs(
                choices.prompt_logprobs if choices.input.prompt_logprobs_wanted else None
            ),
        )

    async def stream(self, request, grpc_context: RayServegRPCContext, chat: bool) -> AsyncIterator:
        """GenerateStream and ChatStream: a response per chunk, usage on the last."""
        # A stream that merely ends ends with OK, whatever the context says; raising
        # after setting the code is what makes Serve's proxy send the status.
        started = await self._start(request, grpc_context, chat)
        if started is None:
            raise StreamError(grpc_context.details())
        generation, choices = started
        unfinished = len(choices.samples)
        model = self.frontend.response_model(choices.input)
        try:
            async for chunk in generation.chunks():
                delta = choices.add(chunk)
                unfinished -= chunk.finished
                response = self._delta_response(generation.first.request_id, model, delta)
                if not unfinished:
                    response.usage.CopyFrom(pb.Usage(**choices.usage()))
                yield response
        except APIError as e:
            _fail(grpc_context, e)
            raise StreamError(e.message) from None
        finally:  # also when the client cancels: the replica aborts the request
            generation.cancel()

    async def _start(
        self, request, grpc_context: RayServegRPCContext, chat: bool
    ) -> tuple[Generation, Choices] | None:
        """The started generation, or None with the error status set on the context."""
        if not self._authorized(grpc_context):
            return None
        frontend = self.frontend
        try:
            engine_input: EngineInput
            if chat:
                engine_input = await frontend.chat_input(chat_body(request))
            else:
                engine_input = await frontend.completion_input(completion_body(request))
            return await frontend.start(engine_input), Choices(engine_input)
        except ValidationError as e:
            _fail(grpc_context, APIError(400, validation_message(e)))
        except APIError as e:
            _fail(grpc_context, e)
        return None

    def _authorized(self, grpc_context: RayServegRPCContext) -> bool:
        metadata = dict(grpc_context.invocation_metadata())
        try:
            self.frontend.check_auth(metadata.get("authorization"))
        except APIError as e:
            _fail(grpc_context, e)
            return False
        return True

    def _delta_response(self, request_id: str, model: str, delta: ChoiceDelta) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            id=request_id,
            model=model,
            text=delta.text,
            token_ids=delta.token_ids,
            finish_reason=delta.finish_reason or "",
            logprobs=_logprobs(delta.logprobs),
            index=delta.index,
            tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in delta.calls],
            prompt_logprobs=_prompt_logprobs(delta.prompt_logprobs),
        )


def _choice(choice: Choice) -> pb.Choice:
    return pb.Choice(
        index=choice.index,
        text=choice.text,
        token_ids=choice.token_ids,
        finish_reason=choice.finish_reason or "",
        logprobs=_logprobs(choice.logprobs),
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in choice.calls],
    )


def _logprobs(entries: list[LogprobEntry] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            token=e.token,
            logprob=e.logprob,
            top_logprobs=[pb.TopLogprob(token=t.token, logprob=t.logprob) for t in e.top_logprobs],
            rank=e.rank or 0,  # proto has no null: 0 where the entry has no rank
        )
        for e in entries or ()
    ]


def _prompt_logprobs(entries: list[LogprobEntry | None] | None) -> list[pb.TokenLogprob]:
    """The entries after the first prompt token's, which has none (proto has no null)."""
    return _logprobs(entries[1:] if entries else None)


class StreamError(Exception):
    """Ends a stream with the status code already set on its gRPC context."""


def _fail(grpc_context: RayServegRPCContext, e: APIError):
    grpc_context.set_code(STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL))
    grpc_context.set_details(e.message)
    return pb.GenerateResponse()
