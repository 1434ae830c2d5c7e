"""KV-aware routing: the ranking rules on their own, the router's account of what each
replica owes, then two real replicas behind the router on a local Serve app."""

import asyncio
import contextlib
import logging
import random
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import httpx
import openai
import pytest
import ray
from conftest import SERVE_HTTP_PORT, in_ingress, undeploy, wait_for, wait_for_async
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.app import build_app
from kvcache import KVCacheManager, hash_full_blocks
from kvserve import SamplingParams
from router.placement.coordinator import coordinator_address, follow_snapshots, get_coordinator
from router.placement.kv_router import (
    ADAPTER_LOAD_TOKENS,
    ARRIVAL_MARGIN_S,
    HOST_HIT_COST,
    OWED_TTL_S,
    KVAwareRouter,
    OwedRequest,
    ReplicaView,
    RoutedRequest,
    blocks_needed,
    group_ranks,
    host_prefix_blocks,
    net_free_blocks,
    placement,
)
from wire.lora_request import LoRARequest
from wire.messages import GenerateRequest, ReplicaReport

APP = "router-test"
MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS, BLOCK = 64, 16
SQL = LoRARequest("sql", 1, "/adapters/sql")


def view(
    free: int, cached: list[bytes] = (), total: int = 64, accepting: bool = True, loras: list[str] = ()
) -> ReplicaView:
    return ReplicaView(
        block_size=16,
        max_model_len=1024,
        free_blocks=free,
        total_blocks=total,
        cached_hashes=frozenset(cached),
        reported_at=time.monotonic(),
        accepting=accepting,
        loras=frozenset(loras),
    )


def keys(
    prompt: list[int],
    views: dict[str, ReplicaView],
    owed: dict[str, int] | None = None,
    lora: LoRARequest | None = None,
) -> dict:
    owed = owed or {}
    request = RoutedRequest(prompt, 1, lora=lora)
    return {r: placement(request, v, owed.get(r, 0)).key for r, v in views.items()}


def test_net_free_blocks_credits_the_cached_prefix_but_never_the_last_token():
    prompt = list(range(100, 164))  # 4 full blocks; one more token opens a fifth
    hashes = hash_full_blocks(prompt[:-1], 16)
    assert len(hashes) == 3
    assert net_free_blocks(RoutedRequest(prompt, 1), view(free=40), 0) == (35, 0)
    assert net_free_blocks(RoutedRequest(prompt, 1), view(free=40, cached=hashes), 0) == (38, 3)
    assert net_free_blocks(RoutedRequest(prompt, 1), view(free=40, cached=hashes), 5) == (33, 3)


def test_net_free_blocks_reserves_the_whole_answer():
    prompt = list(range(100, 164))
    assert net_free_blocks(RoutedRequest(prompt, 64), view(free=40), 0) == (32, 0)  # 128 tokens: 8 blocks
    # Unset max_tokens: the answer may run to max_model_len (1024 tokens, 64 blocks).
    assert net_free_blocks(RoutedRequest(prompt, None), view(free=40), 0) == (-24, 0)
    # n = 3: the first sample takes 8 blocks; the others share its 3 full prompt blocks
    # (the last prompt token is never cached) and need 5 more each.
    assert net_free_blocks(RoutedRequest(prompt, 64, 3), view(free=40), 0) == (22, 0)


def test_a_prefix_counts_up_to_the_deepest_reported_block():
    """Hashes are chained: a reported block vouches for every block before it, even
    ones the bounded report left out (it once stopped at the first missing block, so a
    shared prompt whose first blocks aged out of the report scored nothing)."""
    prompt = list(range(200, 280))
    hashes = hash_full_blocks(prompt[:-1], 16)
    assert len(hashes) == 4

    def hits(cached: list[bytes]) -> int:
        return net_free_blocks(RoutedRequest(prompt, 1), view(free=32, cached=cached), 0)[1]

    assert hits([hashes[0], hashes[2], hashes[3]]) == 4
    assert hits([hashes[0], hashes[2]]) == 3
    assert hits([hashes[1]]) == 2
    assert hits(hash_full_blocks(list(range(300, 380)), 16)) == 0  # another prompt's blocks


def test_much_more_room_beats_a_cached_prefix():
    prompt = list(range(100, 164))
    hashes = hash_full_blocks(prompt[:-1], 16)
    k = keys(prompt, {"roomy": view(free=60), "cached": view(free=40, cached=hashes)})
    assert k["roomy"] > k["cached"]


def test_a_cached_prefix_wins_while_it_saves_more_than_the_extra_load():
    prompt = list(range(100, 164))  # 4 prompt blocks (with the last token), 3 of them cacheable
    hashes = hash_full_blocks(prompt[:-1], 16)
    # 2 blocks more load, 3 blocks less prefill: the cached replica costs less.
    k = keys(prompt, {"near": view(free=42), "cached": view(free=40, cached=hashes)})
    assert k["cached"] > k["near"]
    # 5 blocks more load outweigh the 3 it saves: a shared prefix must not pile requests up.
    k = keys(prompt, {"near": view(free=45), "cached": view(free=40, cached=hashes)})
    assert k["near"] > k["cached"]
    # Same load, no prefix anywhere: a tie, which the router breaks at random.
    k = keys(prompt, {"a": view(free=45), "b": view(free=45)})
    assert k["a"] == k["b"]


def test_a_host_tier_hit_ranks_below_a_device_hit_and_above_a_miss():
    """Blocks a replica holds in its host KV tier are copied back, not prefilled: they
    cost HOST_HIT_COST of a block each, so at equal load a device hit beats a host hit,
    which beats a miss; and the host's blocks still need free device blocks to land in."""
    prompt = list(range(100, 228))  # 8 prompt blocks, 7 cacheable
    hashes = hash_full_blocks(prompt[:-1], 16)
    device = view(free=40, cached=hashes)
    host = replace(view(free=40), host_hashes=frozenset(hashes))
    partly = replace(view(free=40, cached=hashes[:2]), host_hashes=frozenset(hashes))
    miss = view(free=40)
    k = keys(prompt, {"device": device, "host": host, "partly": partly, "miss": miss})
    assert k["device"] > k["partly"] > k["host"] > k["miss"]
    assert host_prefix_blocks(hashes, partly) == 5 and host_prefix_blocks(hashes, device) == 0
    request = RoutedRequest(prompt, 16)
    assert blocks_needed(request, host) == blocks_needed(request, miss)
    # 7 restored blocks cost 7 * HOST_HIT_COST < 1 block: more than a device hit at the
    # same load, less than a device hit on a replica with one block more load.
    busier = view(free=39, cached=hashes)
    assert 7 * HOST_HIT_COST < 1
    k = keys(prompt, {"host": host, "busier": busier})
    assert k["host"] > k["busier"]


def _route_burst(views: dict[str, ReplicaView], prompts: list[list[int]]) -> list[str]:
    """Route requests one after another, each owed by its choice as the router does."""
    owed = dict.fromkeys(views, 0)
    chosen = []
    for prompt in prompts:
        request = RoutedRequest(prompt, 48)
        best = max(views, key=lambda r: placement(request, views[r], owed[r]).key)
        chosen.append(best)
        owed[best] += blocks_needed(request, views[best])[0]
    return chosen


def test_a_burst_of_equal_requests_splits_evenly_or_leans_only_as_far_as_a_prefix_saves():
    """What the router's requests owe is all that changes during a burst. Equal
    requests on equal replicas split evenly, and a shared system prompt cached on one
    replica tilts the split only by the prefill it saves there."""
    rng = random.Random(1)
    equal = {"a": view(free=60), "b": view(free=60)}
    chosen = _route_burst(equal, [[rng.randrange(1000, 40000) for _ in range(40)] for _ in range(16)])
    assert chosen.count("a") == chosen.count("b") == 8, chosen

    system = [rng.randrange(1000, 40000) for _ in range(48)]  # 3 blocks
    prompts = [system + [rng.randrange(1000, 40000) for _ in range(8)] for _ in range(16)]
    views = {"with_prefix": view(free=60, cached=hash_full_blocks(system, 16)), "without": view(free=60)}
    chosen = _route_burst(views, prompts)
    assert chosen[0] == "with_prefix"  # the first request takes the prefix hit
    assert 8 <= chosen.count("with_prefix") <= 11, chosen


def test_owed_blocks_count_against_a_replica():
    prompt = list(range(300, 332))
    k = keys(prompt, {"a": view(free=40), "b": view(free=30)}, owed={"a": 24})
    assert k["b"] > k["a"]


def test_a_replica_with_a_full_waiting_queue_ranks_last():
    prompt = list(range(100, 164))
    hashes = hash_full_blocks(prompt[:-1], 16)
    k = keys(prompt, {"full": view(free=60, cached=hashes, accepting=False), "open": view(free=10)})
    assert k["open"] > k["full"]
    report = replica_report(free=9)
    assert not ReplicaView.from_report(replace(report, num_waiting=4, max_waiting=4), 0.0).accepting
    assert ReplicaView.from_report(replace(report, num_waiting=3, max_waiting=4), 0.0).accepting
    assert ReplicaView.from_report(replace(report, num_waiting=99, max_waiting=None), 0.0).accepting


def test_an_adapter_request_goes_to_a_replica_holding_its_adapter_while_loads_are_similar():
    prompt = list(range(100, 164))
    k = keys(prompt, {"holder": view(free=40, loras=["sql"]), "other": view(free=40)}, lora=SQL)
    assert k["holder"] > k["other"]
    # Loading it elsewhere costs ADAPTER_LOAD_TOKENS (16 blocks): it outweighs less extra load.
    spare = ADAPTER_LOAD_TOKENS // 16 - 1
    k = keys(prompt, {"holder": view(free=40, loras=["sql"]), "other": view(free=40 + spare)}, lora=SQL)
    assert k["holder"] > k["other"]


def test_a_hot_adapter_spreads_once_the_replicas_holding_it_are_much_more_loaded():
    prompt = list(range(100, 164))
    k = keys(prompt, {"holder": view(free=10, loras=["sql"]), "other": view(free=60)}, lora=SQL)
    assert k["other"] > k["holder"]
    # The same holds for load this router has sent there and no report shows yet.
    k = keys(prompt, {"holder": view(free=60, loras=["sql"]), "other": view(free=60)}, {"holder": 30}, SQL)
    assert k["other"] > k["holder"]


def test_a_base_model_request_ignores_which_adapters_are_loaded():
    prompt = list(range(100, 164))
    k = keys(prompt, {"holder": view(free=40, loras=["sql"]), "other": view(free=40)})
    assert k["holder"] == k["other"]
    k = keys(prompt, {"holder": view(free=40, loras=["sql"]), "other": view(free=41)})
    assert k["other"] > k["holder"]


def test_an_adapter_request_counts_only_its_adapters_cached_prefix():
    """The engine chains an adapter's block hashes from its own root: the base model's
    KV for the same prompt is no prefix hit for it, nor is the adapter's for the base."""
    prompt = list(range(100, 164))
    base = hash_full_blocks(prompt[:-1], 16)
    adapter = hash_full_blocks(prompt[:-1], 16, parent=SQL.block_hash_root)
    assert set(base).isdisjoint(adapter)

    def hits(lora: LoRARequest | None, cached: list[bytes]) -> int:
        return net_free_blocks(RoutedRequest(prompt, 1, lora=lora), view(free=40, cached=cached), 0)[1]

    assert hits(SQL, base) == 0
    assert hits(SQL, adapter) == 3
    assert hits(None, adapter) == 0
    assert hits(None, base) == 3
    other = LoRARequest("sql", 1, "/adapters/sql-v2")  # the same name loaded from other files
    assert hits(other, adapter) == 0


def replica_report(free: int = NUM_BLOCKS, cached: list[bytes] = (), age_s: float = 0.0) -> ReplicaReport:
    """A report with every field the router does not read set to something plausible."""
    return ReplicaReport(
        node_id="node",
        deployment="LLMServer",
        device="cpu",
        tensor_parallel_size=1,
        block_size=BLOCK,
        max_model_len=1024,
        max_waiting=8,
        num_free_blocks=free,
        num_total_blocks=NUM_BLOCKS,
        kv_cache_usage=1 - free / NUM_BLOCKS,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_running=0,
        num_waiting=0,
        num_pending_blocks=0,
        num_preemptions=0,
        cpu_affinity=[],
        torch_threads=1,
        cached_block_hashes=list(cached),
        age_s=age_s,
    )


# The router's account of what each replica owes, on Serve's own request and replica ids
# but without Serve: the test plays Serve (ranking, routing, completions) and the
# coordinator (snapshots) on a clock it moves by hand.
DEPLOYMENT = DeploymentID(name="LLMServer", app_name="owed")
A, B = ReplicaID("a", DEPLOYMENT), ReplicaID("b", DEPLOYMENT)
PROMPT = list(range(1000, 1040))  # 40 tokens, 2 of them cacheable blocks; with 8 more, 3 blocks


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def router(clock) -> KVAwareRouter:
    # Serve's PendingRequest makes its future on the current event loop, and an earlier
    # test's asyncio.run may have left this thread without one.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    router = KVAwareRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    router.clock = clock.monotonic
    router._use_snapshot({"a": replica_report(), "b": replica_report()}, clock.now)
    yield router
    asyncio.set_event_loop(None)
    loop.close()


def pending(
    request_id: str, max_tokens: int = 8, prompt: list[int] = PROMPT, lora: LoRARequest | None = None
) -> PendingRequest:
    """A call of LLMServer.generate as Serve holds it."""
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    request = GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens), lora=lora)
    return PendingRequest(args=[request], kwargs={}, metadata=metadata)


def test_a_request_is_owed_from_its_ranking_by_one_replica_at_a_time(router, clock):
    request = pending("r")
    ranks = router.rank([A, B], request)
    first, other = ranks[0][0], (B if ranks[0][0] == A else A)
    assert ranks == [[first], [other]]  # a tie, broken by the router
    assert router._owed_by_replica() == {first.unique_id: 3, other.unique_id: 0}
    router.rank([A, B], request)  # Serve ranks it again (say the first refused it)
    assert sum(router._owed_by_replica().values()) == 3
    router.on_request_routed(request, other, None)  # Serve routes it elsewhere: it moves
    assert router._owed_by_replica() == {first.unique_id: 0, other.unique_id: 3}
    # A report built within ARRIVAL_MARGIN_S of the routing may not carry it yet.
    clock.advance(ARRIVAL_MARGIN_S / 2)
    router._use_snapshot({"a": replica_report(), "b": replica_report()}, clock.now)
    assert router._owed_by_replica()[other.unique_id] == 3
    # A later one does: its load has it, and it is owed no more.
    clock.advance(ARRIVAL_MARGIN_S)
    router._use_snapshot(
        {first.unique_id: replica_report(), other.unique_id: replica_report(free=61)}, clock.now
    )
    assert router._owed_by_replica() == {first.unique_id: 0, other.unique_id: 0}


def test_the_router_reads_the_adapter_from_the_request_and_the_loaded_ones_from_reports(router, clock):
    """Replica a holds the adapter: an adapter request goes there at equal load, and to
    b once a's report shows it nearly full with requests waiting."""
    holder = replace(replica_report(), loras=["sql"])
    router._use_snapshot({"a": holder, "b": replica_report()}, clock.now)
    assert router.rank([A, B], pending("lora", lora=SQL)) == [[A], [B]]
    busy = replace(holder, num_free_blocks=20, num_waiting=3, num_pending_blocks=12)
    router._use_snapshot({"a": busy, "b": replica_report()}, clock.now)
    assert router.rank([A, B], pending("lora-2", lora=SQL)) == [[B], [A]]


def test_a_replica_that_refuses_a_request_still_owes_it_until_it_is_routed(router):
    """Serve reports a refused request completed on the replica that refused it."""
    request = pending("r")
    first = router.rank([A, B], request)[0][0]
    router.on_request_completed(first, "r")
    assert router._owed_by_replica()[first.unique_id] == 3
    other = B if first == A else A
    router.on_request_routed(request, other, None)
    assert router._owed_by_replica() == {first.unique_id: 0, other.unique_id: 3}


def test_a_completed_request_owes_its_blocks_back_until_a_report_after_its_completion(router, clock):
    router.on_request_routed(pending("r"), A, None)
    clock.advance(0.1)
    router._use_snapshot({"a": replica_report(free=61), "b": replica_report()}, clock.now)
    assert router._owed_by_replica()["a"] == 0  # the report carries it
    clock.advance(0.1)
    router.on_request_completed(A, "r")
    assert router._owed_by_replica()["a"] == -3  # the report still holds its blocks
    clock.advance(0.1)  # a report built before the completion, passed on late
    router._use_snapshot({"a": replica_report(free=61, age_s=0.15), "b": replica_report()}, clock.now)
    assert router._owed_by_replica()["a"] == -3
    router._use_snapshot({"a": replica_report(), "b": replica_report()}, clock.now)
    assert router._owed_by_replica()["a"] == 0
    assert router._owed == {}  # settled


def test_completed_requests_owe_back_no_more_than_their_report_holds(router, clock):
    """Equal prompts share their cached prefix: 4 requests of 3 blocks hold 2 + 4 x 1."""
    hashes = hash_full_blocks(PROMPT[:-1], BLOCK)
    router._use_snapshot({"a": replica_report(cached=hashes), "b": replica_report()}, clock.now)
    for i in range(4):
        router.on_request_routed(pending(f"r{i}"), A, None)  # 1 block each, 2 cached
    clock.advance(0.1)
    router._use_snapshot({"a": replica_report(free=58, cached=hashes), "b": replica_report()}, clock.now)
    clock.advance(0.1)
    router.on_request_completed(A, "r0")
    # r0 frees its own block; the prefix stays with the three still running.
    assert router._owed_by_replica()["a"] == -1
    for i in range(1, 4):
        router.on_request_completed(A, f"r{i}")
    assert router._owed_by_replica()["a"] == -6  # all of it, prefix included, and no more


def test_owed_requests_that_nothing_settles_expire():
    ranked = OwedRequest("a", blocks=3, cached_blocks=0, since=0.0)
    assert not ranked.settled(reported_at=1.0, now=OWED_TTL_S - 1)
    assert ranked.settled(reported_at=1.0, now=OWED_TTL_S + 1)  # Serve never routed it
    running = OwedRequest("a", blocks=3, cached_blocks=0, since=0.0, routed=True)
    assert not running.settled(reported_at=1.0, now=10 * OWED_TTL_S)  # Serve reports its end
    done = OwedRequest("a", blocks=3, cached_blocks=0, since=0.0, routed=True, completed_at=1.0)
    assert not done.settled(reported_at=0.5, now=2.0)
    assert done.settled(reported_at=1.5, now=2.0)
    assert done.settled(reported_at=0.5, now=OWED_TTL_S + 2)  # no report came after it


@pytest.mark.parametrize("stale", ["a", "b", "both", "neither"])
def test_back_to_back_bursts_split_evenly_whichever_reports_are_stale(router, clock, stale):
    """Three bursts of 8 equal requests, each sent as soon as the last one ended. Serve
    ranks a whole burst, then routes it; the replicas run it (the prompt's prefix shared
    by each replica's four) and report; it completes; the next burst is ranked while
    the snapshot shows a report built before the completions for the `stale` replicas
    and after them for the others. Every burst splits 4 and 4."""
    hashes = hash_full_blocks(PROMPT[:-1], BLOCK)
    for burst in range(3):
        requests = [pending(f"{burst}-{i}", max_tokens=4) for i in range(8)]
        first = {r.metadata.internal_request_id: router.rank([A, B], r)[0][0] for r in requests}
        for request in requests:
            router.on_request_routed(request, first[request.metadata.internal_request_id], None)
        served = [replica.unique_id for replica in first.values()]
        assert sorted(served.count(r) for r in "ab") == [4, 4], (burst, served)
        clock.advance(0.2)
        busy = replica_report(free=NUM_BLOCKS - 6, cached=hashes)
        router._use_snapshot({"a": busy, "b": busy}, clock.now)
        clock.advance(0.2)
        for request_id, replica in first.items():
            router.on_request_completed(replica, request_id)
        clock.advance(0.01)
        stale_ones = {"both": "ab", "neither": ""}.get(stale, stale)
        router._use_snapshot(
            {r: replace(busy, age_s=0.1) if r in stale_ones else replica_report(cached=hashes) for r in "ab"},
            clock.now,
        )


def test_reports_are_dated_by_age_so_clock_skew_between_nodes_does_not_matter(ray_cluster):
    """Two replicas on nodes whose clocks are an hour ahead and an hour behind the
    router's. Each sends how old its report is; the coordinator adds how long it held
    it; the router dates it on its own clock. So a request routed before a report was
    built counts as in the report, and one routed after it as still owed. (With times
    of day, the replica ahead would hide every request owed and the one behind would
    count them all twice: bursts would pile up, or replicas would look full.)

    The events are 10 s apart on the router's clock (a request routed 20 s ago, a report
    built 10 s ago, a request routed now), so that no delay of Ray's calls on a busy
    machine can reorder them."""
    address = ("kvserve-test", "coordinator:skew")
    coordinator = get_coordinator(address)
    router = KVAwareRouter(DeploymentID(name="LLMServer", app_name="skew"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(coordinator=address, refresh_interval_s=0.02)
    replicas = {name: ReplicaID(name, DeploymentID(name="LLMServer", app_name="skew")) for name in "ab"}
    skew_s = {"a": 3600.0, "b": -3600.0}
    report = replica_report(free=60)

    def route(request_id: str, name: str, max_tokens: int, ago_s: float) -> None:
        """Routed ago_s seconds ago, on the router's clock (the one its snapshots use)."""
        router.clock = lambda: time.monotonic() - ago_s
        try:
            router.on_request_routed(pending(request_id, max_tokens, list(range(8))), replicas[name], None)
        finally:
            router.clock = time.monotonic

    async def scenario() -> dict[str, int]:
        router._start_refresher()
        for name in "ab":  # a first report, so that the router has views to count against
            ray.get(coordinator.report.remote(name, report))
        await wait_for_async(lambda: set(router._views) == {"a", "b"})
        for name in "ab":
            route(f"before-{name}", name, 40, ago_s=20.0)  # 48 tokens: 3 blocks
        built_at = {name: time.monotonic() - 10.0 + skew_s[name] for name in "ab"}  # each node's clock
        for name in "ab":
            route(f"after-{name}", name, 72, ago_s=0.0)  # 80 tokens: 5 blocks
        for name in "ab":
            age_s = time.monotonic() + skew_s[name] - built_at[name]
            # It carries the request routed before it: 3 blocks fewer free.
            ray.get(coordinator.report.remote(name, replace(report, num_free_blocks=57, age_s=age_s)))
        await wait_for_async(
            lambda: {r: v.free_blocks for r, v in router._views.items()} == {"a": 57, "b": 57}
        )
        return router._owed_by_replica()

    try:
        assert asyncio.run(scenario()) == {"a": 5, "b": 5}
    finally:
        ray.kill(coordinator)


def test_following_snapshots_ends_whenever_it_is_cancelled(ray_cluster):
    """A router's snapshot loop, cancelled at random moments, some just as a snapshot
    arrives, ends every time. (Through asyncio.wait_for, Python 3.11 kept about one
    cancellation in eight: the loop went on polling, and asyncio.run, which cancels it on
    the way out, waited forever. A full test run hung that way.)"""
    address = ("kvserve-test", "coordinator:cancel")
    coordinator = get_coordinator(address)
    ray.get(coordinator.snapshot.remote())  # started, so that start-up is not in the timings

    async def time_to_first_snapshot() -> float:
        """How long a fresh loop takes to hand out its first snapshot (it looks the
        coordinator up, then asks it), so that cancellations can be aimed around it
        however fast or loaded this machine is."""
        arrived = asyncio.Event()
        start = time.monotonic()
        task = asyncio.create_task(follow_snapshots(address, 0.0, lambda *_: arrived.set(), "nothing"))
        await asyncio.wait_for(arrived.wait(), timeout=30.0)
        elapsed = time.monotonic() - start
        task.cancel()
        await asyncio.wait({task}, timeout=5.0)
        return elapsed

    async def cancel_at_random(times: int) -> tuple[int, int]:
        # asyncio.sleep overshoots a little, so the window reaches only a bit past the median.
        window_s = 1.5 * statistics.median([await time_to_first_snapshot() for _ in range(15)])
        with_snapshots = 0
        still_running = 0
        for _ in range(times):
            snapshots = 0

            def use(snapshot: dict, asked_at: float) -> None:
                nonlocal snapshots
                snapshots += 1

            task = asyncio.create_task(follow_snapshots(address, 0.0, use, "nothing"))
            await asyncio.sleep(random.uniform(0.0, window_s))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            still_running += not done
            with_snapshots += snapshots > 0
        return still_running, with_snapshots

    # Not asyncio.run: it would wait forever for a task that ignored its cancellation.
    loop = asyncio.new_event_loop()
    try:
        still_running, with_snapshots = loop.run_until_complete(cancel_at_random(150))
    finally:
        loop.close()
        ray.kill(coordinator)
    assert still_running == 0
    # The window spans the first snapshot's arrival, so cancellations land on both sides.
    assert 0 < with_snapshots < 150, f"{with_snapshots} of 150 loops got a snapshot"


def test_a_router_falls_back_to_power_of_two_at_its_first_snapshot_after_the_coordinator_dies(ray_cluster):
    """docs/failures.md: routers fall back to power-of-two choices at once and recreate
    the coordinator. A router with views of two replicas, its coordinator killed: the
    first snapshot it is handed after the death is empty, because asking the dead actor
    fails with its death (not the 2 s timeout, nor the reports going stale), and from
    then on it ranks nothing and choose_replicas samples two candidates. Looking the
    coordinator up again recreates it; once the replicas report to the new one, the
    router ranks again."""
    address = ("kvserve-test", "coordinator:fallback")
    coordinator = get_coordinator(address)
    deployment = DeploymentID(name="LLMServer", app_name="fallback")
    router = KVAwareRouter(deployment, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(coordinator=address, refresh_interval_s=0.02)
    a, b, c = (ReplicaID(name, deployment) for name in "abc")
    handed: list[tuple[float, list[str]]] = []  # (when, the replicas in it), each snapshot as handed over
    use_snapshot = router._use_snapshot

    def recording(snapshot: dict, asked_at: float) -> None:
        handed.append((time.monotonic(), sorted(snapshot)))
        use_snapshot(snapshot, asked_at)

    router._use_snapshot = recording
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ray.serve").addHandler(handler)

    def dead() -> bool:
        try:
            ray.get(coordinator.snapshot.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return True
        return False

    def recreated() -> bool:
        """The name answers again: the actor killed cannot, so this is a new one."""
        namespace, name = address
        try:
            return ray.get(ray.get_actor(name, namespace=namespace).snapshot.remote(), timeout=30) == {}
        except (ValueError, ray.exceptions.RayActorError):
            return False

    async def scenario() -> None:
        router._start_refresher()
        for name in "ab":
            ray.get(coordinator.report.remote(name, replica_report()))
        await wait_for_async(lambda: set(router._views) == {"a", "b"})
        assert router.rank([a, b], pending("with-views")) is not None
        ray.kill(coordinator)
        # ray.kill returns before the actor is gone: dead once a call to it fails.
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(dead):
            assert time.monotonic() < deadline, "the killed coordinator still answers"
        died_at = time.monotonic()
        await wait_for_async(lambda: any(at > died_at for at, _ in handed))
        first_after = next(replicas for at, replicas in handed if at > died_at)
        assert first_after == [], handed
        lost = [w for w in warnings if w.startswith("lost the coordinator, routing by power of two")]
        assert lost and all("ActorDiedError" in w for w in lost), warnings
        # Nothing reports to the new coordinator yet: the router stays on power of two.
        assert router._views == {}
        assert router.rank([a, b], pending("without-views")) is None
        candidates = [SimpleNamespace(replica_id=r) for r in (a, b, c)]
        (two,) = await router.choose_replicas(candidates, pending("routed-by-pow2"))
        assert len(two) == 2 and len({r.replica_id for r in two}) == 2
        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(recreated):
            assert time.monotonic() < deadline, "the router did not recreate the coordinator"
        namespace, name = address
        for replica in "ab":  # as each replica's report pusher finds the new one
            ray.get(ray.get_actor(name, namespace=namespace).report.remote(replica, replica_report()))
        await wait_for_async(lambda: set(router._views) == {"a", "b"})
        assert router.rank([a, b], pending("with-views-again")) is not None
        router._refresher.cancel()

    try:
        asyncio.run(scenario())
    finally:
        logging.getLogger("ray.serve").removeHandler(handler)
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(address[1], namespace=address[0]))


def test_group_ranks_best_first_and_ties_share_a_rank():
    assert group_ranks({"a": (1, 0), "b": (3, 2), "c": (1, 0), "d": (3, 5)}) == [["d"], ["b"], ["a", "c"]]


def test_cached_prefix_summary_is_bounded_and_newest_first():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    tokens = list(range(40))
    kv.allocate("r", len(tokens))
    kv.cache_full_blocks("r", tokens, len(tokens))
    hashes = hash_full_blocks(tokens, 4)
    assert kv.cached_prefix_summary(1000) == hashes[::-1]
    assert kv.cached_prefix_summary(3) == hashes[::-1][:3]


@pytest.fixture(scope="module")
def router_app(ray_cluster, model_path):
    app = build_app(
        {
            "app_name": APP,
            "model": str(model_path),
            "served_model_name": MODEL,
            "replicas": 2,
            "engine_args": {"dtype": "float32", "num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK},
        }
    )
    serve.run(app, name=APP, route_prefix="/router-test")
    wait_for(lambda: len(snapshot()) == 2)
    yield serve.get_deployment_handle("LLMServer", app_name=APP)
    undeploy(APP)


def snapshot() -> dict[str, ReplicaReport]:
    """The coordinator's snapshot; empty while it does not exist (this never creates it)."""
    namespace, name = coordinator_address(APP)
    try:
        return ray.get(ray.get_actor(name, namespace=namespace).snapshot.remote())
    except (ValueError, ray.exceptions.RayActorError):
        return {}


def free_blocks_seen(router: KVAwareRouter) -> dict[str, int]:
    """What a KV router believes each replica has free (ReplicaView.free_blocks), by id."""
    return {replica_id: view.free_blocks for replica_id, view in router._views.items()}


def handle_router(handle) -> KVAwareRouter:
    """The KV router behind a DeploymentHandle of this process. Serve keeps it to itself:
    these are Ray 2.60's private attributes (pyproject pins that version). Serve ships the
    router's module by value, so the class is checked by name."""
    router = handle._router._asyncio_router._request_router
    assert type(router).__name__ == "KVAwareRouter", router
    return router


def ingress_router_free_blocks() -> dict[str, int]:
    """free_blocks_seen of the router that places the app's HTTP requests: the ingress's
    handle's, in the ingress's process (Ray 2.60's private attributes, as handle_router)."""
    return in_ingress(
        APP,
        lambda ingress: {
            replica_id: view.free_blocks
            for replica_id, view in ingress.llms[0]._router._asyncio_router._request_router._views.items()
        },
    )


def idle() -> bool:
    replicas = snapshot().values()
    return len(replicas) == 2 and all(
        s.num_running == s.num_waiting == 0 and s.num_free_blocks == NUM_BLOCKS for s in replicas
    )


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_new_requests_go_to_the_replica_with_more_free_blocks(router_app):
    """One long request fills most of replica A's cache (and reserves nearly all of it
    for its answer). Every short request after it must go to B, even once B holds more
    ongoing requests than A (where power-of-two choices, which compares queue lengths,
    would pick A)."""
    rng = random.Random(0)
    sampling = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)
    big = router_app.options(stream=True).generate.remote(GenerateRequest(random_prompt(rng, 620), sampling))
    short = replace(sampling, max_tokens=40)
    streams = [big]
    try:
        filled = next(big).replica_id
        # 620 prompt tokens hold 39 of 64 blocks; wait until the coordinator has seen it.
        wait_for(lambda: filled in snapshot() and snapshot()[filled].num_free_blocks <= NUM_BLOCKS - 39)
        # and until the handle's router, whose copy of the snapshot refreshes every 100 ms,
        # has seen it too: a router owes what it placed only where it had a view, and this
        # one, started by the long request, may have had none yet.
        seen = handle_router(router_app)
        wait_for(lambda: free_blocks_seen(seen).get(filled, NUM_BLOCKS) <= NUM_BLOCKS - 39)
        for _ in range(5):
            small = router_app.options(stream=True).generate.remote(
                GenerateRequest(random_prompt(rng, 20), short)
            )
            streams.append(small)
            assert next(small).replica_id != filled
    finally:
        for stream in streams:
            stream.cancel()
    wait_for(idle)


async def completions(bodies_at: list[tuple[float, dict]]) -> list[str]:
    """Send each body at its time (seconds from now) to /v1/completions: the replica
    that served each, from the x-kvserve-replica header."""
    url = f"http://127.0.0.1:{SERVE_HTTP_PORT}/router-test/v1/completions"
    async with httpx.AsyncClient(timeout=120) as client:

        async def post(at: float, body: dict) -> httpx.Response:
            await asyncio.sleep(at)
            return await client.post(url, json=body)

        responses = await asyncio.gather(*(post(at, body) for at, body in bodies_at))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.headers["x-kvserve-replica"] for r in responses]


def test_back_to_back_bursts_of_equal_requests_split_evenly_over_http(router_app):
    """Three bursts of 8 requests with one prompt, each sent as soon as the last one
    ended, as traffic does: no waiting for the replicas' reports to show them idle.
    Each replica serves at most 60% of them, every time (Serve ranks a burst before it
    routes any of it, and a report may still show the last burst's requests)."""
    # Once, for the test before, whose requests another router (the test's handle)
    # placed: the ingress's router learns of them only from reports, so until its copy of
    # the snapshot shows both replicas idle too.
    wait_for(idle)
    wait_for(lambda: ingress_router_free_blocks() == dict.fromkeys(snapshot(), NUM_BLOCKS), interval_s=0.2)
    rng = random.Random(5)
    for run in range(3):
        body = {"model": MODEL, "prompt": random_prompt(rng, 40), "max_tokens": 4, "temperature": 0}
        bursts = [asyncio.run(completions([(0.0, body)] * 8)) for _ in range(3)]
        served = [replica for burst in bursts for replica in burst]
        split = sorted(served.count(r) for r in set(served))
        assert len(split) == 2 and split[1] <= 0.6 * len(served), (run, [sorted(b) for b in bursts])


def test_poisson_arrivals_split_evenly_over_http(router_app):
    """32 requests of one size arriving at random (a Poisson process, seeded), fast
    enough that both replicas stay busy: each serves at most 60% of them."""
    rng = random.Random(7)
    at, bodies_at = 0.0, []
    for _ in range(32):
        at += rng.expovariate(8.0)  # 8 requests a second
        body = {"model": MODEL, "prompt": random_prompt(rng, 40), "max_tokens": 16, "temperature": 0}
        bodies_at.append((at, {**body, "ignore_eos": True}))
    served = asyncio.run(completions(bodies_at))
    split = sorted(served.count(r) for r in set(served))
    assert len(split) == 2 and split[1] <= 0.6 * len(served), served


def test_32_concurrent_mixed_requests_across_two_replicas(router_app, llm_fp32, tokenizer):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{SERVE_HTTP_PORT}/router-test/v1", api_key="unused", max_retries=0
    )
    # Longer than one KV block, so that every request, not only the chats (whose template
    # adds a system prompt), shows up in its replica's prefix-cache queries.
    questions = [
        f"Write one short sentence about the number {i}, and say why people like it." for i in range(8)
    ]
    before = snapshot()

    async def greedy_completion(i: int) -> str:
        out = await client.completions.create(model=MODEL, prompt=questions[i], max_tokens=16, temperature=0)
        return out.choices[0].text

    async def streamed_completion(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=questions[i], max_tokens=16, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def chat(i: int, stream: bool) -> str:
        kwargs = {"max_tokens": 16, "temperature": 0.8, "seed": 1000 + i, "stop": ["\n\n"]}
        messages = [{"role": "user", "content": questions[i]}]
        if not stream:
            out = await client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
            return out.choices[0].message.content
        chunks = await client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def run_all():
        jobs = [greedy_completion(i) for i in range(8)] + [streamed_completion(i) for i in range(8)]
        jobs += [chat(i, stream=False) for i in range(8)] + [chat(i, stream=True) for i in range(8)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    greedy, streamed, chat_json, chat_streamed = (results[k : k + 8] for k in range(0, 32, 8))
    expected = llm_fp32.generate(questions, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert greedy == [e.text for e in expected]
    assert streamed == greedy
    # Same seed, same text, whichever replica and batch each copy landed in.
    assert chat_streamed == chat_json
    assert all(text for text in chat_json)

    assert all(len(tokenizer(q).input_ids) > BLOCK for q in questions)

    def served() -> list[str]:
        after = snapshot()
        return [r for r in after if after[r].prefix_cache_queries > before[r].prefix_cache_queries]

    # Replicas report every ~100 ms, so the last requests may not be in the snapshot yet.
    try:
        wait_for(lambda: len(served()) == 2, timeout_s=5)
    except AssertionError:
        raise AssertionError(f"both replicas should have taken requests, served: {served()}") from None


def test_routing_survives_the_coordinator_dying(router_app):
    """The app's side of test_a_router_falls_back_to_power_of_two_at_its_first_snapshot_
    after_the_coordinator_dies: requests are answered while the coordinator is gone, and
    it comes back with both replicas' reports."""
    namespace, name = coordinator_address(APP)
    ray.kill(ray.get_actor(name, namespace=namespace))
    rng = random.Random(1)
    for _ in range(4):  # routed by power of two while the coordinator is gone
        request = GenerateRequest(random_prompt(rng, 30), SamplingParams(max_tokens=4))
        chunks = list(router_app.options(stream=True).generate.remote(request))
        assert chunks[-1].finish_reason == "length"
    # The router recreates it; the replicas find it again and report.
    wait_for(lambda: len(snapshot()) == 2)
