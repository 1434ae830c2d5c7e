"""The OpenAI-compatible HTTP ingress: validate, apply the chat template, tokenize, and
stream the replica's deltas back as JSON or server-sent events. The same deployment
serves the gRPC API (router/grpc_api.py)."""

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoConfig, AutoTokenizer

from replica.llm import chat_prompt_ids
from replica.model_loader import resolve_model
from router.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from router.coordinator import get_coordinator
from router.generation import APIError, Generation, start_generation
from router.grpc_api import GrpcAPI
from router.metrics import ServingMetrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)

logger = logging.getLogger("ray.serve")
REPLICA_HEADER = "x-kvserve-replica"

app = FastAPI(title="kvserve")
app.add_middleware(BodySizeLimit)

_ERRORS = {
    400: "invalid request",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "overloaded; retry after Retry-After seconds",
    503: "no replica could serve the request",
}
_ERROR_401 = {"model": ErrorResponse, "description": _ERRORS[401]}
_ERROR_404 = {"model": ErrorResponse, "description": _ERRORS[404]}
_ERRORS_400 = {"model": ErrorResponse, "description": _ERRORS[400]}
GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events with stream"},
    **{status: {"model": ErrorResponse, "description": why} for status, why in _ERRORS.items()},
}


def _openapi() -> dict:
    """FastAPI's schema, less its 422 answers: validation errors here are OpenAI's 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="0.1.0", routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = _openapi


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(APIError)
async def _api_error(request: Request, e: APIError):
    return error_response(e.status, e.message, e.param, e.kind)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    # OpenAI answers 400 (not FastAPI's 422) for malformed bodies and bad values.
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    """FastAPI's own errors (unreadable body, unknown path, wrong method) in OpenAI's shape."""
    response = error_response(e.status_code, str(e.detail), kind="invalid_request_error")
    response.headers.update(e.headers or {})
    return response


async def _sse(formatter: "_Formatter", generation: Generation, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events; closing early (client gone) cancels the replica stream. The
    status line is long gone when a replica fails mid-stream, so the failure arrives as
    an error event in OpenAI's error shape, then [DONE]."""
    try:
        if formatter.chat:
            yield _event(formatter.chunk({"role": "assistant", "content": ""}, None, None))
        last = generation.first
        try:
            async for chunk in generation.chunks():
                last = chunk
                yield _event(formatter.delta(chunk))
        except APIError as e:
            yield _event(
                {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}
            )
        else:
            if include_usage:
                yield _event({**formatter.chunk(None, None, None), "choices": [], "usage": _usage(last)})
        yield "data: [DONE]\n\n"
    finally:
        generation.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(last: dict) -> dict:
    prompt, completion = last["num_prompt_tokens"], last["num_output_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Formatter:
    """Turns replica deltas into OpenAI completion / chat objects."""

    def __init__(self, response_id: str, model: str, chat: bool, tokenizer):
        self.id, self.model, self.chat, self.tokenizer = response_id, model, chat, tokenizer
        self.created = int(time.time())

    def chunk(self, delta, finish_reason, logprobs) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = delta or ""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def delta(self, chunk: dict) -> dict:
        content = {"content": chunk["text"]} if self.chat else chunk["text"]
        return self.chunk(
            content, chunk["finish_reason"], self._logprobs(chunk["logprobs"], chunk["token_ids"])
        )

    def whole(self, chunks: list[dict]) -> dict:
        text = "".join(c["text"] for c in chunks)
        token_ids = [t for c in chunks for t in c["token_ids"]]
        entries = [lp for c in chunks for lp in (c["logprobs"] or [])]
        logprobs = self._logprobs(entries, token_ids) if chunks[0]["logprobs"] is not None else None
        choice = {"index": 0, "finish_reason": chunks[-1]["finish_reason"], "logprobs": logprobs}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(chunks[-1]),
        }

    def _logprobs(self, entries: list[dict] | None, token_ids: list[int]) -> dict | None:
        if entries is None:
            return None
        tok = self.tokenizer.convert_ids_to_tokens
        if self.chat:
            content = [
                {
                    "token": tok(e["token_id"]),
                    "logprob": e["logprob"],
                    "bytes": None,
                    "top_logprobs": [
                        {"token": tok(t), "logprob": v, "bytes": None} for t, v in e["top_logprobs"].items()
                    ],
                }
                for e in entries
            ]
            return {"content": content}
        return {
            "tokens": [tok(e["token_id"]) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tok(t): v for t, v in e["top_logprobs"].items()} for e in entries],
            "text_offset": None,
        }


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class OpenAIIngress(GrpcAPI):
    async def __init__(
        self,
        llm: DeploymentHandle,
        model_name: str,
        model: str | None = None,
        coordinator: tuple[str, str] | None = None,
        api_keys: list[str] | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        warm_up: bool = True,
    ):
        """api_keys: when given, /v1/* and every gRPC call need one of them. warm_up: send
        one tiny request through the whole path at start-up (off where the replicas may
        scale to zero, since it would wake one)."""
        app.state.max_request_bytes = max_request_bytes
        self.llm = llm
        self.coordinator = get_coordinator(coordinator) if coordinator else None
        self.metrics = ServingMetrics(model_name)
        self.model_name = model_name
        path = resolve_model(model)
        self.model_root = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # Templating and tokenizing run here, off the event loop that streams every other
        # request's tokens; one thread, since a HF tokenizer must not be used concurrently.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenizer")
        config = AutoConfig.from_pretrained(path)
        self.vocab_size = getattr(config, "vocab_size", None) or len(self.tokenizer)
        self.config_max_len = getattr(config, "max_position_embeddings", None)
        self._api_keys = [key.encode() for key in api_keys or []]
        self._warm_up = asyncio.get_running_loop().create_task(self._send_warm_up()) if warm_up else None

    async def _send_warm_up(self) -> None:
        """The first request through a fresh handle, router and replica connection took
        1.7 s where later ones took 0.5 s; this one pays that instead of a client's. Not
        counted in /metrics, and shorter than a block, so nothing is prefix-cached."""
        try:
            stream = self.llm.options(stream=True).generate.remote(
                self.tokenizer("Hi").input_ids, {"max_tokens": 2, "temperature": 0}
            )
            async for _ in stream:
                pass
        except Exception:
            logger.warning("the start-up warm-up request failed", exc_info=True)

    @app.get("/health", responses={503: {"description": "still warming up"}})
    async def health(self):
        """200 once the warm-up request is through; load balancers wait for it."""
        if self._warm_up is not None and not self._warm_up.done():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics(self) -> Response:
        snapshot = await self.coordinator.snapshot.remote() if self.coordinator else {}
        return Response(self.metrics.exposition(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: _ERROR_401})
    async def models(self, request: Request) -> dict:
        self._check_auth(request.headers.get("authorization"))
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvserve",
            "root": self.model_root,
            "parent": None,
            "max_model_len": await self._max_model_len(),
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", responses={400: _ERRORS_400, 401: _ERROR_401, 404: _ERROR_404})
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        """vLLM's /tokenize, which load generators call to count prompt tokens."""
        self._check_auth(request.headers.get("authorization"))
        self._check_model(body.model)
        tokens = await self._in_tokenizer_thread(self._tokenize, body)
        return {"count": len(tokens), "max_model_len": await self._max_model_len(), "tokens": tokens}

    @app.post("/detokenize", responses={400: _ERRORS_400, 401: _ERROR_401, 404: _ERROR_404})
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        self._check_auth(request.headers.get("authorization"))
        self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens")
        return {"prompt": await self._in_tokenizer_thread(self.tokenizer.decode, body.tokens)}

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            return self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return self._chat_prompt_ids([m.model_dump() for m in body.messages], body.add_generation_prompt)

    async def _max_model_len(self) -> int | None:
        """The replicas' context window (they size it from their KV cache), else the model's."""
        try:
            snapshot = await self.coordinator.snapshot.remote() if self.coordinator else {}
        except Exception:  # the coordinator died; routers recreate it
            snapshot = {}
        lengths = [stats["max_model_len"] for stats in snapshot.values() if "max_model_len" in stats]
        return min(lengths) if lengths else self.config_max_len

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_auth(request.headers.get("authorization"))
        prompt, params = await self._completion_input(body)
        return await self._respond(body, prompt, params, chat=False)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_auth(request.headers.get("authorization"))
        prompt, params = await self._chat_input(body)
        return await self._respond(body, prompt, params, chat=True)

    def _check_auth(self, authorization: str | None) -> None:
        """Raises 401 unless keys are off or `authorization` is "Bearer <a key>".
        Every key is compared, in constant time, so timing reveals nothing."""
        if not self._api_keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        matched = False
        for key in self._api_keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise APIError(401, "missing or invalid API key", kind="authentication_error")

    def _check_model(self, model: str | None) -> None:
        """None (allowed on /tokenize and /detokenize, as in vLLM) means this server's model."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "not_found_error",
            )

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        # Checked here, not only by the engine: the router hashes ids as 64-bit integers.
        if token_ids and max(token_ids) >= self.vocab_size:
            raise APIError(400, f"token ids must be below the vocabulary size {self.vocab_size}", param)

    async def _in_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def _completion_input(self, body: CompletionRequest) -> tuple[list[int], dict]:
        """(prompt token ids, sampling params) for the replica. Token ids, not text, go to
        the replicas: the KV router hashes them into blocks."""
        self._check_model(body.model)
        params = body.sampling_params(body.max_tokens, body.logprobs)
        if isinstance(body.prompt, str):
            return (await self._in_tokenizer_thread(self.tokenizer, body.prompt)).input_ids, params
        self._check_token_ids(body.prompt, "prompt")
        return body.prompt, params

    async def _chat_input(self, body: ChatCompletionRequest) -> tuple[list[int], dict]:
        self._check_model(body.model)
        messages = [m.model_dump() for m in body.messages]
        prompt = await self._in_tokenizer_thread(self._chat_prompt_ids, messages)
        params = body.sampling_params(body.max_completion_tokens or body.max_tokens, body.num_logprobs)
        return prompt, params

    def _chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt)

    async def _start(self, prompt: list[int], params: dict) -> Generation:
        return await start_generation(self.llm, self.metrics, prompt, params)

    async def _respond(self, body, prompt: list[int], params: dict, chat: bool):
        generation = await self._start(prompt, params)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        formatter = _Formatter(response_id, self.model_name, chat, self.tokenizer)
        # Which replica serves the request, for operators and for bench/serving.py's split.
        headers = {REPLICA_HEADER: generation.first["replica_id"]}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(formatter, generation, include_usage), media_type="text/event-stream", headers=headers
            )
        try:
            chunks = [chunk async for chunk in generation.chunks()]
        finally:
            generation.cancel()
        return JSONResponse(formatter.whole(chunks), headers=headers)
