"""A request's CPU-side state. The scheduler moves it between queues; the engine appends
the tokens it samples. All token bookkeeping follows one rule: the model must have
computed KV for `num_tokens - 1` tokens before the next token can be sampled."""

import enum
import time
from dataclasses import dataclass, field

from replica.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clipped to the context window
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
