"""The ingress deployment: the HTTP routes (OpenAI's, Anthropic's Messages, Responses,
rerank, tokenize, LoRA adapters) over one front end, the generating ones answering
through router/api/respond.py. The same deployment serves the gRPC API: Serve's gRPC
proxy calls its methods named after the RPCs, which hand over to router/api/grpc_api.py."""

import asyncio
import json
import logging

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from replica.model_files import load_tokenizer, model_limits, sampling_defaults
from replica.model_loader import is_hub_id, resolve_model
from replica.versions import check_versions
from router.api import anthropic, responses
from router.api.auth import KEYED, KEYED_MESSAGES
from router.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from router.api.frontend import Choices, FrontEnd
from router.api.grpc_api import GrpcAPI
from router.api.http_app import ERROR_400, ERROR_401, ERROR_404, GENERATION_RESPONSES, app
from router.api.openai_format import ChatRenderer, CompletionRenderer, batch_whole
from router.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from router.api.protos import kvserve_pb2 as pb
from router.api.rerank import RelevanceScorer, RerankRequest, ScoreRequest, rerank_response, score_response
from router.api.respond import REPLICA_HEADER, collect, respond
from router.api.response_store import ResponseStore
from router.api.responses_renderer import ResponsesRenderer
from router.generation import DEFAULT_MAX_MIGRATIONS, APIError
from router.lora_adapters import Adapters, LoRASettings
from router.metrics import ServingMetrics
from router.placement.coordinator import get_coordinator
from router.placement.replica_groups import ReplicaGroups
from wire.messages import GenerateRequest, ReplicaReport
from wire.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")
ERROR_404_ADAPTER = {"model": ErrorResponse, "description": "no such adapter"}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class OpenAIIngress:
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
        lora: LoRASettings | None = None,
        generation_config: str = "auto",
    ):
        """api_keys: when given, /v1/* and every gRPC call need one of them. warm_up: send
        one tiny request through the whole path at start-up (off where the replicas may
        scale to zero, since it would wake one). chat_template: a Jinja template to use
        instead of the model's (say, one that renders tools). versions: kvserve's and
        Ray's where the application was built, which this process must run too.
        max_migrations: how often a stream may move on when its replica dies. more_llms:
        deployments of replicas of other shapes (router/placement/replica_groups.py). lora: the
        engine's LoRA arguments and start-up adapters, None where enable_lora is off.
        generation_config: "auto" takes the defaults of unset sampling fields from the
        model's generation_config.json, as vLLM does; "none" keeps SamplingParams' own."""
        check_versions(versions, "ingress")
        app.state.max_request_bytes = max_request_bytes
        # Chunks come over gRPC rather than as Ray object references: a streamed chunk by
        # reference costs an object ref, its reference counting and a report to its owner,
        # a large part of this replica's CPU at one chunk per request per engine step.
        # Serve's throughput-optimized mode makes that the default only for handles made in a
        # process that had it set when it imported Serve; these come from where the app is
        # built, set or not.
        self.llms = [handle.options(_by_reference=False) for handle in (llm, *(more_llms or []))]
        self._coordinator_address = coordinator
        self.coordinator = get_coordinator(coordinator) if coordinator else None
        self.model_name = model_name
        path = resolve_model(model, revision, weights=False)  # the ingress only tokenizes
        self.model_root = model if is_hub_id(model) else str(path)
        self.tokenizer = load_tokenizer(path)
        limits = model_limits(path)
        self.config_max_len = limits.max_position_embeddings
        self.metrics = ServingMetrics(model_name)
        # Adapters are checked against the base model's shapes before any replica sees one.
        base_config = json.loads((path / "config.json").read_text()) if lora else {}
        adapters = Adapters(lora, model_name, base_config, coordinator)
        await adapters.start()
        defaults = sampling_defaults(path) if generation_config == "auto" else {}
        if defaults:
            logger.info("sampling defaults from the model's generation_config.json: %s", defaults)
        self.frontend = FrontEnd(
            ReplicaGroups(self.llms, coordinator),
            self.metrics,
            model_name,
            self.tokenizer,
            limits.vocab_size or len(self.tokenizer),
            api_keys,
            chat_template,
            max_migrations,
            adapters,
            defaults,
        )
        self._warm_up = asyncio.get_running_loop().create_task(self._send_warm_up()) if warm_up else None
        self.response_store = ResponseStore()  # /v1/responses' store: this replica's, in memory
        self.scorer = RelevanceScorer(self.frontend)
        self.grpc = GrpcAPI(self.frontend)

    async def _send_warm_up(self) -> None:
        """The first request through a fresh handle, router and replica connection pays
        for their lazy set-up; this one pays it instead of a client's. Not counted in
        /metrics, and shorter than a block, so nothing is prefix-cached."""
        try:
            for llm in self.llms:  # each replica group's
                request = GenerateRequest(
                    self.tokenizer("Hi").input_ids, sampling=SamplingParams(max_tokens=2, temperature=0)
                )
                stream = llm.options(stream=True).generate.remote(request)
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

    @app.get("/v1/models", responses={401: ERROR_401}, dependencies=KEYED)
    async def models(self) -> dict:
        """The base model, then each LoRA adapter, whose parent is the base model (vLLM's
        cards). The base model's card also says, from a replica's report, what its weights
        are stored in and take, and its KV cache's dtype and capacity in tokens."""
        snapshot = await self._snapshot()
        base = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvserve",
            "root": self.model_root,
            "parent": None,
            "max_model_len": self._context_window(snapshot),
        }
        report = next(iter(snapshot.values()), None)
        if report is not None:
            base["weights"] = {"dtype": report.weight_dtype, "bytes": report.weight_bytes}
            base["kv_cache"] = {
                "dtype": report.kv_cache_dtype,
                "tokens": report.num_total_blocks * report.block_size,
            }
        adapters = [
            {**base, "id": lora.lora_name, "root": lora.lora_path, "parent": self.model_name}
            for lora in await self.frontend.adapters.all()
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter", responses={400: ERROR_400, 401: ERROR_401}, dependencies=KEYED)
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """vLLM's: checks the adapter's files against the base model (a bad adapter is a
        400 and never reaches a replica) and registers it; each replica loads it when a
        request for it first arrives there. The answer is vLLM's plain text."""
        await self.frontend.adapters.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        responses={400: ERROR_400, 401: ERROR_401, 404: ERROR_404_ADAPTER},
        dependencies=KEYED,
    )
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest):
        """vLLM's: requests naming the adapter are a 404 from now on; the replicas learn it
        from the coordinator's answer to their next report, and drop its weights."""
        await self.frontend.adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize", responses={400: ERROR_400, 401: ERROR_401, 404: ERROR_404}, dependencies=KEYED)
    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize, which load generators call to count prompt tokens."""
        await self.frontend.resolve_model(body.model)  # an adapter tokenizes as its base model
        tokens = await self.frontend.in_tokenizer_thread(self._tokenize, body)
        max_model_len = self._context_window(await self._snapshot())
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize", responses={400: ERROR_400, 401: ERROR_401, 404: ERROR_404}, dependencies=KEYED)
    async def detokenize(self, body: DetokenizeRequest) -> dict:
        await self.frontend.resolve_model(body.model)
        self.frontend.check_token_ids(body.tokens, "tokens")
        return {"prompt": await self.frontend.in_tokenizer_thread(self.tokenizer.decode, body.tokens)}

    @app.post("/v1/rerank", responses={400: ERROR_400, 401: ERROR_401, 404: ERROR_404}, dependencies=KEYED)
    async def rerank(self, body: RerankRequest) -> dict:
        """Documents by relevance to the query (vLLM's, Jina's and Cohere's rerank)."""
        self.frontend.check_model(body.model)
        pairs = [(body.query, text) for text in body.texts()]
        scores, num_tokens = await self.scorer.score(pairs, body.relevance_prompt)
        return rerank_response(self.model_name, body, scores, num_tokens)

    @app.post("/v1/score", responses={400: ERROR_400, 401: ERROR_401, 404: ERROR_404}, dependencies=KEYED)
    async def score(self, body: ScoreRequest) -> dict:
        """vLLM's /v1/score: the relevance of each text_2 to its text_1."""
        self.frontend.check_model(body.model)
        scores, num_tokens = await self.scorer.score(body.pairs(), body.relevance_prompt)
        return score_response(self.model_name, scores, num_tokens)

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            return self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        messages = [m.template_message() for m in body.messages]
        return self.frontend.chat_prompt_ids(messages, body.add_generation_prompt)

    async def _snapshot(self) -> dict[str, ReplicaReport]:
        """The replicas' latest reports; none while the coordinator is gone. A dead
        coordinator is recreated by whoever looks it up first, this ingress included."""
        if self.coordinator is None:
            return {}
        try:
            return await self.coordinator.snapshot.remote()
        except Exception:
            self.coordinator = get_coordinator(self._coordinator_address)
            return {}

    def _context_window(self, snapshot: dict[str, ReplicaReport]) -> int | None:
        """The replicas' context window (they size it from their KV cache), else the model's."""
        lengths = [report.max_model_len for report in snapshot.values()]
        return min(lengths) if lengths else self.config_max_len

    @app.post("/v1/completions", responses=GENERATION_RESPONSES, dependencies=KEYED)
    async def completions(self, body: CompletionRequest):
        if body.is_batch:
            return await self._complete_batch(body)
        engine_input = await self.frontend.completion_input(body)
        model = self.frontend.response_model(engine_input)
        renderer = CompletionRenderer(model, Choices(engine_input), body.stream_options)
        return await respond(await self.frontend.start(engine_input), renderer, body.streaming)

    async def _complete_batch(self, body: CompletionRequest) -> JSONResponse:
        """A batch of prompts (OpenAI's and vLLM's): one response, the prompts' answers
        merged (openai_format.batch_whole). Each prompt is a generation of its own, run
        side by side; batches are not streamed."""
        if body.streaming:
            raise APIError(400, "a batch of prompts cannot be streamed; send them one by one", "prompt")
        inputs = [await self.frontend.completion_input(one) for one in body.batch()]
        model = self.frontend.response_model(inputs[0])  # one `model` for the whole batch
        renderers = [CompletionRenderer(model, Choices(one)) for one in inputs]
        generations = []
        try:  # a failed start or generation ends the ones already started
            for engine_input in inputs:
                generations.append(await self.frontend.start(engine_input))
            await asyncio.gather(*map(collect, generations, renderers))
        finally:
            for generation in generations:
                generation.cancel()
        whole = batch_whole([await renderer.whole() for renderer in renderers])
        return JSONResponse(whole, headers={REPLICA_HEADER: generations[0].first.replica_id})

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES, dependencies=KEYED)
    async def chat_completions(self, body: ChatCompletionRequest):
        engine_input = await self.frontend.chat_input(body)
        model = self.frontend.response_model(engine_input)
        renderer = ChatRenderer(model, Choices(engine_input), body.stream_options)
        return await respond(await self.frontend.start(engine_input), renderer, body.streaming)

    @app.post("/v1/messages", responses=anthropic.RESPONSES, dependencies=KEYED_MESSAGES)
    async def messages(self, body: anthropic.MessagesRequest):
        """Anthropic's Messages API, on the chat path (router/api/anthropic.py)."""
        engine_input = await self.frontend.chat_input(anthropic.chat_request(body))
        model = self.frontend.response_model(engine_input)
        renderer = anthropic.MessagesRenderer(model, Choices(engine_input), body.stop_sequences, self._decode)
        return await respond(await self.frontend.start(engine_input), renderer, bool(body.stream))

    @app.post("/v1/messages/count_tokens", responses=anthropic.RESPONSES, dependencies=KEYED_MESSAGES)
    async def count_message_tokens(self, body: anthropic.CountTokensRequest) -> dict:
        """The prompt's tokens as /v1/messages renders it, tools included."""
        engine_input = await self.frontend.chat_input(anthropic.chat_request(body))
        return {"input_tokens": len(engine_input.request.prompt)}

    async def _decode(self, token_ids: list[int]) -> str:
        return await self.frontend.in_tokenizer_thread(
            lambda: self.tokenizer.decode(token_ids, skip_special_tokens=True)
        )

    @app.post("/v1/responses", responses=GENERATION_RESPONSES, dependencies=KEYED)
    async def create_response(self, body: responses.ResponsesRequest):
        """OpenAI's Responses API, run as a chat request (router/api/responses.py)."""
        turn = responses.prepare(body, self.response_store)
        engine_input = await self.frontend.chat_input(turn.chat)
        model = self.frontend.response_model(engine_input)
        renderer = ResponsesRenderer(turn, model, Choices(engine_input), self.response_store)
        return await respond(await self.frontend.start(engine_input), renderer, bool(body.stream))

    @app.get(
        "/v1/responses/{response_id}",
        responses={401: ERROR_401, 404: {"model": ErrorResponse, "description": "no such stored response"}},
        dependencies=KEYED,
    )
    async def get_response(self, response_id: str) -> dict:
        """A stored response, while this ingress replica keeps it (router/api/response_store.py)."""
        return responses.stored(self.response_store, response_id)

    # gRPC (router/api/grpc_api.py): Serve's gRPC proxy calls the deployment's methods by RPC name.
    async def ListModels(self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext):
        return await self.grpc.list_models(grpc_context)

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        return await self.grpc.unary(request, grpc_context, chat=False)

    async def Chat(self, request: pb.ChatRequest, grpc_context: RayServegRPCContext):
        return await self.grpc.unary(request, grpc_context, chat=True)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        async for response in self.grpc.stream(request, grpc_context, chat=False):
            yield response

    async def ChatStream(self, request: pb.ChatRequest, grpc_context: RayServegRPCContext):
        async for response in self.grpc.stream(request, grpc_context, chat=True):
            yield response
