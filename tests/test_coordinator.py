import time

import ray

from router.coordinator import Coordinator


def test_snapshot_keeps_fresh_replicas_and_forgets_silent_ones(ray_cluster):
    coordinator = Coordinator.remote(stale_after_s=0.5)
    ray.get(coordinator.report.remote("a", {"num_free_blocks": 3}))
    ray.get(coordinator.report.remote("b", {"num_free_blocks": 5}))
    assert ray.get(coordinator.snapshot.remote()) == {
        "a": {"num_free_blocks": 3},
        "b": {"num_free_blocks": 5},
    }
    time.sleep(0.3)
    ray.get(coordinator.report.remote("a", {"num_free_blocks": 2}))
    time.sleep(0.3)  # b last reported 0.6 s ago, a 0.3 s ago
    assert ray.get(coordinator.snapshot.remote()) == {"a": {"num_free_blocks": 2}}
    ray.get(coordinator.forget.remote("a"))
    assert ray.get(coordinator.snapshot.remote()) == {}
    ray.kill(coordinator)
