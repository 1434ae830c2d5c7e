"""OpenAI's completion and chat completion objects, whole or as server-sent events,
rendered from the front end's choices (router/api/frontend.py)."""

import itertools
import json
import time
from collections.abc import AsyncIterator

from router.api.frontend import ChoiceDelta, Choices, vllm_prompt_logprobs
from router.generation import APIError, Generation
from wire.messages import LogprobEntry


class CompletionFormatter:
    """Renders the front end's choices as OpenAI completion / chat objects."""

    def __init__(self, response_id: str, model: str, chat: bool, choices: Choices):
        self.id, self.model, self.chat, self.choices = response_id, model, chat, choices
        self.created = int(time.time())

    def chunk(self, index: int, delta, finish_reason, logprobs) -> dict:
        choice = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = delta or ""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def delta(self, d: ChoiceDelta) -> dict:
        if self.chat:
            content = {"content": d.text}
            if d.calls:
                content["tool_calls"] = [
                    call.openai(i) for i, call in enumerate(d.calls, self._calls_before(d))
                ]
        else:
            content = d.text
        start = len(self.choices.samples[d.index].text) - len(d.text)  # the delta's text offset
        chunk = self.chunk(d.index, content, d.finish_reason, self._logprobs(d.logprobs, start))
        if d.prompt_logprobs is not None:
            self._add_prompt_logprobs(chunk, chunk["choices"][0], d.prompt_logprobs)
        return chunk

    def _add_prompt_logprobs(self, body: dict, choice: dict, entries: list[LogprobEntry | None]) -> None:
        """vLLM's places: on each completion choice; on a chat response, at its top level."""
        (body if self.chat else choice)["prompt_logprobs"] = vllm_prompt_logprobs(entries)

    def _calls_before(self, d: ChoiceDelta) -> int:
        return len(self.choices.samples[d.index].calls) - len(d.calls)

    def whole(self) -> dict:
        choices = []
        for c in self.choices.result():
            choice = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c.logprobs),
            }
            if self.chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": c.text if c.text or not c.calls else None,
                }
                if c.calls:
                    choice["message"]["tool_calls"] = [call.openai() for call in c.calls]
            else:
                choice["text"] = c.text
            choices.append(choice)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.choices.usage(),
        }
        if self.choices.input.prompt_logprobs_wanted and self.choices.prompt_logprobs is not None:
            for choice in choices:  # the prompt's, the same for every choice
                self._add_prompt_logprobs(body, choice, self.choices.prompt_logprobs)
        return body

    def _logprobs(self, entries: list[LogprobEntry] | None, start: int = 0) -> dict | None:
        """start: the text offset of the entries' first token in the choice's text."""
        if entries is None:
            return None
        if self.chat:
            content = [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": None,
                    "top_logprobs": [
                        {"token": t.token, "logprob": t.logprob, "bytes": None} for t in e.top_logprobs
                    ],
                }
                for e in entries
            ]
            return {"content": content}
        # Echoed prompts lead with their first token, which has no logprob (None, as OpenAI).
        tokens = [e.token for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                None if e.top_logprobs is None else {t.token: t.logprob for t in e.top_logprobs}
                for e in entries
            ],
            "text_offset": _text_offsets(tokens, start),
        }


async def completion_events(
    formatter: CompletionFormatter, generation: Generation, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events; closing early (client gone) cancels the replica stream. The
    status line is long gone when a replica fails mid-stream, so the failure arrives as
    an error event in OpenAI's error shape, then [DONE]."""
    try:
        if formatter.chat:
            for index in range(formatter.choices.input.choices):
                yield _event(formatter.chunk(index, {"role": "assistant", "content": ""}, None, None))
        try:
            async for chunk in generation.chunks():
                yield _event(formatter.delta(formatter.choices.add(chunk)))
        except APIError as e:
            yield _event(
                {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}
            )
        else:
            if include_usage:
                usage = formatter.choices.usage()
                yield _event({**formatter.chunk(0, None, None, None), "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        generation.cancel()


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _text_offsets(tokens: list[str], start: int) -> list[int]:
    """As vLLM: each token's offset is the one before plus that token's string length."""
    return list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start)) if tokens else []
