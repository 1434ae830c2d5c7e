"""Per-request sampling settings, validated up front so bad values fail at submit time."""

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
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
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be a positive integer, got {self.max_tokens!r}",
        )
        check(
            _is_number(self.temperature) and self.temperature >= 0,
            f"temperature must be >= 0, got {self.temperature!r}",
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
