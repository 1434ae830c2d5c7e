"""A Serve autoscaling policy driven by KV-cache pressure and queueing.

Ongoing requests say little about an LLM replica: 200 short ones may fit easily and 5
long ones may fill its KV cache. Each replica reports its KV usage, running and waiting
requests (`LLMServer.record_autoscaling_stats`); this policy asks for enough replicas
to bring the summed KV usage under a target, plus one more while requests queue.
Serve applies min/max replicas and the up/down delays around it.
"""

import math

from ray.serve.config import AutoscalingContext


class KVPressurePolicy:
    def __init__(self, target_kv_usage: float = 0.7, max_waiting_per_replica: float = 1.0):
        if not 0 < target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {target_kv_usage}")
        self.target_kv_usage = target_kv_usage
        self.max_waiting_per_replica = max_waiting_per_replica

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        usage = metrics.get("kv_cache_usage", {})
        if not usage:  # nothing reported yet: keep the current target
            return ctx.target_num_replicas, {}
        return desired_replicas(
            current=ctx.current_num_replicas,
            kv_usage=list(usage.values()),
            waiting=list(metrics.get("num_waiting", {}).values()),
            target_kv_usage=self.target_kv_usage,
            max_waiting_per_replica=self.max_waiting_per_replica,
        ), {}


def desired_replicas(
    current: int,
    kv_usage: list[float],
    waiting: list[float],
    target_kv_usage: float,
    max_waiting_per_replica: float,
) -> int:
    """Replicas needed so that the KV in use sits at target_kv_usage of the total,
    and one more than now while the queues are longer than allowed."""
    by_kv = math.ceil(sum(kv_usage) / target_kv_usage - 1e-9)
    queueing = sum(waiting) > max_waiting_per_replica * max(current, 1)
    return max(by_kv, current + 1 if queueing else 0)
