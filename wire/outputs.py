"""What the engine hands back. A step emits a RequestDelta per request that produced a
token: only what is new, so streaming costs O(1) per token however long the answer
gets. The whole RequestOutput is assembled once, when the request finishes."""

from dataclasses import dataclass, replace


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]
    rank: int | None = None  # 1 = the most likely token; set on prompt tokens' entries


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    logprobs: list[TokenLogprob] | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample (n), in index order
    num_cached_tokens: int
    finished: bool = True
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class RequestDelta:
    request_id: str  # the caller's: with n > 1, the same for every sample
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # set on the request's last delta
    num_prompt_tokens: int
    num_output_tokens: int  # so far, this delta included
    num_cached_tokens: int
    output: RequestOutput | None = None  # the whole result, on the last delta only
    index: int = 0  # which of the request's n samples
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the request's first delta only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_samples(outputs: list[RequestOutput]) -> RequestOutput:
    """One request's n samples, each finished as a RequestOutput of its own, as one."""
    first = min(outputs, key=lambda o: o.outputs[0].index)
    completions = sorted((o.outputs[0] for o in outputs), key=lambda c: c.index)
    return replace(first, outputs=completions, num_cached_tokens=min(o.num_cached_tokens for o in outputs))
