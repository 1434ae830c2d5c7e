"""A request in flight to a replica, shared by the HTTP and gRPC front ends: starting
it (so that bad input fails before any output is sent), iterating its chunks with
metrics, and mapping failures onto API errors.

A request that fails before its first token (its replica died, or its replica's waiting
queue was full) has produced nothing, so it is sent again, and Serve routes it to
another replica: Serve's router drops a replica whose actor died from its candidates.
Once a token has gone out, a failure ends the request with an error instead."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from replica.engine import QueueFullError
from router.metrics import RequestTimer, ServingMetrics

# Further attempts for a request that failed before its first token.
START_RETRIES = 2


class APIError(Exception):
    """An error for the client; `status` is the HTTP code, which gRPC maps to its own."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def as_api_error(e: Exception) -> APIError:
    cause = getattr(e, "cause", None) or e  # Ray wraps the replica's exception
    if isinstance(cause, ValueError):
        message = str(cause).strip().splitlines()[-1] if str(cause).strip() else "invalid request"
        return APIError(400, message)
    if isinstance(e, BackPressureError) or isinstance(cause, QueueFullError):
        return APIError(429, "the server is overloaded; retry later", kind="rate_limit_error")
    return APIError(503, f"replica unavailable: {type(e).__name__}", kind="server_error")


@dataclass
class Generation:
    first: dict
    stream: DeploymentResponseGenerator
    timer: RequestTimer

    async def chunks(self) -> AsyncIterator[dict]:
        """Every chunk, the first included; a replica failure raises APIError."""
        self.timer.on_chunk(self.first)
        yield self.first
        try:
            async for chunk in self.stream:
                self.timer.on_chunk(chunk)
                yield chunk
        except Exception as e:
            raise as_api_error(e) from e

    def cancel(self) -> None:
        """Idempotent; a cancelled stream aborts its engine request on the replica."""
        _cancel(self.stream)


async def start_generation(
    llm: DeploymentHandle, metrics: ServingMetrics, prompt: list[int], params: dict
) -> Generation:
    timer = metrics.timer(params.get("n", 1))
    attempt = 0
    while True:
        attempt += 1
        stream = None
        try:
            stream = llm.options(stream=True).generate.remote(prompt, params)
            first = await stream.__anext__()  # surfaces validation errors before any byte is sent
            return Generation(first, stream, timer)
        except StopAsyncIteration:
            raise APIError(500, "the replica returned no output", kind="server_error") from None
        except Exception as e:
            if stream is not None:
                _cancel(stream)
            if attempt > START_RETRIES or not _worth_retrying(e):
                raise as_api_error(e) from e
        await asyncio.sleep(0.1 * attempt)  # lets Serve's router notice a dead replica


def _worth_retrying(e: Exception) -> bool:
    return isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), QueueFullError)


def _cancel(stream: DeploymentResponseGenerator) -> None:
    # Cancelling a request that never reached a replica re-raises why it did not
    # (backpressure, no replicas); that error was already reported.
    with contextlib.suppress(Exception):
        stream.cancel()
