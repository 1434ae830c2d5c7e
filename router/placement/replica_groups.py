"""Replicas of several shapes for one model in one application: say tensor-parallel
replicas on 2-GPU nodes beside single-GPU ones on 1-GPU nodes.

Ray Serve gives every replica of a deployment the same shape (its options and its
placement group bundles), so each shape is a deployment of its own: a replica group,
with its own KV router over its replicas. For each request the ingress picks the group
whose best replica the KV router's own ranking (router/placement/kv_router.py: room, then cost in
blocks net of the cached prefix) puts first, over every replica in the coordinator's
snapshot; that group's KV router then picks the replica. As in the KV router, a group
owes the blocks sent to it until its replicas report after them (spread over its
replicas), so a burst spreads over the groups instead of piling onto whichever looked
emptiest.
"""

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import dataclass

from ray.serve.handle import DeploymentHandle

from router.placement.coordinator import follow_snapshots
from router.placement.kv_router import (
    ARRIVAL_MARGIN_S,
    REFRESH_INTERVAL_S,
    ReplicaView,
    RoutedRequest,
    blocks_needed,
    placement,
)
from wire.messages import GenerateRequest, ReplicaReport


@dataclass
class SentBlocks:
    sent_at: float  # time.monotonic()
    blocks: int


class ReplicaGroups:
    def __init__(self, handles: list[DeploymentHandle], coordinator: tuple[str, str] | None):
        """handles: one per group (one: the plain case, a single deployment)."""
        self.handles = {handle.deployment_name: handle for handle in handles}
        self._coordinator_address = coordinator
        self._views: dict[str, dict[str, ReplicaView]] = {}  # group -> replica id -> view
        self._owed: dict[str, list[SentBlocks]] = defaultdict(list)  # group -> sent since its reports
        self._refresher: asyncio.Task | None = None

    def pick(self, request: GenerateRequest) -> DeploymentHandle:
        """The handle of the group to send this request to. Without reports from every
        group yet (start-up, coordinator gone) or for a text prompt: one at random."""
        if len(self.handles) == 1:
            return next(iter(self.handles.values()))
        if self._refresher is None and self._coordinator_address is not None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        routed = RoutedRequest.of(request)
        if routed is None or any(not self._views.get(name) for name in self.handles):
            return self.handles[random.choice(list(self.handles))]
        keys = {}
        for name in self.handles:
            views = self._views[name]
            owed = self._owed_blocks(name, views) // len(views)
            keys[name] = max(placement(routed, view, owed).key for view in views.values())
        best = max(keys.values())
        name = random.choice([n for n, key in keys.items() if key == best])
        blocks = min(blocks_needed(routed, view)[0] for view in self._views[name].values())
        self._owed[name].append(SentBlocks(time.monotonic(), blocks))
        return self.handles[name]

    def _owed_blocks(self, name: str, views: dict[str, ReplicaView]) -> int:
        """Blocks sent to the group that its replicas' reports cannot include yet."""
        horizon = min(view.reported_at for view in views.values()) - ARRIVAL_MARGIN_S
        self._owed[name] = [s for s in self._owed[name] if s.sent_at > horizon]
        return sum(s.blocks for s in self._owed[name])

    async def _refresh_forever(self) -> None:
        address = self._coordinator_address
        await follow_snapshots(address, REFRESH_INTERVAL_S, self._use_snapshot, "picking groups at random")

    def _use_snapshot(self, snapshot: dict[str, ReplicaReport], asked_at: float) -> None:
        views: dict[str, dict[str, ReplicaView]] = defaultdict(dict)
        for replica_id, report in snapshot.items():
            views[report.deployment][replica_id] = ReplicaView.from_report(report, asked_at)
        self._views = dict(views)
