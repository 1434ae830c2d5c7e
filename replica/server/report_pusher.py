"""A replica's latest ReplicaReport, and the thread that pushes it to the coordinator.

The report is built on the engine thread, between steps, where it can read engine
state; this thread only sends the latest one, with its age, so a slow or missing
coordinator never holds up the engine."""

import threading
import time
from dataclasses import replace

import ray

from wire.messages import ReplicaReport

PUSH_INTERVAL_S = 0.1


class ReportPusher:
    def __init__(self, replica_id: str, report: ReplicaReport):
        self.replica_id = replica_id
        # (when it was built, the report): replaced whole, so the push thread reads a pair.
        self._latest: tuple[float, ReplicaReport] = (time.monotonic(), report)
        # The ids of the LoRA adapters the application has registered, as the coordinator
        # last answered (None: not heard yet): the replica drops loaded ones not among them.
        self.registered_loras: frozenset[int] | None = None

    def is_due(self) -> bool:
        """Whether the latest report is at least one push interval old."""
        return time.monotonic() - self._latest[0] >= PUSH_INTERVAL_S

    def update(self, report: ReplicaReport) -> None:
        self._latest = (time.monotonic(), report)

    def start(self, coordinator: tuple[str, str]) -> None:
        """coordinator: (namespace, name) of the named actor to push to."""
        threading.Thread(target=self._push, args=coordinator, name="kvserve-stats", daemon=True).start()

    def _push(self, namespace: str, name: str) -> None:
        """Send the latest report every PUSH_INTERVAL_S. Until the coordinator exists
        (the ingress creates it), or after it died, the replica keeps looking it up."""
        coordinator = None
        while True:  # a daemon thread: it ends with the replica process
            time.sleep(PUSH_INTERVAL_S)
            try:
                coordinator = coordinator or ray.get_actor(name, namespace=namespace)
                built_at, report = self._latest
                # Its age, not a time of day: routers on other nodes compare it with their
                # own clocks, which may be set differently from this node's.
                report = replace(report, age_s=time.monotonic() - built_at)
                # Waited on, so that a dead coordinator shows up as an error here.
                registered = ray.get(coordinator.report.remote(self.replica_id, report), timeout=2.0)
                self.registered_loras = frozenset(registered)
            except Exception:
                coordinator = None
