"""The one front end behind the HTTP and gRPC adapters: auth, the model check, turning
an OpenAI request into engine input (template, tokens, validated SamplingParams), and
turning the replica's stream back into choices (n samples, best_of, echo, tool calls).

The adapters only move bytes: router/http.py renders choices as OpenAI JSON and
server-sent events, router/grpc_api.py as protobuf messages."""

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from replica.llm import chat_prompt_ids
from replica.sampling_params import SamplingParams
from router import tool_calls
from router.generation import DEFAULT_MAX_MIGRATIONS, APIError, Generation, start_generation
from router.metrics import ServingMetrics
from router.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from router.replica_groups import ReplicaGroups


@dataclass
class EngineInput:
    """A validated request, ready for a replica, and how to shape its answer."""

    prompt: list[int]
    params: dict  # SamplingParams fields; n is the number of samples generated
    choices: int  # returned; fewer than the samples with best_of
    logprobs_wanted: bool  # the client's; best_of asks for logprobs to rank samples
    echo: str | None = None  # completions with echo: the prompt text
    tools: bool = False  # parse tool calls out of the text


@dataclass
class Choice:
    """One sample's output so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # the replica's entries, with token strings
    finish_reason: str | None = None
    calls: list[tool_calls.ParsedCall] = field(default_factory=list)
    num_output_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry["logprob"] for entry in self.logprobs or ())


@dataclass
class ChoiceDelta:
    """What one stream chunk adds to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None
    calls: list[tool_calls.ParsedCall]
    finish_reason: str | None


class Choices:
    """Collects a generation's chunks into choices, whole or delta by delta."""

    def __init__(self, engine_input: EngineInput):
        self.input = engine_input
        self.samples = [Choice(i) for i in range(engine_input.params.get("n", 1))]
        self._streams = [tool_calls.ToolCallStream() for _ in self.samples] if engine_input.tools else None
        self.num_prompt_tokens = 0

    def add(self, chunk: dict) -> ChoiceDelta:
        choice = self.samples[chunk["index"]]
        text, calls = chunk["text"], []
        if self.input.echo is not None and not choice.token_ids and not choice.text:
            text = self.input.echo + text
        if self._streams is not None:
            stream = self._streams[chunk["index"]]
            text, calls = stream.feed(text)
            if chunk["finished"]:
                text += stream.flush()
        finish_reason = chunk["finish_reason"]
        if finish_reason == "stop" and (calls or choice.calls):
            finish_reason = "tool_calls"
        choice.text += text
        choice.token_ids += chunk["token_ids"]
        choice.calls += calls
        if chunk["logprobs"] is not None:
            choice.logprobs = (choice.logprobs or []) + chunk["logprobs"]
        choice.finish_reason = finish_reason
        choice.num_output_tokens = chunk["num_output_tokens"]
        self.num_prompt_tokens = chunk["num_prompt_tokens"]
        logprobs = chunk["logprobs"] if self.input.logprobs_wanted else None
        return ChoiceDelta(choice.index, text, chunk["token_ids"], logprobs, calls, finish_reason)

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
    ):
        self.replicas, self.metrics, self.model_name = replicas, metrics, model_name
        self.max_migrations = max_migrations
        self.tokenizer, self.vocab_size, self.chat_template = tokenizer, vocab_size, chat_template
        self._api_keys = [key.encode() for key in api_keys or []]
        # Templating and tokenizing run off the event loop that streams every other
        # request's tokens; one thread, since a HF tokenizer must not be used concurrently.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenizer")

    def check_auth(self, authorization: str | None) -> None:
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

    def check_model(self, model: str | None) -> None:
        """None (allowed on /tokenize and /detokenize, as in vLLM) means this server's model."""
        if model is not None and model != self.model_name:
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
        self.check_model(body.model)
        if isinstance(body.prompt, str):
            prompt = (await self.in_tokenizer_thread(self.tokenizer, body.prompt)).input_ids
        else:
            self.check_token_ids(body.prompt, "prompt")
            prompt = body.prompt
        echo = None
        if body.echo:
            if body.logprobs is not None:
                raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
            echo = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(body.prompt)
        structured = _structured(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default here
        return self._engine_input(body, prompt, max_tokens, body.logprobs, structured, echo=echo)

    async def chat_input(self, body: ChatCompletionRequest) -> EngineInput:
        self.check_model(body.model)
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
        return self._engine_input(body, prompt, max_tokens, body.num_logprobs, structured, tools=bool(tools))

    def _engine_input(
        self,
        body,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        structured: dict | None,
        echo: str | None = None,
        tools: bool = False,
    ) -> EngineInput:
        fields = body.sampling_fields()
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
        try:
            params = SamplingParams(**fields)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e)) from None
        return EngineInput(prompt, params.as_dict(), choices, logprobs_wanted, echo, tools)

    async def start(self, engine_input: EngineInput) -> Generation:
        llm = self.replicas.pick(engine_input.prompt, engine_input.params)
        return await start_generation(
            llm, self.metrics, engine_input.prompt, engine_input.params, self.max_migrations
        )


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
