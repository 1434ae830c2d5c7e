"""The Ray Serve deployment that owns one engine and streams its outputs.

The engine runs on its own thread (replica/engine_loop.py) and steps back to back; each
step's outputs are handed to this replica's event loop, which appends them to the
per-request streams. A stream sends everything its request produced since its last
send as one item, so when the event loop falls behind the engine, items grow instead of
the engine waiting. A stream that the caller drops (disconnect, cancel, timeout)
aborts its engine request, so its KV blocks are free again after the current step.
"""

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray
import torch
from ray import serve

from replica.config import EngineConfig
from replica.cpu.affinity import CorePlan, pin_process
from replica.engine import Engine, EngineStepError
from replica.engine_loop import EngineLoop
from replica.outputs import RequestDelta, TokenLogprob
from replica.sampling_params import SamplingParams
from replica.versions import check_versions

logger = logging.getLogger(__name__)

STATS_PUSH_INTERVAL_S = 0.1
# 4096 hashes x 16 bytes: 64 KiB per push, enough for 64k cached tokens at block size 16.
CACHED_HASHES_REPORTED = 4096


@dataclass
class _Stream:
    """One request's deltas not yet sent, filled from the engine's outputs."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    deltas: list[RequestDelta] = field(default_factory=list)
    error: BaseException | None = None


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class LLMServer:
    def __init__(
        self,
        engine_args: dict | None = None,
        coordinator: tuple[str, str] | None = None,
        versions: dict[str, str] | None = None,
    ):
        """coordinator: (namespace, name) of the named actor to push stats to. versions:
        kvserve's and Ray's where the application was built; this replica must run them."""
        check_versions(versions, "replica")
        self.engine = Engine(EngineConfig.from_kwargs(**(engine_args or {})))
        cores = self.engine.config.cpu_cores
        if cores is not None and self.engine.runner.device.type == "cpu":
            plan = CorePlan.resolve(cores)
            pin_process(plan.steady)  # before the engine's thread starts
            self.engine.runner.cores = plan
            logger.info(f"pinned to CPU cores {plan.steady}, bursts of prefill on {plan.burst}")
        self.engine.warm_up()  # before Serve counts the replica as ready
        replica_id = serve.get_replica_context().replica_id
        self.replica_id, self.deployment = replica_id.unique_id, replica_id.deployment_id.name
        self.node_id = ray.get_runtime_context().get_node_id()
        self._report = self._build_report()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # Serve's, set by the first call
        self._engine = EngineLoop(
            self.engine,
            on_outputs=self._hand_over,
            on_step_error=self._fail_all,
            on_tick=self._refresh_report,
            idle_tick_s=STATS_PUSH_INTERVAL_S,
        )
        if coordinator is not None:
            threading.Thread(
                target=self._push_stats, args=coordinator, name="kvserve-stats", daemon=True
            ).start()

    async def generate(
        self,
        prompt: str | list[int],
        params: dict | None = None,
        request_id: str | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> AsyncIterator[dict]:
        """Stream one request's deltas: dicts with text, token_ids, finish_reason, ...
        resume_token_ids: the output another replica already streamed (migration).
        params: SamplingParams fields, and the request's `priority`, which is no sampling
        parameter but travels with them, so that a migrated request keeps it too.

        Bad prompts or sampling values raise ValueError before anything is streamed."""
        params = dict(params or {})
        priority = params.pop("priority", 0)
        sampling = SamplingParams(**params)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream()
        self._streams[request_id] = stream
        unfinished = sampling.n  # samples; each item carries one sample's new output
        try:
            await self._call_engine(
                self.engine.add_request, prompt, sampling, request_id, resume_token_ids, priority
            )
            while unfinished:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    raise stream.error
                deltas, stream.deltas = stream.deltas, []
                for index in sorted({d.index for d in deltas}):
                    item = _merged(
                        [d for d in deltas if d.index == index], self.replica_id, self.engine.tokenizer
                    )
                    unfinished -= item["finished"]
                    yield item
        finally:
            self._streams.pop(request_id, None)
            if unfinished:
                # Not awaited: this also runs while the caller's task is being cancelled.
                self._engine.call(self.engine.abort, request_id)

    def _stats(self) -> dict:
        """Engine figures. Reads engine state, so it runs on the engine thread."""
        s = self.engine.stats()
        return {
            "node_id": self.node_id,
            "deployment": self.deployment,  # which replica group (router/replica_groups.py)
            "device": self.engine.runner.device.type,
            "tensor_parallel_size": self.engine.config.tensor_parallel_size,
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
            "cpu_affinity": sorted(os.sched_getaffinity(0)),  # the engine thread's
            "torch_threads": torch.get_num_threads(),
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

    def _build_report(self) -> tuple[float, dict]:
        """(when it was built, the coordinator's view of this replica: stats and the
        newest cached block hashes, bounded). Built on the engine thread between steps;
        the push thread only sends the latest one, with its age."""
        return time.monotonic(), {
            **self._stats(),
            "cached_block_hashes": self.engine.kv.cached_prefix_summary(CACHED_HASHES_REPORTED),
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
                built_at, report = self._report
                # Its age, not a time of day: routers on other nodes compare it with their
                # own clocks, which may be set differently from this node's.
                report = {**report, "age_s": time.monotonic() - built_at}
                ray.get(coordinator.report.remote(self.replica_id, report), timeout=2.0)
            except Exception:
                coordinator = None

    async def check_health(self) -> None:
        """Serve replaces a replica whose check raises: its engine thread has stopped,
        or one of its tensor-parallel workers is gone (its steps fail from then on)."""
        if not self._engine.is_alive():
            raise RuntimeError("the engine thread stopped")
        if self.engine.runner.workers is not None:
            await self.engine.runner.workers.check_alive()

    async def _call_engine(self, fn, *args):
        self._loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._engine.call(fn, *args))

    def _hand_over(self, outputs: list[RequestDelta]) -> None:
        """On the engine thread: pass a step's outputs to the event loop, in one callback."""
        self._loop.call_soon_threadsafe(self._append, outputs)

    def _append(self, outputs: list[RequestDelta]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.deltas.append(out)
                stream.ready.set()

    def _fail_all(self, error: Exception) -> None:
        """On the engine thread, after a failed step: abort and fail every request."""
        failure = EngineStepError(f"engine step failed: {error}")
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        self._loop.call_soon_threadsafe(self._fail_streams, failure)

    def _fail_streams(self, failure: Exception) -> None:
        for stream in self._streams.values():
            stream.error = failure
            stream.ready.set()

    def _refresh_report(self) -> None:
        """On the engine thread, so the report reads engine state between steps."""
        if time.monotonic() - self._report[0] >= STATS_PUSH_INTERVAL_S:
            self._report = self._build_report()


def _merged(deltas: list[RequestDelta], replica_id: str, tokenizer) -> dict:
    """Several steps' deltas of one sample of a request as one stream item. Logprob
    entries carry their tokens' strings, so that decoding has one owner, the replica."""
    last = deltas[-1]
    logprobs = None
    if last.new_logprobs is not None:
        logprobs = [_logprob_entry(lp, tokenizer) for d in deltas for lp in d.new_logprobs]
    # With prompt_logprobs, once: on the sample's first delta (None for the first token).
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return {
        "request_id": last.request_id,
        "replica_id": replica_id,
        "index": last.index,
        "text": "".join(d.new_text for d in deltas),
        "token_ids": [t for d in deltas for t in d.new_token_ids],
        "logprobs": logprobs,
        "finished": last.finished,
        "finish_reason": last.finish_reason,
        "num_prompt_tokens": last.num_prompt_tokens,
        "num_output_tokens": last.num_output_tokens,
        "num_cached_tokens": last.num_cached_tokens,
        "prompt_logprobs": None if prompt is None else [_logprob_entry(lp, tokenizer) for lp in prompt],
    }


def _logprob_entry(lp: TokenLogprob | None, tokenizer) -> dict | None:
    """None stays None: the first prompt token's entry. Prompt tokens' entries add "rank"."""
    if lp is None:
        return None

    def token(token_id: int) -> str:
        return tokenizer.convert_ids_to_tokens(token_id)

    entry = {
        "token_id": lp.token_id,
        "token": token(lp.token_id),
        "logprob": lp.logprob,
        "top_logprobs": [
            {"token_id": t, "token": token(t), "logprob": v} for t, v in lp.top_logprobs.items()
        ],
    }
    if lp.rank is not None:
        entry["rank"] = lp.rank
    return entry
