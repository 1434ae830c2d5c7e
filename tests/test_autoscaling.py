"""Autoscaling on KV pressure: the policy's arithmetic. A real app that scales from 1 to 2
replicas under KV pressure and back to 1 when idle, each replica on a node the Ray
autoscaler starts for it, and failing and cutting short no request, is
tests/test_multinode.py's."""

from deployments.autoscaling import desired_replicas


def test_policy_sizes_by_kv_usage_and_queueing():
    assert desired_replicas(1, [0.9], [0], target_kv_usage=0.7, max_waiting_per_replica=1) == 2
    assert desired_replicas(2, [0.3, 0.3], [0, 0], target_kv_usage=0.7, max_waiting_per_replica=1) == 1
    assert desired_replicas(2, [0.7, 0.7], [0, 0], target_kv_usage=0.7, max_waiting_per_replica=1) == 2
    # Queues longer than allowed add a replica even when the KV figure looks fine.
    assert desired_replicas(1, [0.2], [3], target_kv_usage=0.7, max_waiting_per_replica=1) == 2
    assert (
        desired_replicas(3, [0.0, 0.0, 0.0], [0, 0, 0], target_kv_usage=0.7, max_waiting_per_replica=1) == 0
    )
