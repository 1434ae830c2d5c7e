"""The coordinator: one named Ray actor per application that holds every replica's
latest report (replica/wire.py's ReplicaReport). Replicas push about every 100 ms;
routers and the metrics endpoint read snapshots. A replica that stops reporting is
forgotten."""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import ray

from replica.wire import ReplicaReport

logger = logging.getLogger("ray.serve")

NAMESPACE = "kvserve"
DEFAULT_STALE_AFTER_S = 2.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node only


@ray.remote(num_cpus=0)
class Coordinator:
    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S):
        self.stale_after_s = stale_after_s
        # replica id -> (when its report arrived, the report)
        self._latest: dict[str, tuple[float, ReplicaReport]] = {}

    def report(self, replica_id: str, report: ReplicaReport) -> None:
        self._latest[replica_id] = (time.monotonic(), report)

    def forget(self, replica_id: str) -> None:
        self._latest.pop(replica_id, None)

    def snapshot(self) -> dict[str, ReplicaReport]:
        """Latest report of every replica heard from within stale_after_s. Each report's
        `age_s` (how old it was when sent) grows by the time it has waited here: ages,
        unlike times of day, mean the same on every node, whatever its clock says."""
        now = time.monotonic()
        for replica_id in [r for r, (t, _) in self._latest.items() if t < now - self.stale_after_s]:
            del self._latest[replica_id]
        return {r: replace(report, age_s=report.age_s + now - t) for r, (t, report) in self._latest.items()}


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


async def follow_snapshots(
    address: tuple[str, str],
    interval_s: float,
    use: Callable[[dict[str, ReplicaReport], float], None],
    fallback: str,
) -> None:
    """Hand `use` the coordinator's snapshot, and when it was asked for (time.monotonic();
    each report is at least its age older than that), every interval. When that fails,
    `use` gets an empty snapshot (the caller falls back to `fallback`, which the warning
    names) and the coordinator is looked up again, which recreates it if it died. Ends
    with Ray: in a driver that holds a handle and then shuts Ray down, looking the
    coordinator up would start a new Ray (or join another cluster) behind its back."""
    loop = asyncio.get_running_loop()
    coordinator = None
    while ray.is_initialized():
        try:
            if coordinator is None:
                coordinator = await loop.run_in_executor(None, get_coordinator, address)
            asked_at = time.monotonic()
            # Not asyncio.wait_for: on Python 3.11 it returns the result of a call that
            # completes just as the task is cancelled, and this loop would then never end.
            async with asyncio.timeout(2.0):
                snapshot = await coordinator.snapshot.remote()
            use(snapshot, asked_at)
        except Exception as e:
            if coordinator is not None:
                logger.warning(f"lost the coordinator, {fallback} ({e!r})")
            coordinator = None
            use({}, time.monotonic())
        await asyncio.sleep(interval_s)
