"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

Latencies and token counts are measured where requests pass, in the ingress. Queue
and KV-cache figures are the sums of the replicas' latest reports to the coordinator.
Counters sum the latest count of every replica ever reported, gone ones included, so
that a replica's death or a scale-down never makes them go down (which Prometheus
would read as a reset).

With speculative decoding on (a replica reports num_speculative_tokens > 0; once one
has, the counters stay), vLLM's vllm:spec_decode_* counters: drafts verified, tokens
proposed, tokens accepted, and accepted tokens per draft position (label `position`).

With a host KV tier (a replica reports num_host_blocks > 0), its lookups and hits as
vLLM's vllm:external_prefix_cache_* counters, and kvserve:kv_offloaded_blocks.

With LoRA on, vLLM's `vllm:lora_requests_info` says which adapters the replicas' running
and waiting requests use, in its labels; its value is when that was last true (seconds
since the epoch), as vLLM sets it.
"""

import time
from collections.abc import Callable
from itertools import zip_longest

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from wire.messages import ReplicaReport, StreamChunk

# Prometheus counter -> (its count in a replica's report, help text).
REPLICA_COUNTERS: dict[str, tuple[Callable[[ReplicaReport], int], str]] = {
    "vllm:prefix_cache_queries": (lambda r: r.prefix_cache_queries, "Prefix-cache block lookups."),
    "vllm:prefix_cache_hits": (lambda r: r.prefix_cache_hits, "Prefix-cache block hits."),
    "vllm:num_preemptions": (lambda r: r.num_preemptions, "Preemptions by recompute."),
}
# The host KV tier's, once a replica reports one: its lookups and hits under vLLM's names
# for a cache outside the device's, and the blocks copied down.
HOST_TIER_COUNTERS: dict[str, tuple[Callable[[ReplicaReport], int], str]] = {
    "vllm:external_prefix_cache_queries": (
        lambda r: r.host_cache_queries,
        "Host KV tier block lookups (past the device cache's hits).",
    ),
    "vllm:external_prefix_cache_hits": (
        lambda r: r.host_cache_hits,
        "Host KV tier block hits, each copied back instead of recomputed.",
    ),
    "kvserve:kv_offloaded_blocks": (
        lambda r: r.num_offloaded_blocks,
        "Blocks copied to the host KV tier as the device cache evicted them.",
    ),
}
# Speculative decoding's counters, vLLM's names; accepted_per_pos is labelled by position.
SPEC_DECODE_COUNTERS: dict[str, tuple[Callable[[ReplicaReport], int], str]] = {
    "vllm:spec_decode_num_drafts": (lambda r: r.spec_decode.num_drafts, "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": (
        lambda r: r.spec_decode.num_draft_tokens,
        "Number of draft tokens.",
    ),
    "vllm:spec_decode_num_accepted_tokens": (
        lambda r: r.spec_decode.num_accepted_tokens,
        "Number of accepted tokens.",
    ),
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServingMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._snapshot: dict[str, ReplicaReport] = {}
        self._counts: dict[str, dict[str, float]] = {}  # replica -> counter name -> latest
        self._per_pos: dict[str, list[int]] = {}  # replica -> accepted tokens per draft position
        # The most tokens a replica has reported proposing per step (0: no speculation yet).
        self._num_speculative_tokens = 0
        self._host_tier = False  # whether a replica has reported a host KV tier
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.migrations = Counter(
            "kvserve:request_migrations",
            "Streams moved to another replica after theirs died mid-stream.",
            labels,
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, end to end.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.registry.register(self)  # collect() below adds the replica-derived metrics

    def exposition(self, snapshot: dict[str, ReplicaReport]) -> bytes:
        self._snapshot = snapshot
        for replica_id, report in snapshot.items():
            counts = self._counts.setdefault(replica_id, {})
            for name, (count, _) in REPLICA_COUNTERS.items():
                counts[name] = max(counts.get(name, 0), count(report))
            if report.num_host_blocks:
                self._host_tier = True
                for name, (count, _) in HOST_TIER_COUNTERS.items():
                    counts[name] = max(counts.get(name, 0), count(report))
            if report.num_speculative_tokens:
                self._num_speculative_tokens = max(
                    self._num_speculative_tokens, report.num_speculative_tokens
                )
                for name, (count, _) in SPEC_DECODE_COUNTERS.items():
                    counts[name] = max(counts.get(name, 0), count(report))
                kept = zip_longest(self._per_pos.get(replica_id, []), report.spec_decode.accepted_per_pos)
                self._per_pos[replica_id] = [max(a or 0, b or 0) for a, b in kept]
        return generate_latest(self.registry)

    def collect(self):
        reports = list(self._snapshot.values())
        total = sum(r.num_total_blocks for r in reports)
        free = sum(r.num_free_blocks for r in reports)
        gauges = {
            "vllm:num_requests_running": (
                "Requests in the model's batch.",
                sum(r.num_running for r in reports),
            ),
            "vllm:num_requests_waiting": ("Requests queued.", sum(r.num_waiting for r in reports)),
            "vllm:kv_cache_usage_perc": ("KV-cache usage, 1 = full.", 1 - free / total if total else 0.0),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        for name, (_, doc) in REPLICA_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], sum(counts[name] for counts in self._counts.values()))
            yield c
        if self._host_tier:
            for name, (_, doc) in HOST_TIER_COUNTERS.items():
                c = CounterMetricFamily(name, doc, labels=["model_name"])
                c.add_metric([self.model_name], sum(counts.get(name, 0) for counts in self._counts.values()))
                yield c
        if self._num_speculative_tokens:
            yield from self._spec_decode_counters()
        lora = [r for r in reports if r.max_loras]
        if lora:
            yield lora_requests_info(lora)

    def _spec_decode_counters(self):
        for name, (_, doc) in SPEC_DECODE_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], sum(counts.get(name, 0) for counts in self._counts.values()))
            yield c
        c = CounterMetricFamily(
            PER_POS, "Accepted tokens per draft position.", labels=["model_name", "position"]
        )
        positions = max(self._num_speculative_tokens, *map(len, self._per_pos.values()))
        for position in range(positions):
            total = sum(pos[position] for pos in self._per_pos.values() if position < len(pos))
            c.add_metric([self.model_name, str(position)], total)
        yield c

    def timer(self, samples: int = 1) -> "RequestTimer":
        return RequestTimer(self, samples)


def lora_requests_info(reports: list[ReplicaReport]) -> GaugeMetricFamily:
    """vLLM's gauge over the replicas that serve LoRA: the adapters of their running and
    of their waiting requests (comma-separated names), and the most adapters one step
    takes; its value is when the newest of those reports was made."""
    gauge = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    running = sorted({name for r in reports for name in r.running_loras})
    waiting = sorted({name for r in reports for name in r.waiting_loras})
    max_lora = str(max(r.max_loras for r in reports))
    updated = time.time() - min(r.age_s for r in reports)
    gauge.add_metric([max_lora, ",".join(waiting), ",".join(running)], updated)
    return gauge


class RequestTimer:
    """Follows one request's chunks (of its n samples) and records its latencies and
    tokens; the prompt counts once, and the request ends with its last sample."""

    def __init__(self, metrics: ServingMetrics, samples: int = 1):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        self.unfinished = samples

    def on_chunk(self, chunk: StreamChunk) -> None:
        now = time.perf_counter()
        label = self.metrics.model_name
        if self.first:
            self.metrics.ttft.labels(label).observe(now - self.start)
            self.first = False
        elif chunk.token_ids:
            self.metrics.itl.labels(label).observe((now - self.last) / len(chunk.token_ids))
        self.last = now
        if chunk.finished:
            self.unfinished -= 1
            self.metrics.generation_tokens.labels(label).inc(chunk.num_output_tokens)
            if chunk.index == 0:
                self.metrics.prompt_tokens.labels(label).inc(
                    chunk.num_prompt_tokens - chunk.num_cached_tokens
                )
            if not self.unfinished:
                self.metrics.e2e.labels(label).observe(now - self.start)
