"""The OpenAI-compatible HTTP ingress: validate, apply the chat template, tokenize, and
stream the replica's deltas back as JSON or server-sent events. The same deployment
serves the gRPC API (router/grpc_api.py)."""

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoConfig, AutoTokenizer

from replica.model_loader import is_hub_id, resolve_model
from replica.versions import check_versions
from router import anthropic, responses
from router.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from router.coordinator import get_coordinator
from router.frontend import ChoiceDelta, Choices, EngineInput, FrontEnd, vllm_prompt_logprobs
from router.generation import DEFAULT_MAX_MIGRATIONS, APIError, Generation
from router.grpc_api import GrpcAPI
from router.metrics import ServingMetrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    main_error,
)
from router.replica_groups import ReplicaGroups
from router.rerank import RelevanceScorer, RerankRequest, ScoreRequest, rerank_response, score_response
from router.response_store import ResponseStore

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


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", path: str = ""
):
    """OpenAI's error body; Anthropic's on the Messages routes, whose SDK reads that one."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    if anthropic.is_messages_path(path):
        body = anthropic.error_body(status, message)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(APIError)
async def _api_error(request: Request, e: APIError):
    return error_response(e.status, e.message, e.param, e.kind, request.url.path)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    # OpenAI answers 400 (not FastAPI's 422) for malformed bodies and bad values.
    first = main_error(list(e.errors()))
    if first.get("type") == "json_invalid":
        message = f"body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        return error_response(400, message, path=request.url.path)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
    return error_response(400, message, where, path=request.url.path)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    """FastAPI's own errors (unreadable body, unknown path, wrong method) in OpenAI's shape."""
    response = error_response(e.status_code, str(e.detail), path=request.url.path)
    response.headers.update(e.headers or {})
    return response


async def _sse(formatter: "_Formatter", generation: Generation, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events; closing early (client gone) cancels the replica stream. The
    status line is long gone when a replica fails mid-stream, so the failure arrives as
    an error event in OpenAI's error shape, then [DONE]."""
    try:
        if formatter.chat:
            for index in range(formatter.choices.input.choices):
                yield _event(formatter.chunk(index, {"role": "assistant", "content": ""}, None, None))
        try:
            async for chunk in generation.chunks():
                yield _event(formatter.delta(formatter.choices.add(chunk)))
        except APIError as e:
            yield _event(
                {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}
            )
        else:
            if include_usage:
                usage = formatter.choices.usage()
                yield _event({**formatter.chunk(0, None, None, None), "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        generation.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Formatter:
    """Renders the front end's choices as OpenAI completion / chat objects."""

    def __init__(self, response_id: str, model: str, chat: bool, choices: Choices):
        self.id, self.model, self.chat, self.choices = response_id, model, chat, choices
        self.created = int(time.time())

    def chunk(self, index: int, delta, finish_reason, logprobs) -> dict:
        choice = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
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

    def delta(self, d: ChoiceDelta) -> dict:
        if self.chat:
            content = {"content": d.text}
            if d.calls:
                content["tool_calls"] = [
                    call.openai(i) for i, call in enumerate(d.calls, self._calls_before(d))
                ]
        else:
            content = d.text
        start = len(self.choices.samples[d.index].text) - len(d.text)  # the delta's text offset
        chunk = self.chunk(d.index, content, d.finish_reason, self._logprobs(d.logprobs, start))
        if d.prompt_logprobs is not None:
            self._add_prompt_logprobs(chunk, chunk["choices"][0], d.prompt_logprobs)
        return chunk

    def _add_prompt_logprobs(self, body: dict, choice: dict, entries: list[dict | None]) -> None:
        """vLLM's places: on each completion choice; on a chat response, at its top level."""
        (body if self.chat else choice)["prompt_logprobs"] = vllm_prompt_logprobs(entries)

    def _calls_before(self, d: ChoiceDelta) -> int:
        return len(self.choices.samples[d.index].calls) - len(d.calls)

    def whole(self) -> dict:
        choices = []
        for c in self.choices.result():
            choice = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c.logprobs),
            }
            if self.chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": c.text if c.text or not c.calls else None,
                }
                if c.calls:
                    choice["message"]["tool_calls"] = [call.openai() for call in c.calls]
            else:
                choice["text"] = c.text
            choices.append(choice)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.choices.usage(),
        }
        if self.choices.input.prompt_logprobs_wanted and self.choices.prompt_logprobs is not None:
            for choice in choices:  # the prompt's, the same for every choice
                self._add_prompt_logprobs(body, choice, self.choices.prompt_logprobs)
        return body

    def _logprobs(self, entries: list[dict] | None, start: int = 0) -> dict | None:
        """start: the text offset of the entries' first token in the choice's text."""
        if entries is None:
            return None
        if self.chat:
            content = [
                {
                    "token": e["token"],
                    "logprob": e["logprob"],
                    "bytes": None,
                    "top_logprobs": [
                        {"token": t["token"], "logprob": t["logprob"], "bytes": None}
                        for t in e["top_logprobs"]
                    ],
                }
                for e in entries
            ]
            return {"content": content}
        # Echoed prompts lead with their first token, which has no logprob (None, as OpenAI).
        tokens = [e["token"] for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                for e in entries
            ],
            "text_offset": _text_offsets(tokens, start),
        }


def _text_offsets(tokens: list[str], start: int) -> list[int]:
    """As vLLM: each token's offset is the one before plus that token's string length."""
    return list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start)) if tokens else []


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class OpenAIIngress(GrpcAPI):
    async def __init__(
        self,
        llm: DeploymentHandle,
        model_name: str,
        model: str | None = None,
        revision: str | None = None,
        coordinator: tuple[str, str] | None = None,
        api_keys: list[str] | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        warm_up: bool = True,
        chat_template: str | None = None,
        versions: dict[str, str] | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        more_llms: list[DeploymentHandle] | None = None,
    ):
        """api_keys: when given, /v1/* and every gRPC call need one of them. warm_up: send
        one tiny request through the whole path at start-up (off where the replicas may
        scale to zero, since it would wake one). chat_template: a Jinja template to use
        instead of the model's (say, one that renders tools). versions: kvserve's and
        Ray's where the application was built, which this process must run too.
        max_migrations: how often a stream may move on when its replica dies. more_llms:
        deployments of replicas of other shapes (router/replica_groups.py)."""
        check_versions(versions, "ingress")
        app.state.max_request_bytes = max_request_bytes
        self.llms = [llm, *(more_llms or [])]
        self._coordinator_address = coordinator
        self.coordinator = get_coordinator(coordinator) if coordinator else None
        self.model_name = model_name
        path = resolve_model(model, revision, weights=False)  # the ingress only tokenizes
        self.model_root = model if is_hub_id(model) else str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        self.config_max_len = getattr(config, "max_position_embeddings", None)
        self.metrics = ServingMetrics(model_name)
        self.frontend = FrontEnd(
            ReplicaGroups(self.llms, coordinator),
            self.metrics,
            model_name,
            self.tokenizer,
            getattr(config, "vocab_size", None) or len(self.tokenizer),
            api_keys,
            chat_template,
            max_migrations,
        )
        self._warm_up = asyncio.get_running_loop().create_task(self._send_warm_up()) if warm_up else None
        self.response_store = ResponseStore()  # /v1/responses' store: this replica's, in memory
        self.scorer = RelevanceScorer(self.frontend)

    async def _send_warm_up(self) -> None:
        """The first request through a fresh handle, router and replica connection took
        1.7 s where later ones took 0.5 s; this one pays that instead of a client's. Not
        counted in /metrics, and shorter than a block, so nothing is prefix-cached."""
        try:
            for llm in self.llms:  # each replica group's
                stream = llm.options(stream=True).generate.remote(
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
        snapshot = await self._snapshot()
        return Response(self.metrics.exposition(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: _ERROR_401})
    async def models(self, request: Request) -> dict:
        self.frontend.check_auth(request.headers.get("authorization"))
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
        self.frontend.check_auth(request.headers.get("authorization"))
        self.frontend.check_model(body.model)
        tokens = await self.frontend.in_tokenizer_thread(self._tokenize, body)
        return {"count": len(tokens), "max_model_len": await self._max_model_len(), "tokens": tokens}

    @app.post("/detokenize", responses={400: _ERRORS_400, 401: _ERROR_401, 404: _ERROR_404})
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        self.frontend.check_auth(request.headers.get("authorization"))
        self.frontend.check_model(body.model)
        self.frontend.check_token_ids(body.tokens, "tokens")
        return {"prompt": await self.frontend.in_tokenizer_thread(self.tokenizer.decode, body.tokens)}

    @app.post("/v1/rerank", responses={400: _ERRORS_400, 401: _ERROR_401, 404: _ERROR_404})
    async def rerank(self, body: RerankRequest, request: Request) -> dict:
        """Documents by relevance to the query (vLLM's, Jina's and Cohere's rerank)."""
        self.frontend.check_auth(request.headers.get("authorization"))
        self.frontend.check_model(body.model)
        pairs = [(body.query, text) for text in body.texts()]
        scores, num_tokens = await self.scorer.score(pairs, body.relevance_prompt)
        return rerank_response(self.model_name, body, scores, num_tokens)

    @app.post("/v1/score", responses={400: _ERRORS_400, 401: _ERROR_401, 404: _ERROR_404})
    async def score(self, body: ScoreRequest, request: Request) -> dict:
        """vLLM's /v1/score: the relevance of each text_2 to its text_1."""
        self.frontend.check_auth(request.headers.get("authorization"))
        self.frontend.check_model(body.model)
        scores, num_tokens = await self.scorer.score(body.pairs(), body.relevance_prompt)
        return score_response(self.model_name, scores, num_tokens)

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            return self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        messages = [m.template_message() for m in body.messages]
        return self.frontend.chat_prompt_ids(messages, body.add_generation_prompt)

    async def _snapshot(self) -> dict[str, dict]:
        """The replicas' latest reports; none while the coordinator is gone. A dead
        coordinator is recreated by whoever looks it up first, this ingress included."""
        if self.coordinator is None:
            return {}
        try:
            return await self.coordinator.snapshot.remote()
        except Exception:
            self.coordinator = get_coordinator(self._coordinator_address)
            return {}

    async def _max_model_len(self) -> int | None:
        """The replicas' context window (they size it from their KV cache), else the model's."""
        snapshot = await self._snapshot()
        lengths = [stats["max_model_len"] for stats in snapshot.values() if "max_model_len" in stats]
        return min(lengths) if lengths else self.config_max_len

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request):
        self.frontend.check_auth(request.headers.get("authorization"))
        if body.is_batch:
            return await self._complete_batch(body)
        return await self._respond(body, await self.frontend.completion_input(body), chat=False)

    async def _complete_batch(self, body: CompletionRequest) -> JSONResponse:
        """A batch of prompts (OpenAI's and vLLM's): one response, whose choices are the
        prompts' in order, prompt i's n choices from index i * n, and usage summed. Each
        prompt is a generation of its own, run side by side; batches are not streamed."""
        if body.streaming:
            raise APIError(400, "a batch of prompts cannot be streamed; send them one by one", "prompt")
        inputs = [await self.frontend.completion_input(one) for one in body.batch()]
        generations = []
        try:
            for engine_input in inputs:
                generations.append(await self.frontend.start(engine_input))
            formatters = [
                _Formatter("", self.model_name, False, Choices(engine_input)) for engine_input in inputs
            ]

            async def collect(generation: Generation, formatter: _Formatter) -> dict:
                async for chunk in generation.chunks():
                    formatter.choices.add(chunk)
                return formatter.whole()

            wholes = await asyncio.gather(*map(collect, generations, formatters))
        finally:
            for generation in generations:
                generation.cancel()
        choices = [choice for whole in wholes for choice in whole["choices"]]
        for index, choice in enumerate(choices):
            choice["index"] = index
        usage = {key: sum(whole["usage"][key] for whole in wholes) for key in wholes[0]["usage"]}
        body = {**wholes[0], "id": "cmpl-" + uuid.uuid4().hex, "choices": choices, "usage": usage}
        return JSONResponse(body, headers={REPLICA_HEADER: generations[0].first["replica_id"]})

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self.frontend.check_auth(request.headers.get("authorization"))
        return await self._respond(body, await self.frontend.chat_input(body), chat=True)

    @app.post("/v1/messages", responses=anthropic.RESPONSES)
    async def messages(self, body: anthropic.MessagesRequest, request: Request):
        """Anthropic's Messages API, on the chat path (router/anthropic.py)."""
        self.frontend.check_auth(request.headers.get("authorization"), request.headers.get("x-api-key"))
        engine_input = await self.frontend.chat_input(anthropic.chat_request(body))
        generation = await self.frontend.start(engine_input)
        reply = anthropic.Reply(self.model_name, Choices(engine_input), body.stop_sequences, self._decode)
        headers = {REPLICA_HEADER: generation.first["replica_id"]}
        if body.stream:
            events = reply.events(generation)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            async for chunk in generation.chunks():
                reply.choices.add(chunk)
        finally:
            generation.cancel()
        return JSONResponse(await reply.message(), headers=headers)

    @app.post("/v1/messages/count_tokens", responses=anthropic.RESPONSES)
    async def count_message_tokens(self, body: anthropic.CountTokensRequest, request: Request) -> dict:
        """The prompt's tokens as /v1/messages renders it, tools included."""
        self.frontend.check_auth(request.headers.get("authorization"), request.headers.get("x-api-key"))
        engine_input = await self.frontend.chat_input(anthropic.chat_request(body))
        return {"input_tokens": len(engine_input.prompt)}

    async def _decode(self, token_ids: list[int]) -> str:
        return await self.frontend.in_tokenizer_thread(
            lambda: self.tokenizer.decode(token_ids, skip_special_tokens=True)
        )

    async def _respond(self, body, engine_input: EngineInput, chat: bool):
        generation = await self.frontend.start(engine_input)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        formatter = _Formatter(response_id, self.model_name, chat, Choices(engine_input))
        # Which replica serves the request, for operators and for bench/serving.py's split.
        headers = {REPLICA_HEADER: generation.first["replica_id"]}
        if body.streaming:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse(formatter, generation, include_usage), media_type="text/event-stream", headers=headers
            )
        try:
            async for chunk in generation.chunks():
                formatter.choices.add(chunk)
        finally:
            generation.cancel()
        return JSONResponse(formatter.whole(), headers=headers)

    @app.post("/v1/responses", responses=GENERATION_RESPONSES)
    async def create_response(self, body: responses.ResponsesRequest, request: Request):
        """OpenAI's Responses API, run as a chat request (router/responses.py)."""
        self.frontend.check_auth(request.headers.get("authorization"))
        turn = responses.prepare(body, self.response_store)
        engine_input = await self.frontend.chat_input(turn.chat)
        generation = await self.frontend.start(engine_input)
        builder = responses.ResponseBuilder(turn, self.model_name, Choices(engine_input))
        headers = {REPLICA_HEADER: generation.first["replica_id"]}
        if body.stream:
            events = responses.sse(builder, generation, self.response_store)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        whole = await responses.collect(builder, generation, self.response_store)
        return JSONResponse(whole, headers=headers)

    @app.get(
        "/v1/responses/{response_id}",
        responses={401: _ERROR_401, 404: {"model": ErrorResponse, "description": "no such stored response"}},
    )
    async def get_response(self, response_id: str, request: Request) -> dict:
        """A stored response, while this ingress replica keeps it (router/response_store.py)."""
        self.frontend.check_auth(request.headers.get("authorization"))
        return responses.stored(self.response_store, response_id)
