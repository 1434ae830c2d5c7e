"""KV-aware request routing for the LLMServer deployment, as a Ray Serve RequestRouter.

Replicas push their free blocks and a bounded set of cached block hashes (their most
recently used ones; hashes are chained, so one reported block stands for its whole
prefix) to the coordinator; this router keeps a copy of the coordinator's snapshot,
refreshed in the background, so nothing on the request path waits on the coordinator.
For each request it ranks replicas by

1. whether they would accept it: replicas whose waiting queue is full (`max_waiting`)
   would refuse it, so they come last;
2. whether it fits: free KV blocks, less what the replica's own requests will still
   take, must cover the request's prompt (less its cached prefix) and its max_tokens;
3. then least cost, in KV blocks, as Dynamo's and llm-d's routers score: the load the
   replica already carries (blocks its requests hold or will still take) plus the
   prompt blocks it would have to prefill, which a cached prefix reduces. A shared
   system prompt therefore attracts requests only while the replica holding it is not
   busier by more than the prefill it saves;
4. among replicas with equal keys, one at random comes first (and the rest next),
   so that the router knows where the request will go (see below).

The snapshot is up to ~200 ms old, and a request routed just before a report may not
have reached the engine yet, so the router also keeps its own account of each
replica's load: the blocks it promised since the replica's last report, and the blocks
of its requests still in flight there (until Serve reports them completed). A
replica's load is the larger of the reported load plus the recent promises and the
router's in-flight blocks. Serve asks for rankings of a burst's requests before it has
routed any of them, so each ranking also reserves the request's blocks on the replica
it puts first, until Serve routes a request there (or half a second passes): a burst
spreads out instead of piling onto whichever replica looked emptiest. Ties are broken
here rather than by Serve for the same reason: Serve's queue lengths do not change
while it ranks a burst either, so it broke every tie of a burst the same way and sent
5 or 6 of 8 equal requests to one of 2 idle replicas (bench/serving.py, bursts).

Without a snapshot (coordinator gone, replica not yet heard from, or a text prompt the
router cannot hash) it falls back to power-of-two choices.
"""

import asyncio
import logging
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvcache.hashing import hash_full_blocks
from kvcache.kv_manager import cdiv
from router.coordinator import follow_snapshots

logger = logging.getLogger("ray.serve")

REFRESH_INTERVAL_S = 0.1
# A request routed less than this long before a report may not have reached the engine yet.
ARRIVAL_MARGIN_S = 0.05
DEBIT_TTL_S = 5.0
RESERVATION_TTL_S = 0.5


@dataclass
class ReplicaView:
    """What the router believes about one replica's KV cache."""

    block_size: int
    max_model_len: int
    free_blocks: int  # free now, less what admitted and waiting requests will still take
    total_blocks: int
    cached_hashes: frozenset[bytes]
    reported_at: float  # time.monotonic() on this router, less the report's age
    accepting: bool = True  # False while its waiting queue is at max_waiting

    @classmethod
    def from_report(cls, report: dict, asked_at: float) -> "ReplicaView":
        """asked_at: when this router asked for the report (time.monotonic())."""
        return cls(
            block_size=report["block_size"],
            max_model_len=report["max_model_len"],
            free_blocks=report["num_free_blocks"] - report["num_pending_blocks"],
            total_blocks=report["num_total_blocks"],
            cached_hashes=frozenset(report["cached_block_hashes"]),
            reported_at=asked_at - report["age_s"],
            accepting=report.get("max_waiting") is None or report["num_waiting"] < report["max_waiting"],
        )


@dataclass
class Debit:
    routed_at: float
    blocks: int


def cached_prefix_blocks(prompt_hashes: Sequence[bytes], view: ReplicaView) -> int:
    """Leading prompt blocks the replica has cached: up to the deepest prompt block whose
    hash it reported. Hashes are chained, so that hash vouches for every block before
    it, even ones missing from the report: a report is bounded to the most recently used
    blocks, and a prefix's earlier blocks can fall out of it while its later ones stay."""
    for depth in range(len(prompt_hashes), 0, -1):
        if prompt_hashes[depth - 1] in view.cached_hashes:
            return depth
    return 0


@dataclass
class RoutedRequest:
    prompt: list[int]
    max_tokens: int | None
    samples: int = 1  # n: each sample shares the prompt's full blocks, then grows its own
    _block_hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The prompt's chained block hashes, computed once per block size however many
        replicas are compared. Like the engine, the last token is never cacheable."""
        if block_size not in self._block_hashes:
            self._block_hashes[block_size] = hash_full_blocks(self.prompt[:-1], block_size)
        return self._block_hashes[block_size]


def blocks_needed(request: RoutedRequest, view: ReplicaView) -> tuple[int, int]:
    """(blocks the request may take on the replica, leading prompt blocks already cached
    there). Like the engine, an unset max_tokens means up to max_model_len; with n > 1
    samples, every sample after the first reuses the prompt's full blocks (the prefix
    cache) and needs the rest of its own."""
    hashes = request.block_hashes(view.block_size)
    hits = cached_prefix_blocks(hashes, view)
    prompt_len = len(request.prompt)
    room = max(0, view.max_model_len - prompt_len)
    final_blocks = cdiv(prompt_len + min(request.max_tokens or room, room), view.block_size)
    return final_blocks - hits + (request.samples - 1) * (final_blocks - len(hashes)), hits


def net_free_blocks(request: RoutedRequest, view: ReplicaView, promised_blocks: int) -> tuple[int, int]:
    """(free blocks left once this request has all it may take, leading prompt blocks
    already cached)."""
    need, hits = blocks_needed(request, view)
    return view.free_blocks - promised_blocks - need, hits


@dataclass(frozen=True)
class Placement:
    """How well one replica suits one request; `key` orders them, larger is better."""

    accepting: bool  # its waiting queue has room
    fits: bool  # its free blocks cover everything the request may take
    cost_blocks: int  # its load plus the prompt blocks it would prefill

    @property
    def key(self) -> tuple[bool, bool, int]:
        return (self.accepting, self.fits, -self.cost_blocks)


def placement(
    request: RoutedRequest, view: ReplicaView, promised_blocks: int, in_flight_blocks: int = 0
) -> Placement:
    """in_flight_blocks: what this router's own unfinished requests there may take."""
    net_free, hits = net_free_blocks(request, view, promised_blocks)
    load = max(view.total_blocks - view.free_blocks + promised_blocks, in_flight_blocks)
    prefill = cdiv(len(request.prompt), view.block_size) - hits
    return Placement(view.accepting, net_free >= 0, load + prefill)


def group_ranks(keys: dict[ReplicaID, tuple]) -> list[list[ReplicaID]]:
    """Replicas grouped by equal key, best key first."""
    groups: dict[tuple, list[ReplicaID]] = defaultdict(list)
    for replica_id, key in keys.items():
        groups[key].append(replica_id)
    return [groups[key] for key in sorted(groups, reverse=True)]


def routed_request(pending_request: PendingRequest | None) -> RoutedRequest | None:
    """The token ids, max_tokens and n of an `LLMServer.generate(prompt, params)` call,
    if the prompt came as token ids (the ingress always sends them)."""
    if pending_request is None:
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    prompt = args[0] if args else kwargs.get("prompt")
    params = args[1] if len(args) > 1 else kwargs.get("params")
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return None
    params = params or {}
    return RoutedRequest(prompt, params.get("max_tokens"), params.get("n") or 1)


class KVAwareRouter(RequestRouter):
    def initialize_state(
        self,
        coordinator: Sequence[str] | None = None,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        """coordinator: (namespace, name) of the application's coordinator actor."""
        self._coordinator_address = tuple(coordinator) if coordinator else None
        self._refresh_interval_s = refresh_interval_s
        self._views: dict[str, ReplicaView] = {}
        self._debits: dict[str, list[Debit]] = defaultdict(list)
        # replica -> {Serve's internal request id: blocks the request may take}
        self._in_flight: dict[str, dict[str, int]] = defaultdict(dict)
        # replica -> blocks of requests ranked first there and not yet routed, oldest first
        self._reserved: dict[str, list[Debit]] = defaultdict(list)
        self._refresher: asyncio.Task | None = None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._start_refresher()
        try:
            ranks = self._rank(candidate_replicas, pending_request)
        except Exception:  # an exception here would leave the request unrouted for good
            logger.exception("KV router: ranking failed, routing by power of two")
            ranks = None
        return ranks or [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def _rank(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]] | None:
        """Ranks of replicas, best first; None without a request or a view of every replica."""
        request = routed_request(pending_request)
        views = {r.replica_id: self._views.get(r.replica_id.unique_id) for r in candidate_replicas}
        if request is None or not views or any(v is None for v in views.values()):
            return None
        keys = {}
        for replica_id, view in views.items():
            rid = replica_id.unique_id
            in_flight = sum(self._in_flight.get(rid, {}).values()) + self._reserved_blocks(rid)
            keys[replica_id] = placement(request, view, self._promised_blocks(rid), in_flight).key
        ranks = group_ranks(keys)
        # The router breaks a tie itself, so that it knows which replica to reserve on:
        # left to Serve, every request of a burst could break it the same way.
        first_id = random.choice(ranks[0])
        ties = [i for i in ranks[0] if i != first_id]
        ranks = [[first_id]] + ([ties] if ties else []) + ranks[1:]
        blocks = blocks_needed(request, views[first_id])[0]
        self._reserved[first_id.unique_id].append(Debit(time.monotonic(), blocks))
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank] for rank in ranks]

    def _reserved_blocks(self, replica_id: str) -> int:
        reserved = self._reserved.get(replica_id)
        if not reserved:
            return 0
        cutoff = time.monotonic() - RESERVATION_TTL_S
        reserved[:] = [r for r in reserved if r.routed_at > cutoff]
        return sum(r.blocks for r in reserved)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request = routed_request(pending_request)
        view = self._views.get(replica_id.unique_id)
        if request is None or view is None:
            return
        blocks = blocks_needed(request, view)[0]
        self._debits[replica_id.unique_id].append(Debit(time.monotonic(), blocks))
        self._in_flight[replica_id.unique_id][pending_request.metadata.internal_request_id] = blocks
        reserved = self._reserved.get(replica_id.unique_id)
        if reserved:  # the request is now in flight there: its reservation (or a peer's) ends
            reserved.pop(0)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        requests = self._in_flight.get(replica_id.unique_id)
        if requests is not None:
            requests.pop(internal_request_id, None)
            if not requests:
                del self._in_flight[replica_id.unique_id]

    def _promised_blocks(self, replica_id: str) -> int:
        """Blocks routed to the replica that its last report cannot include yet."""
        horizon = self._views[replica_id].reported_at - ARRIVAL_MARGIN_S
        return sum(d.blocks for d in self._debits.get(replica_id, ()) if d.routed_at > horizon)

    def _start_refresher(self) -> None:
        if self._refresher is None and self._coordinator_address is not None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        await follow_snapshots(
            self._coordinator_address, self._refresh_interval_s, self._use_snapshot, "routing by power of two"
        )

    def _use_snapshot(self, snapshot: dict[str, dict], asked_at: float) -> None:
        """An empty snapshot (coordinator gone) drops the views: routing falls back at once."""
        self._views = {rid: ReplicaView.from_report(r, asked_at) for rid, r in snapshot.items()}
        self._expire_debits()

    def _expire_debits(self) -> None:
        cutoff = time.monotonic() - DEBIT_TTL_S
        for replica_id in list(self._debits):
            view = self._views.get(replica_id)
            horizon = cutoff if view is None else max(cutoff, view.reported_at - ARRIVAL_MARGIN_S)
            kept = [d for d in self._debits[replica_id] if d.routed_at > horizon]
            if kept:
                self._debits[replica_id] = kept
            else:
                del self._debits[replica_id]
