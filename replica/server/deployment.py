"""The Ray Serve deployment that owns one engine and streams its outputs.

The engine runs on its own thread (replica/server/engine_loop.py) and steps back to back; its
outputs reach the per-request streams (replica/server/streams.py) on this replica's event
loop, and leave as wire.StreamChunks (replica/server/stream_chunks.py). A stream that the
caller drops (disconnect, cancel, timeout) aborts its engine request, so its KV blocks
are free again after the current step. The replica's report goes to the coordinator
from a thread of its own (replica/server/report_pusher.py).
"""

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import ray
import torch
from ray import serve

from replica.config import EngineConfig
from replica.cpu.affinity import BURST_MIN_TOKENS, CorePlan, release_openmp_threads
from replica.engine import Engine
from replica.lora.weights import AdapterWeights
from replica.server.engine_loop import EngineLoop
from replica.server.report_pusher import PUSH_INTERVAL_S, ReportPusher
from replica.server.stream_chunks import stream_chunks
from replica.server.streams import RequestStreams
from replica.versions import check_versions
from wire.lora_request import LoRARequest
from wire.messages import EngineStepError, GenerateRequest, ReplicaReport, StreamChunk

logger = logging.getLogger(__name__)

# 4096 hashes x 16 bytes: 64 KiB per push, enough for 64k cached tokens at block size 16.
CACHED_HASHES_REPORTED = 4096


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class LLMServer:
    def __init__(
        self,
        engine_args: dict | None = None,
        coordinator: tuple[str, str] | None = None,
        versions: dict[str, str] | None = None,
    ):
        """coordinator: (namespace, name) of the named actor to push reports to. versions:
        kvserve's and Ray's where the application was built; this replica must run them."""
        check_versions(versions, "replica")
        self.engine = Engine(EngineConfig.from_kwargs(**(engine_args or {})))
        cores = self.engine.config.cpu_cores
        self.shared_rows = 0
        if cores is not None and self.engine.device_type == "cpu":
            plan = CorePlan.resolve(cores, shared_rows=self.engine.rows_sharing_work())
            self.shared_rows = plan.shared_rows
            plan.pin_for_step(1)  # before the engine's thread starts, as for a decode step
            self.engine.pin_to_cores(plan)
            logger.info(
                f"pinned to CPU cores {plan.steady}; steps of up to {plan.shared_rows} "
                f"or at least {BURST_MIN_TOKENS} tokens on {plan.burst}"
            )
        self.engine.warm_up()  # before Serve counts the replica as ready
        # From here the engine's own thread runs its parallel regions; this one lives on.
        release_openmp_threads()
        replica_id = serve.get_replica_context().replica_id
        self.replica_id, self.deployment = replica_id.unique_id, replica_id.deployment_id.name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.reports = ReportPusher(self.replica_id, self._build_report())
        self.streams = RequestStreams()
        self.engine_loop = EngineLoop(
            self.engine,
            on_outputs=self.streams.hand_over,
            on_step_error=self._fail_all,
            on_tick=self._refresh_report,
            idle_tick_s=PUSH_INTERVAL_S,
        )
        if coordinator is not None:
            self.reports.start(coordinator)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Stream one request's output: each chunk is what one of its samples produced
        since the last send. Bad prompts or values raise ValueError before anything is
        streamed."""
        request_id = request.request_id or uuid.uuid4().hex
        stream = self.streams.open(request_id)
        unfinished = request.sampling.n  # samples; each chunk carries one sample's new output
        try:
            if request.lora is not None:
                await self._load_lora(request.lora)
            await self._call_engine(
                self.engine.add_request,
                request.prompt,
                request.sampling,
                request_id,
                request.resume_token_ids,
                request.priority,
                request.lora,
            )
            while unfinished:
                deltas = await stream.next_deltas()
                for chunk in stream_chunks(deltas, self.replica_id, self.engine.tokenizer):
                    unfinished -= chunk.finished
                    yield chunk
        finally:
            self.streams.close(request_id)
            if unfinished:
                # Not awaited: this also runs while the caller's task is being cancelled.
                self.engine_loop.call(self.engine.abort, request_id)

    async def _load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter where its request lands: its files are read on a thread of
        its own, so the engine keeps stepping the running requests meanwhile; only
        keeping it (add_lora) is the engine thread's."""
        if lora in await self._call_engine(self.engine.list_loras):
            return
        weights = await asyncio.to_thread(self._read_lora, lora)
        await self._call_engine(self.engine.add_lora, lora, weights)

    def _read_lora(self, lora: LoRARequest) -> AdapterWeights:
        """On a pooled thread, which lives on after the read."""
        try:
            return self.engine.read_lora(lora)
        finally:
            release_openmp_threads()

    async def stats(self) -> ReplicaReport:
        """This replica's report, fresh, without its cached block hashes."""
        return await self._call_engine(self._stats)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for deployments.autoscaling.KVPressurePolicy: a dict, as Serve
        asks."""
        stats = await self.stats()
        return {k: float(getattr(stats, k)) for k in ("kv_cache_usage", "num_waiting", "num_running")}

    async def check_health(self) -> None:
        """Serve replaces a replica whose check raises: its engine thread has stopped,
        or one of its tensor-parallel workers is gone (its steps fail from then on)."""
        if not self.engine_loop.is_alive():
            raise RuntimeError("the engine thread stopped")
        await self.engine.check_alive()

    def _stats(self) -> ReplicaReport:
        """Engine figures. Reads engine state, so it runs on the engine thread."""
        s = self.engine.stats()
        config = self.engine.config
        weights = self.engine.runner.weights
        spec = config.speculative_config
        return ReplicaReport(
            node_id=self.node_id,
            deployment=self.deployment,
            device=self.engine.device_type,
            tensor_parallel_size=config.tensor_parallel_size,
            block_size=config.block_size,
            max_model_len=self.engine.max_model_len,
            max_waiting=config.max_waiting,
            num_free_blocks=s.kv.num_free_blocks,
            num_total_blocks=s.kv.num_total_blocks,
            kv_cache_usage=s.kv.usage,
            prefix_cache_queries=s.kv.prefix_cache_queries,
            prefix_cache_hits=s.kv.prefix_cache_hits,
            num_host_blocks=s.kv.num_host_blocks,
            host_cache_queries=s.kv.host_cache_queries,
            host_cache_hits=s.kv.host_cache_hits,
            num_offloaded_blocks=s.kv.num_offloaded_blocks,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_pending_blocks=s.num_pending_blocks,
            num_preemptions=s.num_preemptions,
            loras=s.loras,
            running_loras=s.running_loras,
            waiting_loras=s.waiting_loras,
            max_loras=config.max_loras if config.enable_lora else 0,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            spec_decode=s.spec_decode,  # a copy: the push thread pickles it as the engine steps
            cpu_affinity=sorted(os.sched_getaffinity(0)),  # the engine thread's
            torch_threads=torch.get_num_threads(),
            shared_rows=self.shared_rows,
            weight_dtype=weights.quantization or weights.dtype,
            weight_bytes=weights.linear_bytes + weights.other_bytes,
            kv_cache_dtype=str(self.engine.runner.kv_dtype).removeprefix("torch."),
        )

    def _build_report(self) -> ReplicaReport:
        """The coordinator's view of this replica: its figures and the newest cached
        block hashes, bounded. On the engine thread, between steps."""
        return replace(
            self._stats(),
            cached_block_hashes=self.engine.cached_prefix_summary(CACHED_HASHES_REPORTED),
            host_block_hashes=self.engine.host_prefix_summary(CACHED_HASHES_REPORTED),
        )

    def _refresh_report(self) -> None:
        """On the engine thread, so the report reads engine state between steps. An
        adapter unloaded from the application (no longer registered) goes here too, once
        no request uses it."""
        if self.reports.is_due():
            registered = self.reports.registered_loras
            if registered is not None:
                self.engine.retain_loras(registered)
            self.reports.update(self._build_report())

    def _fail_all(self, error: Exception) -> None:
        """On the engine thread, after a failed step: abort and fail every request."""
        for request_id in self.streams.request_ids():
            self.engine.abort(request_id)
        self.streams.fail_all(EngineStepError(f"engine step failed: {error}"))

    async def _call_engine(self, fn, *args):
        return await asyncio.wrap_future(self.engine_loop.call(fn, *args))
