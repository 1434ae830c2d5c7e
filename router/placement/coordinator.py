"""The coordinator: one named Ray actor per application that holds every replica's
latest report (wire/messages.py's ReplicaReport). Replicas push about every 100 ms;
routers and the metrics endpoint read snapshots. A replica that stops reporting is
forgotten.

It also holds the application's LoRA adapters (name -> LoRARequest): every ingress
replica registers and resolves adapters here, so that one loaded through any of them
is served by all, and each report's answer tells the replica which adapters are still
registered."""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import ray

from wire.lora_request import LoRARequest
from wire.messages import ReplicaReport

logger = logging.getLogger("ray.serve")

NAMESPACE = "kvserve"
DEFAULT_STALE_AFTER_S = 2.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node only


class LoRANameTaken(ValueError):
    """An adapter of that name is registered already (the ingress answers 400)."""


class LoRARegistry:
    """Adapter name -> LoRARequest, under the coordinator's method names (the ingress
    keeps one of its own where it has no coordinator). Each registration gets an id of
    its own, so a name unloaded and loaded again (perhaps from other files) is never
    mistaken on a replica for what it loaded before. Ids start at the time in
    microseconds: a registry that was recreated (its coordinator died) does not hand
    out an id still loaded on some replica for another adapter."""

    def __init__(self) -> None:
        self._adapters: dict[str, LoRARequest] = {}
        self._next_id = time.time_ns() // 1000
        self._seeded: set[tuple[str, str]] = set()  # start-up adapters registered once

    def register_lora(self, name: str, path: str, replace_existing: bool = False) -> LoRARequest:
        """Raises LoRANameTaken when `name` is registered already."""
        if name in self._adapters and not replace_existing:
            raise LoRANameTaken(f"the LoRA adapter {name!r} has already been loaded")
        self._next_id += 1
        self._adapters[name] = LoRARequest(name, self._next_id, path)
        return self._adapters[name]

    def unregister_lora(self, name: str) -> bool:
        """False when no adapter of that name is registered."""
        return self._adapters.pop(name, None) is not None

    def lora(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def loras(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def seed_loras(self, modules: dict[str, str]) -> None:
        """Registers the start-up adapters (`--lora-modules`), each (name, path) once in
        this registry's life. Every ingress replica seeds at start, and again when it
        finds its coordinator recreated: a start-up adapter that a client unloaded stays
        unloaded, and one redeployed from another path replaces the old registration."""
        for name, path in modules.items():
            if (name, path) not in self._seeded:
                self._seeded.add((name, path))
                self.register_lora(name, path, replace_existing=True)


class ReportBook:
    """Every replica's latest report, under the coordinator's method names: what the
    coordinator holds, apart from Ray, so that its timing can be tested on a clock moved
    by hand. clock: where arrival and snapshot times are read (time.monotonic)."""

    def __init__(
        self, stale_after_s: float = DEFAULT_STALE_AFTER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after_s = stale_after_s
        self.clock = clock
        # replica id -> (when its report arrived, the report)
        self._latest: dict[str, tuple[float, ReplicaReport]] = {}

    def report(self, replica_id: str, report: ReplicaReport) -> None:
        self._latest[replica_id] = (self.clock(), report)

    def forget(self, replica_id: str) -> None:
        self._latest.pop(replica_id, None)

    def snapshot(self) -> dict[str, ReplicaReport]:
        """Latest report of every replica heard from within stale_after_s. Each report's
        `age_s` (how old it was when sent) grows by the time it has waited here: ages,
        unlike times of day, mean the same on every node, whatever its clock says."""
        now = self.clock()
        for replica_id in [r for r, (t, _) in self._latest.items() if t < now - self.stale_after_s]:
            del self._latest[replica_id]
        return {r: replace(report, age_s=report.age_s + now - t) for r, (t, report) in self._latest.items()}


@ray.remote(num_cpus=0)
class Coordinator:
    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S):
        self._reports = ReportBook(stale_after_s)
        self._loras = LoRARegistry()

    def report(self, replica_id: str, report: ReplicaReport) -> list[int]:
        """The registered adapters' ids: a replica drops loaded adapters not among them."""
        self._reports.report(replica_id, report)
        return [lora.lora_int_id for lora in self._loras.loras()]

    def register_lora(self, name: str, path: str) -> LoRARequest:
        """A new registration, with an id of its own; raises LoRANameTaken when `name`
        is registered already."""
        return self._loras.register_lora(name, path)

    def unregister_lora(self, name: str) -> bool:
        return self._loras.unregister_lora(name)

    def lora(self, name: str) -> LoRARequest | None:
        return self._loras.lora(name)

    def loras(self) -> list[LoRARequest]:
        return self._loras.loras()

    def seed_loras(self, modules: dict[str, str]) -> None:
        self._loras.seed_loras(modules)

    def forget(self, replica_id: str) -> None:
        self._reports.forget(replica_id)

    def snapshot(self) -> dict[str, ReplicaReport]:
        """ReportBook.snapshot: the fresh replicas' latest reports, aged by their wait here."""
        return self._reports.snapshot()


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
