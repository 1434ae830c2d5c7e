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
   replica carries (blocks its requests hold or will still take) plus the prompt
   blocks it would have to prefill, which a cached prefix reduces. A shared system
   prompt therefore attracts requests only while the replica holding it is not busier
   by more than the prefill it saves. Blocks that a replica holds in its host KV tier
   past its device cache's hits cost HOST_HIT_COST of a prefilled block each (a copy
   back, not a recompute): a host hit ranks below a device hit and above a miss;
   - a LoRA adapter request also costs ADAPTER_LOAD_TOKENS (in blocks) on a replica
     whose report does not list its adapter as loaded: loading it there delays the
     first token about as much as prefilling that many more prompt tokens. So the
     request goes to a replica holding its adapter while that replica is not busier by
     more than that, and a hot adapter spreads to other replicas (which then load it)
     once the ones holding it are that much more loaded. Its prompt is hashed from the
     adapter's root (LoRARequest.block_hash_root), as the engine caches it, so only
     KV computed under the same adapter counts as its cached prefix;
4. among replicas with equal keys, one at random comes first (and the rest next),
   so that the router knows where the request will go (see below).

A replica's load is its last report's load plus what it owes: the blocks of this
router's requests that its last report does not show as they are now. Traffic does not
wait for a report: the snapshot is up to ~200 ms old, and Serve asks for the rankings
of a whole burst before it routes any of it. So a request's blocks are owed by the
replica that its ranking puts first, from that moment; by the replica Serve routes it
to, once routed (the same blocks, moved, not added); and no longer once a report built
after it arrived there (ARRIVAL_MARGIN_S after routing) carries them. When Serve says
it completed, a report that carries it still holds blocks it has freed: until a report
built after the completion comes in, the request owes them back, a negative amount
(owed_blocks), so that a burst sent as soon as the last one ended finds that replica as
empty as one that reported after its requests ended. A ranked request that Serve never
routes, or a completed one that no later report reaches, stops counting after
OWED_TTL_S. Ties are broken here rather than by Serve for the same reason: Serve's
queue lengths do not change while it ranks a burst either, so it would break every tie
of a burst the same way and pile the burst onto one replica.

Without a snapshot (coordinator gone, replica not yet heard from, or a text prompt the
router cannot hash) it falls back to power-of-two choices.
"""

import asyncio
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvcache.block_math import cdiv
from kvcache.hashing import ROOT_HASH, hash_full_blocks
from router.placement.coordinator import follow_snapshots
from wire.lora_request import LoRARequest
from wire.messages import GenerateRequest, ReplicaReport

logger = logging.getLogger("ray.serve")

REFRESH_INTERVAL_S = 0.1
# A request routed less than this long before a report may not have reached the engine yet.
ARRIVAL_MARGIN_S = 0.05
# A ranked request that Serve never routes, or a completed one no later report reaches,
# stops counting after this long.
OWED_TTL_S = 5.0
# What loading a LoRA adapter on a replica that does not hold it costs, in prompt tokens
# it could have prefilled instead; the placement cost counts it in blocks.
ADAPTER_LOAD_TOKENS = 256
# What restoring a block from a host KV tier costs, in prefilled blocks: a copy of its
# bytes, far cheaper than recomputing its tokens, but more than a device hit's nothing.
HOST_HIT_COST = 0.1


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
    loras: frozenset[str] = frozenset()  # names of the adapters it has loaded
    host_hashes: frozenset[bytes] = frozenset()  # its host KV tier's newest, bounded

    @classmethod
    def from_report(cls, report: ReplicaReport, asked_at: float) -> "ReplicaView":
        """asked_at: when this router asked for the report (time.monotonic())."""
        return cls(
            block_size=report.block_size,
            max_model_len=report.max_model_len,
            free_blocks=report.num_free_blocks - report.num_pending_blocks,
            total_blocks=report.num_total_blocks,
            cached_hashes=frozenset(report.cached_block_hashes),
            reported_at=asked_at - report.age_s,
            accepting=report.accepting,
            loras=frozenset(report.loras),
            host_hashes=frozenset(report.host_block_hashes),
        )

    @property
    def load_blocks(self) -> int:
        """Blocks its requests hold or will still take, as reported."""
        return self.total_blocks - self.free_blocks


@dataclass
class OwedRequest:
    """One request of this router's, in the account of what a replica owes."""

    replica_id: str  # ranked first there, or routed there
    blocks: int  # what it may take there (blocks_needed)
    cached_blocks: int  # prompt blocks it found cached there, which it may share
    since: float  # when it was ranked or routed there: time.monotonic()
    routed: bool = False
    completed_at: float | None = None  # when Serve said it completed

    def in_report(self, reported_at: float) -> bool:
        """Whether a report built at reported_at carries its blocks."""
        arrived = self.routed and reported_at > self.since + ARRIVAL_MARGIN_S
        return arrived and (self.completed_at is None or reported_at < self.completed_at)

    def settled(self, reported_at: float, now: float) -> bool:
        """Nothing more to owe: reported after its completion, or forgotten after the TTL.
        A routed request that has not completed stays: Serve reports every completion."""
        if self.completed_at is not None:
            return reported_at >= self.completed_at or self.completed_at < now - OWED_TTL_S
        return not self.routed and self.since < now - OWED_TTL_S


def owed_blocks(requests: Iterable[OwedRequest], view: ReplicaView) -> int:
    """What the replica owes beyond its last report's load, in blocks: the blocks of
    requests that the report does not carry yet, less those that completed requests it
    carries have freed. A completed request frees its own blocks, and its cached prefix
    too once none of the requests that the report carries still runs there (the prefix
    may be shared with them); never more, all together, than the report's load."""
    ahead = freed_own = freed_with_prefix = 0
    still_running = False
    for request in requests:
        if not request.in_report(view.reported_at):
            ahead += request.blocks if request.completed_at is None else 0
        elif request.completed_at is None:
            still_running = True
        else:
            freed_own += request.blocks
            freed_with_prefix += request.blocks + request.cached_blocks
    freed = freed_own if still_running else freed_with_prefix
    return ahead - min(freed, max(view.load_blocks, 0))


def cached_prefix_blocks(prompt_hashes: Sequence[bytes], view: ReplicaView) -> int:
    """Leading prompt blocks the replica has cached on its device: up to the deepest
    prompt block whose hash it reported. Hashes are chained, so that hash vouches for
    every block before it, even ones missing from the report: a report is bounded to the
    most recently used blocks, and a prefix's earlier blocks can fall out of it while its
    later ones stay."""
    return deepest_reported(prompt_hashes, view.cached_hashes)


def host_prefix_blocks(prompt_hashes: Sequence[bytes], view: ReplicaView) -> int:
    """Prompt blocks past the device's hits that its host KV tier holds (restored, not
    prefilled, as the engine looks them up: device hits first, then the host's)."""
    return max(
        0, deepest_reported(prompt_hashes, view.host_hashes) - cached_prefix_blocks(prompt_hashes, view)
    )


def deepest_reported(prompt_hashes: Sequence[bytes], reported: frozenset[bytes]) -> int:
    for depth in range(len(prompt_hashes), 0, -1):
        if prompt_hashes[depth - 1] in reported:
            return depth
    return 0


@dataclass
class RoutedRequest:
    prompt: list[int]
    max_tokens: int | None
    n: int = 1  # samples: each shares the prompt's full blocks, then grows its own
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    _block_hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, request: GenerateRequest) -> "RoutedRequest | None":
        """None for a text prompt, which the router cannot hash (the ingress always
        sends token ids)."""
        prompt = request.prompt
        if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            return None
        return cls(prompt, request.sampling.max_tokens, request.sampling.n, request.lora)

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The prompt's chained block hashes, computed once per block size however many
        replicas are compared. Like the engine, the last token is never cacheable, and an
        adapter's blocks chain from its own root: they never match the base model's."""
        if block_size not in self._block_hashes:
            root = ROOT_HASH if self.lora is None else self.lora.block_hash_root
            self._block_hashes[block_size] = hash_full_blocks(self.prompt[:-1], block_size, parent=root)
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
    return final_blocks - hits + (request.n - 1) * (final_blocks - len(hashes)), hits


def net_free_blocks(request: RoutedRequest, view: ReplicaView, owed: int) -> tuple[int, int]:
    """(free blocks left once this request has all it may take, leading prompt blocks
    already cached)."""
    need, hits = blocks_needed(request, view)
    return view.free_blocks - owed - need, hits


@dataclass(frozen=True)
class Placement:
    """How well one replica suits one request; `key` orders them, larger is better."""

    accepting: bool  # its waiting queue has room
    fits: bool  # its free blocks cover everything the request may take
    cost_blocks: float  # its load, the prompt blocks it would prefill or restore, loading the adapter

    @property
    def key(self) -> tuple[bool, bool, float]:
        return (self.accepting, self.fits, -self.cost_blocks)


def adapter_load_blocks(request: RoutedRequest, view: ReplicaView) -> int:
    """What loading the request's adapter there costs, in blocks: nothing for the base
    model or an adapter the replica holds."""
    if request.lora is None or request.lora.lora_name in view.loras:
        return 0
    return cdiv(ADAPTER_LOAD_TOKENS, view.block_size)


def placement(request: RoutedRequest, view: ReplicaView, owed: int) -> Placement:
    """owed: what the replica owes beyond its report (owed_blocks)."""
    net_free, hits = net_free_blocks(request, view, owed)
    restored = host_prefix_blocks(request.block_hashes(view.block_size), view) if view.host_hashes else 0
    prefill = cdiv(len(request.prompt), view.block_size) - hits - restored + HOST_HIT_COST * restored
    cost = view.load_blocks + owed + prefill + adapter_load_blocks(request, view)
    return Placement(view.accepting, net_free >= 0, cost)


def group_ranks(keys: dict[ReplicaID, tuple]) -> list[list[ReplicaID]]:
    """Replicas grouped by equal key, best key first."""
    groups: dict[tuple, list[ReplicaID]] = defaultdict(list)
    for replica_id, key in keys.items():
        groups[key].append(replica_id)
    return [groups[key] for key in sorted(groups, reverse=True)]


def routed_request(pending_request: PendingRequest | None) -> RoutedRequest | None:
    """The prompt, max_tokens, n and adapter of an `LLMServer.generate(request)` call,
    if the prompt came as token ids."""
    if pending_request is None:
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    request = args[0] if args else kwargs.get("request")
    return RoutedRequest.of(request) if isinstance(request, GenerateRequest) else None


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
        # Serve's internal request id -> the request's place in what a replica owes
        self._owed: dict[str, OwedRequest] = {}
        self._refresher: asyncio.Task | None = None
        # What every time in this router's account is read from; the snapshots' asked_at
        # comes from the same clock (time.monotonic()). Tests move their own by hand.
        self.clock: Callable[[], float] = time.monotonic

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._start_refresher()
        try:
            by_id = {r.replica_id: r for r in candidate_replicas}
            ranks = self.rank(list(by_id), pending_request)
        except Exception:  # an exception here would leave the request unrouted for good
            logger.exception("KV router: ranking failed, routing by power of two")
            ranks = None
        if not ranks:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        return [[by_id[i] for i in rank] for rank in ranks]

    def rank(
        self, replica_ids: list[ReplicaID], pending_request: PendingRequest | None
    ) -> list[list[ReplicaID]] | None:
        """Ranks of replicas, best first, the first of them alone; None without a request
        or a view of every replica. The request is owed by the first from now on."""
        request = routed_request(pending_request)
        views = {i: self._views.get(i.unique_id) for i in replica_ids}
        if request is None or not views or any(v is None for v in views.values()):
            return None
        internal_id = pending_request.metadata.internal_request_id
        self._owed.pop(internal_id, None)  # ranked again (Serve retries): counted afresh
        owed = self._owed_by_replica()
        keys = {i: placement(request, view, owed.get(i.unique_id, 0)).key for i, view in views.items()}
        ranks = group_ranks(keys)
        # The router breaks a tie itself, so that it knows which replica owes the request:
        # left to Serve, every request of a burst could break it the same way.
        first = random.choice(ranks[0])
        ties = [i for i in ranks[0] if i != first]
        blocks, cached = blocks_needed(request, views[first])
        self._owed[internal_id] = OwedRequest(first.unique_id, blocks, cached, self.clock())
        return [[first]] + ([ties] if ties else []) + ranks[1:]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        internal_id = pending_request.metadata.internal_request_id
        self._owed.pop(internal_id, None)  # owed by the replica it went to instead
        request = routed_request(pending_request)
        view = self._views.get(replica_id.unique_id)
        if request is not None and view is not None:
            blocks, cached = blocks_needed(request, view)
            self._owed[internal_id] = OwedRequest(
                replica_id.unique_id, blocks, cached, self.clock(), routed=True
            )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Also called for a replica that refused the request (it is then not routed there)."""
        owed = self._owed.get(internal_request_id)
        if owed is not None and owed.routed and owed.replica_id == replica_id.unique_id:
            owed.completed_at = self.clock()

    def _owed_by_replica(self) -> dict[str, int]:
        """owed_blocks of every replica with a view."""
        requests: dict[str, list[OwedRequest]] = defaultdict(list)
        for owed in self._owed.values():
            requests[owed.replica_id].append(owed)
        return {rid: owed_blocks(requests[rid], view) for rid, view in self._views.items()}

    def _start_refresher(self) -> None:
        if self._refresher is None and self._coordinator_address is not None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        await follow_snapshots(
            self._coordinator_address, self._refresh_interval_s, self._use_snapshot, "routing by power of two"
        )

    def _use_snapshot(self, snapshot: dict[str, ReplicaReport], asked_at: float) -> None:
        """An empty snapshot (coordinator gone) drops the views: routing falls back at once."""
        self._views = {rid: ReplicaView.from_report(r, asked_at) for rid, r in snapshot.items()}
        now = self.clock()
        for internal_id, owed in list(self._owed.items()):
            view = self._views.get(owed.replica_id)
            reported_at = view.reported_at if view is not None else float("-inf")
            if owed.settled(reported_at, now):
                del self._owed[internal_id]
