"""What the engine hands back each step: cumulative results plus the delta since the
request's previous output, so both offline callers and streamers are served."""

from dataclasses import dataclass

from replica.request import TokenLogprob


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[TokenLogprob] | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_text: str
    new_token_ids: list[int]
    num_cached_tokens: int

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
