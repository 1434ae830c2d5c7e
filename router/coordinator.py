"""The coordinator: one named Ray actor per application that holds every replica's
latest KV stats. Replicas push about every 100 ms; routers and the metrics endpoint
read snapshots. A replica that stops reporting is forgotten."""

import time

import ray

NAMESPACE = "kvserve"
DEFAULT_STALE_AFTER_S = 2.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node only


@ray.remote(num_cpus=0)
class Coordinator:
    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S):
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[float, dict]] = {}

    def report(self, replica_id: str, stats: dict) -> None:
        self._latest[replica_id] = (time.monotonic(), stats)

    def forget(self, replica_id: str) -> None:
        self._latest.pop(replica_id, None)

    def snapshot(self) -> dict[str, dict]:
        """Latest stats of every replica heard from within stale_after_s. Each report's
        `age_s` (how old it was when sent) grows by the time it has waited here: ages,
        unlike times of day, mean the same on every node, whatever its clock says."""
        now = time.monotonic()
        for replica_id in [r for r, (t, _) in self._latest.items() if t < now - self.stale_after_s]:
            del self._latest[replica_id]
        return {
            r: {**stats, "age_s": stats.get("age_s", 0.0) + now - t} for r, (t, stats) in self._latest.items()
        }


def coordinator_address(app_name: str) -> tuple[str, str]:
    """(namespace, actor name) of an application's coordinator."""
    return NAMESPACE, f"coordinator:{app_name}"


def get_coordinator(address: tuple[str, str]) -> ray.actor.ActorHandle:
    """The coordinator at `address`, created by whoever asks first.

    Detached, so it does not die with the actor that happened to create it, and on the
    head node, which autoscaling never removes; get_if_exists makes concurrent first
    calls agree on one actor."""
    namespace, name = address
    return Coordinator.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote()
