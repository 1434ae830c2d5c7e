"""/metrics counters built from replica reports: they never go down when a replica
dies or is scaled away (Prometheus would read a drop as a counter reset)."""

import re

from replica.wire import ReplicaReport
from router.metrics import REPLICA_COUNTERS, ServingMetrics


def metric_values(text: str) -> dict[str, float]:
    """Counter samples of a Prometheus exposition (one model, so one sample each)."""
    return {name: float(value) for name, value in re.findall(r"^(\S+_total)\{[^}]*\} (\S+)$", text, re.M)}


def report(queries: int, hits: int, preemptions: int) -> ReplicaReport:
    return ReplicaReport(
        node_id="n",
        deployment="LLMServer",
        device="cpu",
        tensor_parallel_size=1,
        block_size=16,
        max_model_len=2048,
        max_waiting=None,
        num_free_blocks=100,
        num_total_blocks=100,
        kv_cache_usage=0.0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_running=0,
        num_waiting=0,
        num_pending_blocks=0,
        num_preemptions=preemptions,
        cpu_affinity=[0],
        torch_threads=1,
    )


def test_counters_keep_the_counts_of_replicas_that_are_gone():
    metrics = ServingMetrics("m")
    names = [f"{name}_total" for name in REPLICA_COUNTERS]
    first = metric_values(metrics.exposition({"a": report(10, 4, 1), "b": report(6, 2, 0)}).decode())
    assert [first[n] for n in names] == [16, 6, 1]
    # a dies; b goes on; a replacement c starts from zero.
    later = metric_values(metrics.exposition({"b": report(9, 3, 2), "c": report(0, 0, 0)}).decode())
    assert [later[n] for n in names] == [19, 7, 3]
    # Everything scaled away: the totals stay.
    assert metric_values(metrics.exposition({}).decode()) == later
