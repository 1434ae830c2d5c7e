"""What crosses between a replica and the ingress, the router or the coordinator is a
dataclass of wire/ (docs/architecture.md, "Typed messages between processes"): both
sides import wire/, so a message that changes shape changes for both, and neither side
needs the other's code (or torch) to unpickle it.

Checked on the signatures of the methods that are called across processes: every public
method of the replica's Serve deployment (LLMServer; the ingress streams `generate`,
Serve's controller calls `record_autoscaling_stats` and `check_health`, tests and tools
call `stats`) and of the coordinator actor (replicas push `report`, routers read
`snapshot`, the ingress registers adapters). Each parameter and each return is annotated,
and the annotation is built only from str, int, float, bool, bytes and None, lists,
dicts, tuples and (async) iterators of them, and wire/'s dataclasses. The constructors
are left out: the application is built by deployments/, not by a peer process."""

import dataclasses
import inspect
import types
import typing
from collections.abc import AsyncIterator, Iterator
from typing import Any

from replica.server.deployment import LLMServer
from router.placement.coordinator import Coordinator
from wire.messages import GenerateRequest, ReplicaReport, StreamChunk

# Ray's tracing adds this to every actor method's signature; no caller passes it.
RAY_PARAMETERS = {"self", "_ray_trace_ctx"}
PLAIN = (str, int, float, bool, bytes, type(None))
CONTAINERS = (list, dict, tuple, AsyncIterator, Iterator)
NOT_WIRE = "no builtin, typed container of them or wire/ dataclass"


def foreign_parts(hint) -> list[str]:
    """The parts of a type hint that are no builtin, no container of the allowed types
    and no wire/ dataclass: Any, a bare dict, a class of the engine's."""
    if hint in PLAIN:
        return []
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and hint.__module__.startswith("wire."):
        return []
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) or (origin in CONTAINERS and args):
        return [part for arg in args if arg is not Ellipsis for part in foreign_parts(arg)]
    return [getattr(hint, "__qualname__", repr(hint))]


def remote_methods(cls: type) -> dict[str, typing.Callable]:
    """The methods a peer process may call through a handle: the public ones."""
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def untyped_messages(cls: type) -> list[str]:
    """Each parameter or return of cls's remote methods that is unannotated, or that
    carries a type other than those a message may be built from."""
    found = []
    for name, method in remote_methods(cls).items():
        fn = inspect.unwrap(method)  # under Ray's tracing wrapper
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p not in RAY_PARAMETERS]
        for part in [*params, "return"]:
            where = f"{cls.__name__}.{name}: " + ("the return" if part == "return" else f"parameter {part!r}")
            if part not in hints:
                found.append(f"{where} is not annotated")
            elif foreign := foreign_parts(hints[part]):
                found.append(f"{where} carries {', '.join(foreign)}: {NOT_WIRE}")
    return found


def test_what_a_replica_and_its_callers_exchange_is_wire():
    replica = LLMServer.func_or_class  # the class under Serve's Deployment
    coordinator = Coordinator.__ray_metadata__.modified_class.__ray_actor_class__  # under Ray's ActorClass
    # The check reads the classes the router calls, not empty stand-ins.
    assert {"generate", "stats", "record_autoscaling_stats", "check_health"} <= set(remote_methods(replica))
    assert {"report", "snapshot", "register_lora"} <= set(remote_methods(coordinator))
    found = untyped_messages(replica) + untyped_messages(coordinator)
    assert not found, "messages across processes that are not wire/'s:\n" + "\n".join(found)


@dataclasses.dataclass
class LocalReport:
    """A dataclass, but of this module rather than wire/: only one side would import it."""

    num_free_blocks: int


class PlantedServer:
    """A replica whose methods pass what must not cross processes."""

    async def generate(
        self, request: GenerateRequest, options: dict[str, Any]
    ) -> AsyncIterator[StreamChunk]: ...

    def stats(self) -> LocalReport: ...

    def report(self, replica_id, report: ReplicaReport | None) -> dict: ...

    def snapshot(self) -> dict[str, ReplicaReport]: ...

    def _private(self, anything) -> Any:
        """Not callable through a handle, so not checked."""


def test_the_check_refuses_what_is_not_wire():
    assert untyped_messages(PlantedServer) == [
        f"PlantedServer.generate: parameter 'options' carries Any: {NOT_WIRE}",
        "PlantedServer.report: parameter 'replica_id' is not annotated",
        f"PlantedServer.report: the return carries dict: {NOT_WIRE}",
        f"PlantedServer.stats: the return carries LocalReport: {NOT_WIRE}",
    ]
