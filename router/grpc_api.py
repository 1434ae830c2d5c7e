"""The gRPC API (router/protos/kvserve.proto), served by Ray Serve's gRPC proxy from the
same ingress deployment as HTTP. Requests go through the HTTP API's pydantic models,
so both APIs accept, default and refuse exactly the same things; errors map onto gRPC
status codes with the same messages."""

from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError
from ray.serve.grpc_util import RayServegRPCContext

from router.generation import APIError, Generation
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.protos import kvserve_pb2 as pb

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
)


def sampling_fields(params: pb.SamplingParams) -> dict:
    """The fields the client set, named as in the HTTP API (logprobs aside)."""
    fields = {name: getattr(params, name) for name in OPTIONAL_FIELDS if params.HasField(name)}
    fields.update(stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
    fields["ignore_eos"] = params.ignore_eos
    return fields


def completion_body(request: pb.GenerateRequest) -> CompletionRequest:
    prompt = request.prompt if request.WhichOneof("input") == "prompt" else list(request.prompt_token_ids.ids)
    fields = sampling_fields(request.params)
    if request.params.HasField("logprobs"):
        fields["logprobs"] = request.params.logprobs
    return CompletionRequest.model_validate({"model": request.model, "prompt": prompt, **fields})


def chat_body(request: pb.ChatRequest) -> ChatCompletionRequest:
    fields = sampling_fields(request.params)
    if request.params.HasField("logprobs"):
        fields.update(logprobs=True, top_logprobs=request.params.logprobs)
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    return ChatCompletionRequest.model_validate({"model": request.model, "messages": messages, **fields})


def validation_message(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "request"
    return f"{where}: {first.get('msg', 'invalid value')}"


class GrpcAPI:
    """Mixed into the ingress deployment; Serve's gRPC proxy calls these methods by
    RPC name. Uses the ingress's `model_name`, `tokenizer`, `_check_auth`,
    `_completion_input`, `_chat_input` and `_start`."""

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext):
        if not self._grpc_authorized(grpc_context):
            return pb.ListModelsResponse()
        return pb.ListModelsResponse(models=[pb.Model(id=self.model_name, owned_by="kvserve")])

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        return await self._unary(request, grpc_context, chat=False)

    async def Chat(self, request: pb.ChatRequest, grpc_context: RayServegRPCContext):
        return await self._unary(request, grpc_context, chat=True)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        async for response in self._stream(request, grpc_context, chat=False):
            yield response

    async def ChatStream(self, request: pb.ChatRequest, grpc_context: RayServegRPCContext):
        async for response in self._stream(request, grpc_context, chat=True):
            yield response

    async def _unary(self, request, grpc_context: RayServegRPCContext, chat: bool) -> pb.GenerateResponse:
        generation = await self._grpc_start(request, grpc_context, chat)
        if generation is None:
            return pb.GenerateResponse()
        try:
            chunks = [chunk async for chunk in generation.chunks()]
        except APIError as e:
            return _fail(grpc_context, e)
        finally:
            generation.cancel()
        return self._response(generation.first, chunks)

    async def _stream(self, request, grpc_context: RayServegRPCContext, chat: bool) -> AsyncIterator:
        # A stream that merely ends ends with OK, whatever the context says; raising
        # after setting the code is what makes Serve's proxy send the status.
        generation = await self._grpc_start(request, grpc_context, chat)
        if generation is None:
            raise StreamError(grpc_context.details())
        try:
            async for chunk in generation.chunks():
                yield self._response(generation.first, [chunk])
        except APIError as e:
            _fail(grpc_context, e)
            raise StreamError(e.message) from None
        finally:  # also when the client cancels: the replica aborts the request
            generation.cancel()

    async def _grpc_start(self, request, grpc_context: RayServegRPCContext, chat: bool) -> Generation | None:
        """The started generation, or None with the error status set on the context."""
        if not self._grpc_authorized(grpc_context):
            return None
        try:
            if chat:
                prompt, params = await self._chat_input(chat_body(request))
            else:
                prompt, params = await self._completion_input(completion_body(request))
            return await self._start(prompt, params)
        except ValidationError as e:
            _fail(grpc_context, APIError(400, validation_message(e)))
        except APIError as e:
            _fail(grpc_context, e)
        return None

    def _grpc_authorized(self, grpc_context: RayServegRPCContext) -> bool:
        metadata = dict(grpc_context.invocation_metadata())
        try:
            self._check_auth(metadata.get("authorization"))
        except APIError as e:
            _fail(grpc_context, e)
            return False
        return True

    def _response(self, first: dict, chunks: list[dict]) -> pb.GenerateResponse:
        last = chunks[-1]
        response = pb.GenerateResponse(
            id=first["request_id"],
            model=self.model_name,
            text="".join(c["text"] for c in chunks),
            token_ids=[t for c in chunks for t in c["token_ids"]],
            finish_reason=last["finish_reason"] or "",
        )
        tokens = self.tokenizer.convert_ids_to_tokens
        for c in chunks:
            for entry in c["logprobs"] or ():
                response.logprobs.append(
                    pb.TokenLogprob(
                        token_id=entry["token_id"],
                        token=tokens(entry["token_id"]),
                        logprob=entry["logprob"],
                        top_logprobs=[
                            pb.TopLogprob(token=tokens(t), logprob=v)
                            for t, v in entry["top_logprobs"].items()
                        ],
                    )
                )
        if last["finished"]:
            prompt, completion = last["num_prompt_tokens"], last["num_output_tokens"]
            response.usage.CopyFrom(
                pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            )
        return response


class StreamError(Exception):
    """Ends a stream with the status code already set on its gRPC context."""


def _fail(grpc_context: RayServegRPCContext, e: APIError):
    grpc_context.set_code(STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL))
    grpc_context.set_details(e.message)
    return pb.GenerateResponse()
