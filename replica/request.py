"""A request's CPU-side state. The scheduler moves it between queues; the engine appends
the tokens it samples. All token bookkeeping follows one rule: the model must have
computed KV for `num_tokens - 1` tokens before the next token can be sampled.

The request owns everything that lives as long as it does: its detokenizer (with the
stop-string state), when seeded its random generator, and when constrained its grammar
matcher. One of n samples of a prompt is a request of its own, with its group's id
and its index in the group."""

import enum
import time
from dataclasses import dataclass, field

import llguidance
import torch

from kvcache.hashing import ROOT_HASH
from replica.detokenizer import IncrementalDetokenizer
from replica.spec_decode.acceptance import SpeculationState
from wire.lora_request import LoRARequest
from wire.outputs import CompletionOutput, RequestOutput, TokenLogprob
from wire.sampling_params import SamplingParams

PENDING = -1  # token_ids placeholder for a sampled token still on the device


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clipped to the context window
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # with the priority scheduling policy: lower values are served first
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    detokenizer: IncrementalDetokenizer | None = None  # the engine attaches one
    generator: torch.Generator | None = None  # seeded requests draw from their own stream
    # With async scheduling, sampled tokens not yet read from the device: the last
    # num_pending entries of token_ids are PENDING placeholders, filled in order.
    num_pending: int = 0
    pending_row: int = -1  # the newest placeholder's row in its launch's sampled tokens
    matcher: llguidance.LLMatcher | None = None  # structured outputs: the grammar's state
    group_id: str | None = None  # with n > 1: the id the caller knows; None: request_id
    index: int = 0  # which of the group's n samples
    # With params.prompt_logprobs: the entries read back so far (None for the first prompt
    # token), and the next prompt token whose entry a step is to compute. The latter moves
    # when a step is launched, so a recompute after preemption does not compute it again.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    next_prompt_logprob: int = 1
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # Speculative decoding: the tokens proposed for its next step (verified there, never
    # part of token_ids until accepted), and whether and when it speculates.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None  # [len(spec_token_ids), V]: the proposer's q
    speculation: SpeculationState = field(default_factory=SpeculationState)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def block_hash_root(self) -> bytes:
        """Where its block hashes chain from: its adapter's KV is not the base model's."""
        return ROOT_HASH if self.lora is None else self.lora.block_hash_root

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still to be computed: until then, its prefill
        must run over every prompt token (no prefix-cache hits), since a cached block
        has KV but no logits."""
        return self.prompt_logprobs is not None and self.next_prompt_logprob < self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known on the host (no placeholders)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, pending ones included."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks its logits: the mask needs its previous token, so a step
        that samples it waits for that token (no async scheduling)."""
        return self.matcher is not None

    @property
    def edits_logits(self) -> bool:
        """Whether its logits are edited (a grammar or a logit bias) before sampling."""
        return self.matcher is not None or bool(self.params.logit_bias)

    def is_stop_token(self, token: int) -> bool:
        """Whether `token` ends the request by itself: an EOS token unless ignore_eos, or
        one of its stop_token_ids. A grammar decides where constrained output ends, so
        it overrides the stop tokens, as it does the stop strings."""
        if token in self.eos_token_ids and not self.params.ignore_eos:
            return True
        return self.matcher is None and token in self.params.stop_token_ids

    @property
    def caller_id(self) -> str:
        return self.group_id if self.group_id is not None else self.request_id

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def output(self) -> RequestOutput:
        """The whole result so far; built once, when the request finishes."""
        return RequestOutput(
            request_id=self.caller_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=self.index,
                    text=self.detokenizer.emitted_text if self.detokenizer is not None else "",
                    token_ids=self.output_token_ids,
                    finish_reason=self.finish_reason.value if self.finish_reason else None,
                    logprobs=self.logprobs,
                )
            ],
            num_cached_tokens=self.num_cached_tokens,
            finished=self.is_finished,
            prompt_logprobs=self.prompt_logprobs,
        )
