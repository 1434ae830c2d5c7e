"""A request in flight to a replica, shared by the HTTP and gRPC front ends: starting
it (so that bad input fails before any output is sent), iterating its chunks with
metrics, and mapping failures onto API errors.

A request that fails before its first token (its replica died, or its replica's waiting
queue was full) has produced nothing, so it is sent again, and Serve routes it to
another replica: Serve's router drops a replica whose actor died from its candidates.
Once tokens have gone out, a lost replica or a failed engine step moves the request to
another replica, which goes on after the tokens already sent (Generation)."""

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from router.metrics import RequestTimer, ServingMetrics
from wire.messages import EngineStepError, GenerateRequest, QueueFullError, StreamChunk

logger = logging.getLogger("ray.serve")

# Further attempts for a request that failed before its first token.
START_RETRIES = 2
# Moves of one request to another replica after its tokens began to stream.
DEFAULT_MAX_MIGRATIONS = 2


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
    """A request's stream of chunks. When its replica dies, or its engine fails, after
    tokens went out, the request moves to another replica as its prompt plus the
    tokens already sent (migration), up to max_migrations times: greedy and seeded
    streams go on exactly as they would have, and the client sees one stream."""

    first: StreamChunk
    stream: DeploymentResponseGenerator
    timer: RequestTimer
    llm: DeploymentHandle
    request: GenerateRequest
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    migrations: int = 0
    sent_token_ids: list[int] = field(default_factory=list)  # with n = 1
    finished: bool = False  # with n = 1

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """Every chunk, the first included; a failure that cannot migrate raises APIError."""
        chunk = self.first
        while True:
            self.timer.on_chunk(chunk)
            self.sent_token_ids += chunk.token_ids
            self.finished |= chunk.finished
            yield chunk
            try:
                chunk = await self.stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:
                if self._lost_after_its_last_chunk(e):
                    return
                if not self._may_migrate(e):
                    raise as_api_error(e) from e
                chunk = await self._migrate(e)

    def _lost_after_its_last_chunk(self, e: Exception) -> bool:
        """A replica that dies between sending a stream's last chunk and closing the
        stream has lost nothing: the client has its whole answer."""
        return isinstance(e, RayActorError) and self.request.sampling.n == 1 and self.finished

    def _may_migrate(self, e: Exception) -> bool:
        lost = isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), EngineStepError)
        single = self.request.sampling.n == 1 and not self.finished
        return lost and single and self.migrations < self.max_migrations

    async def _migrate(self, e: Exception) -> StreamChunk:
        self.migrations += 1
        self.timer.metrics.migrations.labels(self.timer.metrics.model_name).inc()
        logger.warning(
            "request lost its replica after %d tokens (%r); migration %d of at most %d",
            len(self.sent_token_ids),
            e,
            self.migrations,
            self.max_migrations,
        )
        _cancel(self.stream)
        # A copy: sent_token_ids goes on growing with the new replica's tokens.
        resumed = dataclasses.replace(self.request, resume_token_ids=list(self.sent_token_ids) or None)
        self.stream, first = await _open(self.llm, resumed)
        return first

    def cancel(self) -> None:
        """Idempotent; a cancelled stream aborts its engine request on the replica."""
        _cancel(self.stream)


async def start_generation(
    llm: DeploymentHandle,
    metrics: ServingMetrics,
    request: GenerateRequest,
    max_migrations: int = DEFAULT_MAX_MIGRATIONS,
) -> Generation:
    timer = metrics.timer(request.sampling.n)
    stream, first = await _open(llm, request)
    return Generation(first, stream, timer, llm, request, max_migrations)


async def _open(
    llm: DeploymentHandle, request: GenerateRequest
) -> tuple[DeploymentResponseGenerator, StreamChunk]:
    """A replica's stream and its first chunk, which surfaces validation errors before
    any byte is sent. A replica that fails before its first chunk has produced nothing,
    so the request is sent again; Serve routes it to another replica."""
    attempt = 0
    while True:
        attempt += 1
        stream = None
        try:
            stream = llm.options(stream=True).generate.remote(request)
            return stream, await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the replica returned no output", kind="server_error") from None
        except Exception as e:
            if stream is not None:
                _cancel(stream)
            if attempt > START_RETRIES or not _worth_retrying(e):
                raise as_api_error(e) from e
        await asyncio.sleep(0.1 * attempt)  # lets Serve's router notice a dead replica


def as_own_request() -> None:
    """Gives the calling task's Serve request context an internal request id of its own.
    Calls to the replicas inherit it from the client's request, and Serve's router indexes
    the calls it has yet to route by that id, so a second call routed concurrently for one
    client request (a rerank's documents) overwrote the first, which then never left. Call
    it first thing in a task of its own: the change stays in that task's context."""
    context = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(
        dataclasses.replace(context, _internal_request_id=uuid.uuid4().hex)
    )


def _worth_retrying(e: Exception) -> bool:
    return isinstance(e, RayActorError) or isinstance(getattr(e, "cause", None), QueueFullError)


def _cancel(stream: DeploymentResponseGenerator) -> None:
    # Cancelling a request that never reached a replica re-raises why it did not
    # (backpressure, no replicas); that error was already reported.
    with contextlib.suppress(Exception):
        stream.cancel()
