"""The one front end behind the HTTP and gRPC adapters: auth, the model check, turning
an OpenAI request into engine input (template, tokens, validated SamplingParams), and
turning the replica's stream back into choices (n samples, best_of, echo, tool calls).

The adapters only move bytes: router/api/respond.py streams choices through each API's
renderer as JSON or server-sent events, router/api/grpc_api.py as protobuf messages."""

import asyncio
import dataclasses
import hmac
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from replica.chat_template import chat_prompt_ids
from router.api import tool_calls
from router.api.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from router.generation import DEFAULT_MAX_MIGRATIONS, APIError, Generation, start_generation
from router.lora_adapters import Adapters
from router.metrics import ServingMetrics
from router.placement.replica_groups import ReplicaGroups
from wire.lora_request import LoRARequest
from wire.messages import GenerateRequest, LogprobEntry, StreamChunk, TopLogprob
from wire.sampling_params import SamplingParams


@dataclass
class EngineInput:
    """A validated request, ready for a replica, and how to shape its answer."""

    # Its prompt as token ids; its sampling's n is the number of samples generated.
    request: GenerateRequest
    choices: int  # returned; fewer than the samples with best_of
    logprobs_wanted: bool  # the client's; best_of asks for logprobs to rank samples
    echo: str | None = None  # completions with echo: the prompt text
    tools: bool = False  # parse tool calls out of the text
    prompt_logprobs_wanted: bool = False  # vLLM's prompt_logprobs: returned as their own list
    # Echo with logprobs: the prompt's first token, whose entry leads the logprobs without
    # a logprob; the prompt's other entries follow, then the generated tokens'.
    echo_first_token: str | None = None
    echo_only: bool = False  # echo with max_tokens 0 (vLLM's): the one token generated is dropped

    @property
    def lora(self) -> LoRARequest | None:
        """The adapter the request runs with (the `model` it named); None: the base model."""
        return self.request.lora


@dataclass
class Choice:
    """One sample's output so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None  # the replica's entries, with token strings
    finish_reason: str | None = None
    calls: list[tool_calls.ParsedCall] = field(default_factory=list)
    num_output_tokens: int = 0
    started: bool = False  # a chunk has come

    @property
    def cumulative_logprob(self) -> float:
        # Echoed prompt entries count alike for every sample; the first has no logprob.
        return sum(entry.logprob for entry in self.logprobs or () if entry.logprob is not None)


@dataclass
class ChoiceDelta:
    """What one stream chunk adds to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    calls: list[tool_calls.ParsedCall]
    finish_reason: str | None
    prompt_logprobs: list[LogprobEntry | None] | None = None  # wanted, and carried by this chunk


class Choices:
    """Collects a generation's chunks into choices, whole or delta by delta."""

    def __init__(self, engine_input: EngineInput):
        self.input = engine_input
        self.samples = [Choice(i) for i in range(engine_input.request.sampling.n)]
        self._streams = [tool_calls.ToolCallStream() for _ in self.samples] if engine_input.tools else None
        self.num_prompt_tokens = 0
        # The replica's prompt entries (None first), from the first sample's first chunk.
        self.prompt_logprobs: list[LogprobEntry | None] | None = None

    def add(self, chunk: StreamChunk) -> ChoiceDelta:
        choice = self.samples[chunk.index]
        prompt_logprobs = chunk.prompt_logprobs
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        first, choice.started = not choice.started, True
        text, calls = chunk.text, []
        token_ids, chunk_logprobs = chunk.token_ids, chunk.logprobs
        if self.input.echo_only:
            text, token_ids, chunk_logprobs = "", [], None if chunk_logprobs is None else []
        if self.input.echo is not None and first:
            text = self.input.echo + text
            if self.input.echo_first_token is not None:
                chunk_logprobs = self._echo_entries() + (chunk_logprobs or [])
        if self._streams is not None:
            stream = self._streams[chunk.index]
            text, calls = stream.feed(text)
            if chunk.finished:
                text += stream.flush()
        finish_reason = chunk.finish_reason
        if finish_reason == "stop" and (calls or choice.calls):
            finish_reason = "tool_calls"
        choice.text += text
        choice.token_ids += token_ids
        choice.calls += calls
        if chunk_logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + chunk_logprobs
        choice.finish_reason = finish_reason
        choice.num_output_tokens = 0 if self.input.echo_only else chunk.num_output_tokens
        self.num_prompt_tokens = chunk.num_prompt_tokens
        logprobs = chunk_logprobs if self.input.logprobs_wanted else None
        prompt_logprobs = prompt_logprobs if self.input.prompt_logprobs_wanted else None
        return ChoiceDelta(choice.index, text, token_ids, logprobs, calls, finish_reason, prompt_logprobs)

    def _echo_entries(self) -> list[LogprobEntry]:
        """The prompt's entries as echo shows them, as in vLLM: the first token's without
        a logprob or alternatives, each other token's alternatives led by the token itself."""
        # The one entry with neither: OpenAI's echo shows null for both.
        first = LogprobEntry(
            self.input.request.prompt[0], self.input.echo_first_token, logprob=None, top_logprobs=None
        )
        entries = [first]
        for e in (self.prompt_logprobs or [None])[1:]:
            own = TopLogprob(e.token_id, e.token, e.logprob)
            others = [t for t in e.top_logprobs if t.token_id != e.token_id]
            entries.append(dataclasses.replace(e, top_logprobs=[own, *others]))
        return entries

    def result(self) -> list[Choice]:
        """The returned choices: with best_of, the most likely samples, renumbered."""
        if len(self.samples) == self.input.choices:
            chosen = self.samples
        else:
            ranked = sorted(self.samples, key=lambda c: c.cumulative_logprob, reverse=True)
            chosen = ranked[: self.input.choices]
        out = []
        for index, choice in enumerate(chosen):
            logprobs = choice.logprobs if self.input.logprobs_wanted else None
            out.append(
                Choice(index, choice.text, choice.token_ids, logprobs, choice.finish_reason, choice.calls)
            )
        return out

    def usage(self) -> dict:
        """The prompt counts once, every sample's tokens count (best_of's too)."""
        completion = sum(c.num_output_tokens for c in self.samples)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
        }


class FrontEnd:
    def __init__(
        self,
        replicas: ReplicaGroups,
        metrics: ServingMetrics,
        model_name: str,
        tokenizer,
        vocab_size: int,
        api_keys: list[str] | None = None,
        chat_template: str | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        adapters: Adapters | None = None,
        sampling_defaults: dict | None = None,
    ):
        """adapters: the LoRA adapters requests may name as their model; None: none.
        sampling_defaults: SamplingParams fields for what a request leaves unset (the
        model's generation config, replica/model_files.py)."""
        self.replicas, self.metrics, self.model_name = replicas, metrics, model_name
        self.adapters = adapters or Adapters(None, model_name, {}, None)
        self.max_migrations = max_migrations
        self.sampling_defaults = sampling_defaults or {}
        self.tokenizer, self.vocab_size, self.chat_template = tokenizer, vocab_size, chat_template
        self._api_keys = [key.encode() for key in api_keys or []]
        # Templating and tokenizing run off the event loop that streams every other
        # request's tokens; one thread, since a HF tokenizer must not be used concurrently.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenizer")

    def check_auth(self, authorization: str | None, api_key: str | None = None) -> None:
        """Raises 401 unless keys are off, `authorization` is "Bearer <a key>" or
        `api_key` (Anthropic's x-api-key header) is a key. Every key is compared, in
        constant time, so timing reveals nothing."""
        if not self._api_keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        given = [token.strip().encode() if scheme.lower() == "bearer" else b"", (api_key or "").encode()]
        matched = False
        for key in self._api_keys:
            for candidate in given:
                matched |= hmac.compare_digest(candidate, key)
        if not matched:
            raise APIError(401, "missing or invalid API key", kind="authentication_error")

    async def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; 404 for anything else."""
        return await self.adapters.resolve(model)

    def response_model(self, engine_input: EngineInput) -> str:
        """The `model` an answer names: the adapter the request asked for, as in vLLM."""
        return engine_input.lora.lora_name if engine_input.lora else self.model_name

    def check_model(self, model: str | None) -> None:
        """For the routes that serve the base model only (rerank, score): an absent or
        empty model (proto3's unset string) means the served one, as in vLLM."""
        if model and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "not_found_error",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        # Checked here, not only by the engine: the router hashes ids as 64-bit integers.
        if token_ids and max(token_ids) >= self.vocab_size:
            raise APIError(400, f"token ids must be below the vocabulary size {self.vocab_size}", param)

    async def in_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def chat_prompt_ids(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        try:
            return chat_prompt_ids(self.tokenizer, messages, add_generation_prompt, tools, self.chat_template)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None

    async def completion_input(self, body: CompletionRequest) -> EngineInput:
        """Token ids, not text, go to the replicas: the KV router hashes them into blocks."""
        lora = await self.resolve_model(body.model)
        if isinstance(body.prompt, str):
            prompt = (await self.in_tokenizer_thread(self.tokenizer, body.prompt)).input_ids
        else:
            self.check_token_ids(body.prompt, "prompt")
            prompt = body.prompt
        echo = None
        prompt_logprobs, echo_first_token = body.prompt_logprobs, None
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(body.prompt)
            if body.logprobs is not None:  # as in vLLM: the prompt's logprobs lead the answer's
                prompt_logprobs = body.logprobs if prompt_logprobs is None else prompt_logprobs
                echo_first_token = self.tokenizer.convert_ids_to_tokens(prompt[0])
        structured = _structured(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default here
        # vLLM's echo without generation (lm-eval's loglikelihood requests may send it):
        # one token is generated, as the engine always samples one, and not returned.
        echo_only = bool(body.echo) and max_tokens == 0
        engine_input = self._engine_input(
            body,
            prompt,
            1 if echo_only else max_tokens,
            body.logprobs,
            structured,
            echo,
            prompt_logprobs=prompt_logprobs,
            lora=lora,
        )
        engine_input.echo_first_token, engine_input.echo_only = echo_first_token, echo_only
        return engine_input

    async def chat_input(self, body: ChatCompletionRequest) -> EngineInput:
        lora = await self.resolve_model(body.model)
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]
        choice = body.tool_choice
        if choice == "none" or not tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice names a tool, but no tools were given", "tool_choice")
            tools = []
        messages = [m.template_message() for m in body.messages]
        prompt = await self.in_tokenizer_thread(self.chat_prompt_ids, messages, True, tools)
        structured = _structured(body)
        if tools and choice not in (None, "auto"):
            named = None if choice == "required" else choice.function.name
            if named is not None and named not in {t["name"] for t in tools}:
                raise APIError(400, f"tool_choice names {named!r}, which is not in tools", "tool_choice")
            if structured is not None:
                raise APIError(400, "give tool_choice or a response format, not both", "tool_choice")
            grammar = tool_calls.required_grammar(tools, named, parallel=bool(body.parallel_tool_calls))
            structured = {"grammar": grammar}
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._engine_input(
            body,
            prompt,
            max_tokens,
            body.num_logprobs,
            structured,
            tools=bool(tools),
            prompt_logprobs=body.prompt_logprobs,
            lora=lora,
        )

    def _engine_input(
        self,
        body,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        structured: dict | None,
        echo: str | None = None,
        tools: bool = False,
        prompt_logprobs: int | None = None,
        lora: LoRARequest | None = None,
    ) -> EngineInput:
        fields = {**self.sampling_defaults, **body.sampling_fields()}
        choices = fields.get("n", 1)
        best_of = getattr(body, "best_of", None)
        if best_of is not None and best_of != choices:
            if best_of < choices:
                raise APIError(400, f"best_of ({best_of}) must be at least n ({choices})", "best_of")
            if body.streaming:
                raise APIError(400, "best_of greater than n cannot be streamed", "best_of")
            fields["n"] = best_of
            logprobs_wanted, logprobs = logprobs is not None, logprobs or 0  # to rank the samples
        else:
            logprobs_wanted = logprobs is not None
        fields.update(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured)
        if prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs
        try:
            params = SamplingParams(**fields)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e)) from None
        # As in vLLM, priority is a request's, not a sampling parameter.
        priority = getattr(body, "priority", None) or 0
        request = GenerateRequest(prompt, sampling=params, priority=priority, lora=lora)
        wanted = getattr(body, "prompt_logprobs", None) is not None
        return EngineInput(request, choices, logprobs_wanted, echo, tools, wanted)

    async def start(self, engine_input: EngineInput) -> Generation:
        llm = self.replicas.pick(engine_input.request)
        return await start_generation(llm, self.metrics, engine_input.request, self.max_migrations)


def _structured(body: CompletionRequest | ChatCompletionRequest) -> dict | None:
    """StructuredOutputs fields from OpenAI's response_format or vLLM's guided_*."""
    try:
        guided = body.guided()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    response_format: ResponseFormat | None = body.response_format
    from_format = None
    if response_format is not None and response_format.type == "json_object":
        from_format = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        from_format = {"json": response_format.json_schema.schema_}
    if from_format is not None and guided is not None:
        raise APIError(400, "give response_format or a guided_* option, not both", "response_format")
    return from_format or guided


def vllm_prompt_logprobs(entries: list[LogprobEntry | None]) -> list[dict | None]:
    """The replica's prompt entries as vLLM returns `prompt_logprobs`: None for the first
    token, then per token a dict of token id -> logprob, rank and decoded token, holding
    the prompt token and its top-n alternatives (ranks 1..n)."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, t in enumerate(e.top_logprobs, 1):
            position.setdefault(
                str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
            )
        out.append(position)
    return out
