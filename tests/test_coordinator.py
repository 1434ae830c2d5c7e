import time

import ray

from router.placement.coordinator import Coordinator
from wire.messages import ReplicaReport


def report(num_free_blocks: int, age_s: float) -> ReplicaReport:
    return ReplicaReport(
        node_id="node",
        deployment="LLMServer",
        device="cpu",
        tensor_parallel_size=1,
        block_size=16,
        max_model_len=1024,
        max_waiting=None,
        num_free_blocks=num_free_blocks,
        num_total_blocks=8,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_running=0,
        num_waiting=0,
        num_pending_blocks=0,
        num_preemptions=0,
        cpu_affinity=[0],
        torch_threads=1,
        age_s=age_s,
    )


def test_snapshot_keeps_fresh_replicas_forgets_silent_ones_and_ages_reports(ray_cluster):
    coordinator = Coordinator.remote(stale_after_s=0.5)
    ray.get(coordinator.report.remote("a", report(3, age_s=0.02)))
    ray.get(coordinator.report.remote("b", report(5, age_s=0.0)))
    snapshot = ray.get(coordinator.snapshot.remote())
    assert {r: s.num_free_blocks for r, s in snapshot.items()} == {"a": 3, "b": 5}
    time.sleep(0.3)
    ray.get(coordinator.report.remote("a", report(2, age_s=0.05)))
    time.sleep(0.3)  # b last reported 0.6 s ago, a 0.3 s ago
    snapshot = ray.get(coordinator.snapshot.remote())
    assert list(snapshot) == ["a"] and snapshot["a"].num_free_blocks == 2
    # Its age: 0.05 s when sent, plus the 0.3 s (and a little) it waited here.
    assert 0.35 <= snapshot["a"].age_s < 1.0
    ray.get(coordinator.forget.remote("a"))
    assert ray.get(coordinator.snapshot.remote()) == {}
    ray.kill(coordinator)
