"""The Ray Serve deployment that owns one engine and streams its outputs.

The engine is synchronous and not thread-safe, so every call into it (add, abort,
step) runs on one dedicated thread; the replica's event loop only awaits that thread
and hands each step's outputs to the per-request queues. A stream that the caller
drops (disconnect, cancel, timeout) aborts its engine request, so its KV blocks are
free again after the current step.
"""

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import ray
from ray import serve

from replica.config import EngineConfig
from replica.engine import Engine
from replica.outputs import RequestDelta
from replica.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

STATS_PUSH_INTERVAL_S = 0.1
# 4096 hashes x 16 bytes: 64 KiB per push, enough for 64k cached tokens at block size 16.
CACHED_HASHES_REPORTED = 4096


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class LLMServer:
    def __init__(self, engine_args: dict | None = None, coordinator: tuple[str, str] | None = None):
        """coordinator: (namespace, name) of the named actor to push stats to."""
        self.engine = Engine(EngineConfig.from_kwargs(**(engine_args or {})))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._report = self._build_report()
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-engine")
        self._streams: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        if coordinator is not None:
            threading.Thread(
                target=self._push_stats, args=coordinator, name="kvserve-stats", daemon=True
            ).start()

    async def generate(
        self, prompt: str | list[int], params: dict | None = None, request_id: str | None = None
    ) -> AsyncIterator[dict]:
        """Stream one request's deltas: dicts with text, token_ids, finish_reason, ...

        Bad prompts or sampling values raise ValueError before anything is streamed."""
        sampling = SamplingParams(**(params or {}))
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self._call_engine(self.engine.add_request, prompt, sampling, request_id)
            self._start_loop()
            self._wakeup.set()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield _delta(item, self.replica_id)
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                # Not awaited: this also runs while the caller's task is being cancelled.
                self._engine_thread.submit(self.engine.abort, request_id)

    def _stats(self) -> dict:
        """Engine figures. Reads engine state, so it runs on the engine thread."""
        s = self.engine.stats()
        return {
            "block_size": self.engine.config.block_size,
            "max_model_len": self.engine.max_model_len,
            "max_waiting": self.engine.config.max_waiting,
            "num_free_blocks": s.kv.num_free_blocks,
            "num_total_blocks": s.kv.num_total_blocks,
            "kv_cache_usage": s.kv.usage,
            "prefix_cache_queries": s.kv.prefix_cache_queries,
            "prefix_cache_hits": s.kv.prefix_cache_hits,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_pending_blocks": s.num_pending_blocks,
            "num_preemptions": s.num_preemptions,
        }

    async def stats(self) -> dict:
        return await self._call_engine(self._stats)

    async def record_routing_stats(self) -> dict:
        """Polled by Serve and handed to request routers with each replica."""
        stats = await self.stats()
        keys = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting")
        return {k: stats[k] for k in keys}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for deployments.autoscaling.KVPressurePolicy."""
        stats = await self.stats()
        return {k: float(stats[k]) for k in ("kv_cache_usage", "num_waiting", "num_running")}

    def _build_report(self) -> dict:
        """The coordinator's view of this replica: stats, the newest cached block hashes
        (bounded), and the wall-clock time they were read, so that routers can tell which
        of their own recent routing decisions the figures already include. Built on the
        engine thread between steps; the push thread only sends the latest one."""
        return {
            **self._stats(),
            "cached_block_hashes": self.engine.kv.cached_prefix_summary(CACHED_HASHES_REPORTED),
            "reported_at": time.time(),
        }

    def _push_stats(self, namespace: str, name: str) -> None:
        """Send the latest report to the coordinator every STATS_PUSH_INTERVAL_S. Until
        the coordinator exists (the ingress creates it), or after it died, the replica
        keeps looking it up."""
        coordinator = None
        while True:  # a daemon thread: it ends with the replica process
            time.sleep(STATS_PUSH_INTERVAL_S)
            try:
                coordinator = coordinator or ray.get_actor(name, namespace=namespace)
                # Waited on, so that a dead coordinator shows up as an error here.
                ray.get(coordinator.report.remote(self.replica_id, self._report), timeout=2.0)
            except Exception:
                coordinator = None

    def check_health(self) -> None:
        if self._loop_task is not None and self._loop_task.done():
            raise RuntimeError(f"engine loop stopped: {self._loop_task.exception()!r}")

    async def _call_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    def _start_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def _engine_loop(self) -> None:
        while True:
            # Cleared before stepping, so a request added during the step is not missed.
            self._wakeup.clear()
            try:
                outputs, busy = await self._call_engine(self._step)
            except Exception as e:  # a failed step fails its requests, not the replica
                logger.exception("engine step failed")
                for request_id, queue in list(self._streams.items()):
                    queue.put_nowait(RuntimeError(f"engine step failed: {e}"))
                    self._engine_thread.submit(self.engine.abort, request_id)
                continue
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if not busy:
                # Idle: still tick now and then, so the report catches up with aborts.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout=STATS_PUSH_INTERVAL_S)

    def _step(self) -> tuple[list[RequestDelta], bool]:
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        if time.time() - self._report["reported_at"] >= STATS_PUSH_INTERVAL_S:
            self._report = self._build_report()
        return outputs, self.engine.has_unfinished()


def _delta(out: RequestDelta, replica_id: str) -> dict:
    return {
        "request_id": out.request_id,
        "replica_id": replica_id,
        "text": out.new_text,
        "token_ids": out.new_token_ids,
        "logprobs": None if out.new_logprobs is None else [asdict(lp) for lp in out.new_logprobs],
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": out.num_output_tokens,
        "num_cached_tokens": out.num_cached_tokens,
    }
