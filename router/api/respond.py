"""The one response path of the generating HTTP routes: a started generation, rendered by
its API's renderer (OpenAI chat and completions in router/api/openai_format.py, Anthropic
Messages in router/api/anthropic.py, Responses in router/api/responses_renderer.py), as one
JSON body or as server-sent events.

The renderers only shape answers; this module owns what every route must get right the
same way: the SSE framing, the replica header, and cancelling the replica's request once
the answer is out, the client went away, or the generation failed."""

import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi.responses import JSONResponse, StreamingResponse

from router.generation import APIError, Generation
from wire.messages import StreamChunk

# Which replica serves the request, for operators and for bench/serving.py's split.
REPLICA_HEADER = "x-kvserve-replica"
DONE = "data: [DONE]\n\n"


class Renderer(Protocol):
    """One API's answer, built from the replica's chunks. Each event is a dict that goes
    out as one server-sent event."""

    named_events: bool  # each event has an `event: <its type>` line (Anthropic's, Responses')
    ends_with_done: bool  # a stream ends with `data: [DONE]` (OpenAI's), after an error event too

    def add(self, chunk: StreamChunk) -> None:
        """One chunk of an answer that is not streamed."""

    def opening(self) -> list[dict]:
        """The events before the first chunk's."""

    def feed(self, chunk: StreamChunk) -> list[dict]:
        """One chunk's events."""

    def fail(self, error: APIError) -> list[dict]:
        """The events that end a stream whose generation failed: the status line is long
        gone, so the failure goes out as events."""

    async def closing(self) -> list[dict]:
        """The events after the last chunk's."""

    async def whole(self) -> dict:
        """The answer that is not streamed, once every chunk was added."""


async def respond(
    generation: Generation, renderer: Renderer, stream: bool
) -> JSONResponse | StreamingResponse:
    """The HTTP answer. Not streamed, a failure is an HTTP error in the API's shape (the
    app's exception handler), since no byte has gone out yet."""
    headers = {REPLICA_HEADER: generation.first.replica_id}
    if stream:
        events = _events(generation, renderer)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    await collect(generation, renderer)
    return JSONResponse(await renderer.whole(), headers=headers)


async def collect(generation: Generation, renderer: Renderer) -> None:
    """Adds every chunk to the renderer; the replica's request ends here whatever happens."""
    try:
        async for chunk in generation.chunks():
            renderer.add(chunk)
    finally:
        generation.cancel()


async def _events(generation: Generation, renderer: Renderer) -> AsyncIterator[str]:
    """Server-sent events. When the client goes away, Starlette cancels the stream, and
    the replica's request is cancelled with it; so it is on any error."""
    named = renderer.named_events
    try:
        for event in renderer.opening():
            yield _sse(event, named)
        try:
            async for chunk in generation.chunks():
                for event in renderer.feed(chunk):
                    yield _sse(event, named)
        except APIError as e:
            ending = renderer.fail(e)
        else:
            ending = await renderer.closing()
        for event in ending:
            yield _sse(event, named)
        if renderer.ends_with_done:
            yield DONE
    finally:
        generation.cancel()


def _sse(event: dict, named: bool) -> str:
    """One server-sent event; named: led by an `event:` line with the event's type."""
    data = json.dumps(event)
    return f"event: {event['type']}\ndata: {data}\n\n" if named else f"data: {data}\n\n"
