"""A replica's open request streams, filled from the engine thread's outputs.

The engine thread hands each step's outputs over in one callback onto the replica's
event loop, which appends them to their requests' streams. A stream keeps every delta
its request produced since its last send, so when the event loop falls behind the
engine, sends grow instead of the engine waiting."""

import asyncio
from dataclasses import dataclass, field

from wire.outputs import RequestDelta


@dataclass
class RequestStream:
    """One request's deltas not yet sent, or the error that ends it."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    deltas: list[RequestDelta] = field(default_factory=list)
    error: BaseException | None = None

    async def next_deltas(self) -> list[RequestDelta]:
        """Wait for deltas and take them all; raises the stream's error instead."""
        await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        deltas, self.deltas = self.deltas, []
        return deltas


class RequestStreams:
    """The streams of the requests in flight, by request id. `open` and `close` run on
    the event loop; `hand_over` and `fail_all` on the engine thread."""

    def __init__(self):
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # Serve's, set by the first open

    def open(self, request_id: str) -> RequestStream:
        self._loop = asyncio.get_running_loop()
        stream = self._streams[request_id] = RequestStream()
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    def hand_over(self, outputs: list[RequestDelta]) -> None:
        """On the engine thread: pass a step's outputs to the event loop, in one callback."""
        self._loop.call_soon_threadsafe(self._append, outputs)

    def fail_all(self, failure: BaseException) -> None:
        """On the engine thread: end every open stream with `failure`."""
        self._loop.call_soon_threadsafe(self._fail, failure)

    def _append(self, outputs: list[RequestDelta]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.deltas.append(out)
                stream.ready.set()

    def _fail(self, failure: BaseException) -> None:
        for stream in self._streams.values():
            stream.error = failure
            stream.ready.set()
