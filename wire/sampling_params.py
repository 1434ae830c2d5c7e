"""Per-request sampling settings, validated up front so bad values fail at submit time.

These checks are the only ones: the HTTP and gRPC front ends and the batch job build a
SamplingParams from what the client sent and report its ValueError as a 400."""

from dataclasses import asdict, dataclass, field

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_N = 16  # samples per request (n, best_of)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value


@dataclass
class StructuredOutputs:
    """Exactly one constraint on the output's text, as vLLM's structured outputs:
    a JSON schema, any JSON object, a regular expression, one of several strings, or a
    Lark grammar (llguidance's dialect, which may embed JSON schemas with %json)."""

    json: dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None]
        given += [self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar"
            )
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured outputs: json must be a JSON schema object")
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per sampled token
    # vLLM's: each prompt token's logprob (the first's is None) and top-n alternatives,
    # from the engine's own prefill (replica/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1  # samples of the prompt, sharing its prefilled KV blocks
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    structured_outputs: StructuredOutputs | None = None
    # With the engine's speculative_config: False opts this request out of speculation.
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # as sent over Ray or in a batch row
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _token_keys(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens < 2**63),
            f"max_tokens must be a positive 64-bit integer, got {self.max_tokens!r}",
        )
        check(
            _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}",
        )
        check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        check(
            _is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}",
        )
        check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}",
        )
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop must be a list of non-empty strings",
        )
        check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        check(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(
                _is_number(value) and -2 <= value <= 2,
                f"{name} must be in [-2, 2], got {value!r}",
            )
        check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}",
        )

        check(
            _is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}"
        )
        check(
            self.logit_bias is None
            or all(
                _is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values()
            ),
            f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        check(
            isinstance(self.speculative, bool), f"speculative must be true or false, got {self.speculative!r}"
        )
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs must be a StructuredOutputs or a dict of its fields",
        )

    def as_dict(self) -> dict:
        """Plain values, for sending to a replica (which builds its own SamplingParams)."""
        return asdict(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _token_keys(bias: dict) -> dict[int, float]:
    """logit_bias keys are token ids; JSON sends them as strings."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to numbers")
    try:
        return {int(k): v for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ValueError("logit_bias keys must be token ids") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
