"""/metrics counters built from replica reports: they never go down when a replica
dies or is scaled away (Prometheus would read a drop as a counter reset)."""

import re
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import HOST_TIER_COUNTERS, REPLICA_COUNTERS, ServingMetrics
from wire.messages import ReplicaReport
from wire.spec_decode_stats import SpecDecodeStats


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


def spec_samples(text: str) -> dict[tuple[str, str | None], float]:
    """vllm:spec_decode_* samples: (sample name, position label) -> value."""
    return {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("vllm:spec_decode")
        for s in family.samples
        if s.name.endswith("_total")
    }


def speculating(drafts: int, draft_tokens: int, per_pos: list[int], k: int = 4) -> ReplicaReport:
    stats = SpecDecodeStats(drafts, draft_tokens, sum(per_pos), per_pos)
    return replace(report(0, 0, 0), num_speculative_tokens=k, spec_decode=stats)


def test_spec_decode_counters_under_vllm_names_summed_over_replicas():
    metrics = ServingMetrics("m")
    # Without speculative_config anywhere: no vllm:spec_decode_* metric at all, as vLLM.
    assert spec_samples(metrics.exposition({"a": report(1, 0, 0)}).decode()) == {}
    # Configured but nothing proposed yet: zeros, one per position up to k.
    text = metrics.exposition({"a": report(1, 0, 0), "b": speculating(0, 0, [], k=3)}).decode()
    assert spec_samples(text) == {
        ("vllm:spec_decode_num_drafts_total", None): 0,
        ("vllm:spec_decode_num_draft_tokens_total", None): 0,
        ("vllm:spec_decode_num_accepted_tokens_total", None): 0,
        **{("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)): 0 for p in range(3)},
    }
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 0.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 0.0' in text
    reports = {"b": speculating(5, 20, [4, 3, 1]), "c": speculating(2, 8, [2, 2, 2, 1])}
    samples = spec_samples(metrics.exposition(reports).decode())
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 7
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == 28
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == 15
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)]
    assert per_pos == [6, 5, 3, 1]
    # b is gone and c scaled away: the counters keep their counts.
    assert spec_samples(metrics.exposition({}).decode()) == samples


def with_host_tier(queries: int, hits: int, offloaded: int) -> ReplicaReport:
    return replace(
        report(0, 0, 0),
        num_host_blocks=64,
        host_cache_queries=queries,
        host_cache_hits=hits,
        num_offloaded_blocks=offloaded,
    )


def test_host_tier_counters_appear_once_a_replica_has_a_tier_and_keep_their_counts():
    metrics = ServingMetrics("m")
    names = [f"{name}_total" for name in HOST_TIER_COUNTERS]
    assert not set(names) & set(metric_values(metrics.exposition({"a": report(1, 0, 0)}).decode()))
    values = metric_values(
        metrics.exposition({"a": with_host_tier(12, 5, 30), "b": report(0, 0, 0)}).decode()
    )
    assert [values[n] for n in names] == [12, 5, 30]
    assert "vllm:external_prefix_cache_hits_total" in names
    later = metric_values(metrics.exposition({"c": with_host_tier(2, 1, 3)}).decode())
    assert [later[n] for n in names] == [14, 6, 33]
