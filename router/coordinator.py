"""The coordinator: one named Ray actor per application that holds every replica's
latest KV stats. Replicas push about every 100 ms; routers and the metrics endpoint
read snapshots. A replica that stops reporting is forgotten."""

import time

import ray

NAMESPACE = "kvserve"
DEFAULT_STALE_AFTER_S = 2.0


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
        """Latest stats of every replica heard from within stale_after_s."""
        cutoff = time.monotonic() - self.stale_after_s
        for replica_id in [r for r, (t, _) in self._latest.items() if t < cutoff]:
            del self._latest[replica_id]
        return {r: stats for r, (_, stats) in self._latest.items()}


def coordinator_address(app_name: str) -> tuple[str, str]:
    """(namespace, actor name) of an application's coordinator."""
    return NAMESPACE, f"coordinator:{app_name}"


def get_coordinator(address: tuple[str, str]) -> ray.actor.ActorHandle:
    """The coordinator at `address`, created by whoever asks first.

    Detached, so it does not die with the actor that happened to create it;
    get_if_exists makes concurrent first calls agree on one actor."""
    namespace, name = address
    return Coordinator.options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached"
    ).remote()
