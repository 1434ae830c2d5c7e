"""The engine's output side: a launched step's results, read back from the device, put
into their requests, and what is new for each caller as a RequestDelta.

Each sampled token fills its request's oldest placeholder (a launched token stays on the
device until its step is completed), then goes through the request's detokenizer and
grammar and the stop checks; a speculating request's verified tokens go in one by one
the same way. The engine owns its requests: the processor tells it when one ends
(finish) and when a sample group's first sample has its first token (release_samples:
its prefill has cached the prompt for the others)."""

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from replica.prompt_logprobs import PromptLogprobs
from replica.request import PENDING, FinishReason, Request
from replica.sampler import SamplerOutput
from replica.spec_decode.verify import Verified
from wire.outputs import RequestDelta, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step: the requests that sample, in row order, and their tokens, which
    stay on the device until the step is completed."""

    requests: list[Request]
    sampled: SamplerOutput | None
    prompt_logprobs: PromptLogprobs | None = None
    # Speculating requests' verified tokens, already on the host (such steps run in step).
    verified: list[tuple[Request, Verified]] = field(default_factory=list)


class OutputProcessor:
    def __init__(
        self,
        finish: Callable[[Request, FinishReason], None],
        release_samples: Callable[[str], None],
    ):
        """finish: ends a request in the engine. release_samples: admits a group's
        deferred samples, by the group's id. Both are the engine's methods, held weakly:
        the engine owns this processor, and a strong hold would make a cycle that keeps
        a dropped engine, its weights and its KV cache, until the collector's next pass."""
        self._finish = weakref.WeakMethod(finish)
        self._release_samples = weakref.WeakMethod(release_samples)

    def finish(self, request: Request, reason: FinishReason) -> None:
        self._finish()(request, reason)

    def release_samples(self, group_id: str) -> None:
        self._release_samples()(group_id)

    def update(self, launched: InFlight) -> list[RequestDelta]:
        """Read a launched step's results (waiting for the device) into its requests."""
        if launched.prompt_logprobs is not None:  # before the tokens: a first delta carries them
            launched.prompt_logprobs.resolve()
        outputs = [self._append_verified(r, v) for r, v in launched.verified if not r.is_finished]
        if launched.sampled is None:
            return outputs
        tokens, logprobs = launched.sampled.resolve()
        return outputs + [
            self.append_token(r, token, logprob)
            for r, token, logprob in zip(launched.requests, tokens, logprobs, strict=True)
            # Finished (stop, length or abort) while this token was in flight: it is dropped.
            if not r.is_finished
        ]

    def _append_verified(self, request: Request, verified: Verified) -> RequestDelta:
        """Append a verified proposal's tokens one by one, as sampled ones, up to the first
        that finishes the request; one delta carries them all."""
        deltas = []
        for i, token in enumerate(verified.token_ids):
            request.token_ids.append(PENDING)
            request.num_pending += 1
            logprob = verified.logprobs[i] if verified.logprobs is not None else None
            deltas.append(self.append_token(request, token, logprob))
            if request.is_finished:
                break
        return _merge_deltas(deltas)

    def append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestDelta:
        """Fill the request's oldest placeholder with its sampled token, then detokenize
        and check the stop conditions."""
        request.token_ids[len(request.token_ids) - request.num_pending] = token
        request.num_pending -= 1
        if logprob is not None:
            request.logprobs.append(logprob)
        update = request.detokenizer.add_token(token)
        new_text = update.new_text
        first = request.num_output_tokens == request.num_pending + 1
        if first and request.group_id is not None:  # its prefill is done: the prompt is cached
            self.release_samples(request.group_id)

        grammar_done = request.matcher is not None and _advance_grammar(request, token)
        reason = None
        if update.stopped or request.is_stop_token(token) or grammar_done:
            reason = FinishReason.STOP
        elif request.num_output_tokens - request.num_pending >= request.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            new_text += request.detokenizer.flush()
            self.finish(request, reason)
        return RequestDelta(
            request_id=request.caller_id,
            new_token_ids=[token],
            new_text=new_text,
            new_logprobs=None if logprob is None else [logprob],
            finish_reason=reason.value if reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens - request.num_pending,
            num_cached_tokens=request.num_cached_tokens,
            output=request.output() if reason else None,
            index=request.index,
            prompt_logprobs=request.prompt_logprobs if first else None,
        )


def _advance_grammar(request: Request, token: int) -> bool:
    """Feed the grammar its token; True once it is complete, which ends the request
    (even with ignore_eos: nothing more would be allowed)."""
    if not request.matcher.consume_token(token):
        logger.warning("grammar rejected token %d: %s", token, request.matcher.get_error())
        return True
    return request.matcher.is_stopped()


def _merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """One delta for several tokens appended in a row."""
    logprobs = None if deltas[0].new_logprobs is None else [lp for d in deltas for lp in d.new_logprobs]
    return replace(
        deltas[-1],
        new_token_ids=[t for d in deltas for t in d.new_token_ids],
        new_text="".join(d.new_text for d in deltas),
        new_logprobs=logprobs,
        prompt_logprobs=deltas[0].prompt_logprobs,
    )
