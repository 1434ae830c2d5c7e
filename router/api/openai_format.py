"""OpenAI's completion and chat completion objects, whole or as stream chunks, rendered
from the front end's choices (router/api/frontend.py): the OpenAI renderers behind
router/api/respond.py."""

import itertools
import time
import uuid

from router.api.frontend import Choice, ChoiceDelta, Choices, vllm_prompt_logprobs
from router.api.protocol import StreamOptions
from router.generation import APIError
from wire.messages import LogprobEntry, StreamChunk


class CompletionRenderer:
    """/v1/completions' text_completion objects, whole or as stream chunks; ChatRenderer
    puts messages where these put text."""

    named_events = False
    ends_with_done = True
    id_prefix = "cmpl-"
    whole_object = chunk_object = "text_completion"
    delta_field = "text"  # what a stream chunk's choice carries

    def __init__(self, model: str, choices: Choices, stream_options: StreamOptions | None = None):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model, self.choices = model, choices
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.created = int(time.time())

    def add(self, chunk: StreamChunk) -> None:
        self.choices.add(chunk)

    def opening(self) -> list[dict]:
        return []

    def feed(self, chunk: StreamChunk) -> list[dict]:
        d = self.choices.add(chunk)
        start = len(self.choices.samples[d.index].text) - len(d.text)  # the delta's text offset
        body = self._chunk(d.index, self._delta(d), d.finish_reason, self._logprobs(d.logprobs, start))
        if d.prompt_logprobs is not None:
            self._add_prompt_logprobs(body, body["choices"][0], d.prompt_logprobs)
        return [body]

    def fail(self, error: APIError) -> list[dict]:
        """OpenAI's error shape, as an event; [DONE] follows."""
        body = {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}
        return [{"error": body}]

    async def closing(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self._chunk(0, None, None, None), "choices": [], "usage": self.choices.usage()}]

    async def whole(self) -> dict:
        choices = [self._whole_choice(c) for c in self.choices.result()]
        body = {
            "id": self.id,
            "object": self.whole_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.choices.usage(),
        }
        if self.choices.input.prompt_logprobs_wanted and self.choices.prompt_logprobs is not None:
            for choice in choices:  # the prompt's, the same for every choice
                self._add_prompt_logprobs(body, choice, self.choices.prompt_logprobs)
        return body

    def _chunk(self, index: int, delta, finish_reason: str | None, logprobs: dict | None) -> dict:
        choice = {
            "index": index,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
            self.delta_field: delta,
        }
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def _delta(self, d: ChoiceDelta) -> str | dict:
        return d.text

    def _whole_choice(self, c: Choice) -> dict:
        return {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "logprobs": self._logprobs(c.logprobs),
            "text": c.text,
        }

    def _add_prompt_logprobs(self, body: dict, choice: dict, entries: list[LogprobEntry | None]) -> None:
        """vLLM's place on a completion: each choice."""
        choice["prompt_logprobs"] = vllm_prompt_logprobs(entries)

    def _logprobs(self, entries: list[LogprobEntry] | None, start: int = 0) -> dict | None:
        """start: the text offset of the entries' first token in the choice's text."""
        if entries is None:
            return None
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


class ChatRenderer(CompletionRenderer):
    """/v1/chat/completions' chat.completion objects: assistant messages, with tool calls."""

    id_prefix = "chatcmpl-"
    whole_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    delta_field = "delta"

    def opening(self) -> list[dict]:
        """Each choice's role comes first, as OpenAI sends it."""
        role = {"role": "assistant", "content": ""}
        return [self._chunk(index, role, None, None) for index in range(self.choices.input.choices)]

    def _delta(self, d: ChoiceDelta) -> dict:
        content = {"content": d.text}
        if d.calls:
            before = len(self.choices.samples[d.index].calls) - len(d.calls)
            content["tool_calls"] = [call.openai(i) for i, call in enumerate(d.calls, before)]
        return content

    def _whole_choice(self, c: Choice) -> dict:
        message = {"role": "assistant", "content": c.text if c.text or not c.calls else None}
        if c.calls:
            message["tool_calls"] = [call.openai() for call in c.calls]
        return {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "logprobs": self._logprobs(c.logprobs),
            "message": message,
        }

    def _add_prompt_logprobs(self, body: dict, choice: dict, entries: list[LogprobEntry | None]) -> None:
        """vLLM's place on a chat response: its top level."""
        body["prompt_logprobs"] = vllm_prompt_logprobs(entries)

    def _logprobs(self, entries: list[LogprobEntry] | None, start: int = 0) -> dict | None:
        if entries is None:
            return None
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


def batch_whole(wholes: list[dict]) -> dict:
    """One completion for a batch of prompts (OpenAI's and vLLM's): the prompts' choices
    in order, prompt i's n choices from index i * n, and usage summed."""
    choices = [choice for whole in wholes for choice in whole["choices"]]
    for index, choice in enumerate(choices):
        choice["index"] = index
    usage = {key: sum(whole["usage"][key] for whole in wholes) for key in wholes[0]["usage"]}
    return {**wholes[0], "choices": choices, "usage": usage}


def _text_offsets(tokens: list[str], start: int) -> list[int]:
    """As vLLM: each token's offset is the one before plus that token's string length."""
    return list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start)) if tokens else []
