"""Prefix reports at GPU-like scale: a replica reports a bounded set of cached block
hashes (replica/server/deployment.py's CACHED_HASHES_REPORTED, 4,096), and a shared system
prompt must stay in it, and keep drawing its requests, however many unique blocks are
cached after it. The real KVCacheManager does the bookkeeping; no model runs."""

import random
import time
from collections import deque

from kvcache import KVCacheManager, hash_full_blocks
from router.placement.kv_router import ReplicaView, RoutedRequest, cached_prefix_blocks, placement
from wire.messages import ReplicaReport

NUM_BLOCKS = 20_000
BLOCK = 16
REPORTED = 4096  # replica/server/deployment.py's CACHED_HASHES_REPORTED
SYSTEM_BLOCKS = 40
SUFFIX_TOKENS = 4 * BLOCK + 5  # unique per request: 4 full blocks and a partial one
OUTPUT_TOKENS = 20
LIVE = 64  # requests running at once: the oldest is freed as a new one arrives
REQUESTS = 5000
VOCAB = 50_000


def churn(kv: KVCacheManager, system: list[int], rng: random.Random) -> int:
    """Serve REQUESTS requests of `system` plus a unique suffix, as the scheduler and
    engine do (look up, allocate, cache once computed, free when done), LIVE at a time.
    Returns how many blocks were newly cached after the system prompt."""
    live: deque[str] = deque()
    inserted = 0
    for i in range(REQUESTS):
        rid = str(i)
        prompt = system + [rng.randrange(VOCAB) for _ in range(SUFFIX_TOKENS)]
        tokens = prompt + [rng.randrange(VOCAB) for _ in range(OUTPUT_TOKENS)]
        cached = kv.find_cached_prefix(prompt)
        assert kv.allocate(rid, len(tokens), cached)
        kv.cache_full_blocks(rid, tokens, len(tokens))
        inserted += len(tokens) // BLOCK - len(cached.blocks)
        live.append(rid)
        if len(live) > LIVE:
            kv.free(live.popleft())
    for rid in live:
        kv.free(rid)
    return inserted - SYSTEM_BLOCKS  # the first request cached the system prompt itself


def report(kv: KVCacheManager) -> ReplicaReport:
    """An idle replica's report (replica/server/deployment.py's _build_report) over `kv`."""
    stats = kv.stats()
    return ReplicaReport(
        node_id="node",
        deployment="LLMServer",
        device="cpu",
        tensor_parallel_size=1,
        block_size=kv.block_size,
        max_model_len=1 << 17,
        max_waiting=None,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        kv_cache_usage=stats.usage,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_running=0,
        num_waiting=0,
        num_pending_blocks=0,
        num_preemptions=0,
        cpu_affinity=[0],
        torch_threads=1,
        cached_block_hashes=kv.cached_prefix_summary(REPORTED),
    )


def test_a_shared_system_prompt_stays_reported_and_routed_to_under_churn():
    """Two replicas, each serving its own system prompt to thousands of requests with
    unique suffixes: several times REPORTED blocks are cached after each prompt (more
    than the pool holds, so LRU eviction runs too). Each replica must still report its
    whole system prompt, and a new request must score it there and be routed there."""
    rng = random.Random(0)
    systems = {name: [rng.randrange(VOCAB) for _ in range(SYSTEM_BLOCKS * BLOCK)] for name in "ab"}
    replicas = {name: KVCacheManager(NUM_BLOCKS, BLOCK) for name in "ab"}
    for name, kv in replicas.items():
        inserted = churn(kv, systems[name], rng)
        assert inserted > 4 * REPORTED
        assert inserted > NUM_BLOCKS  # blocks were evicted as well
        assert kv.stats().prefix_cache_hits == (REQUESTS - 1) * SYSTEM_BLOCKS

    now = time.monotonic()
    views = {name: ReplicaView.from_report(report(kv), now) for name, kv in replicas.items()}
    for name, kv in replicas.items():
        system_hashes = hash_full_blocks(systems[name], BLOCK)
        assert set(system_hashes) <= set(kv.cached_prefix_summary(REPORTED))

        request = RoutedRequest(systems[name] + [rng.randrange(VOCAB) for _ in range(SUFFIX_TOKENS)], 16)
        hashes = request.block_hashes(BLOCK)
        assert cached_prefix_blocks(hashes, views[name]) == SYSTEM_BLOCKS
        assert len(kv.find_cached_prefix(request.prompt).blocks) == SYSTEM_BLOCKS  # the engine agrees
        other = "b" if name == "a" else "a"
        assert cached_prefix_blocks(hashes, views[other]) == 0
        # Equal loads (both idle, equally full caches): the prefix decides.
        assert placement(request, views[name], 0).key > placement(request, views[other], 0).key


def test_a_system_prompt_longer_than_the_report_scores_whole():
    """A prompt of more blocks than a report holds: its first blocks never make it into
    the report, but its deepest ones do (reuse touches a prefix in order, so the last
    block is the most recent), and they vouch for the whole prompt."""
    rng = random.Random(1)
    system_blocks = REPORTED + 904
    system = [rng.randrange(VOCAB) for _ in range(system_blocks * BLOCK)]
    kv = KVCacheManager(NUM_BLOCKS, BLOCK)
    live: deque[str] = deque()
    for i in range(50):
        prompt = system + [rng.randrange(VOCAB) for _ in range(SUFFIX_TOKENS)]
        cached = kv.find_cached_prefix(prompt)
        assert kv.allocate(str(i), len(prompt), cached)
        kv.cache_full_blocks(str(i), prompt, len(prompt))
        live.append(str(i))
        if len(live) > 4:
            kv.free(live.popleft())
    system_hashes = hash_full_blocks(system, BLOCK)
    reported = set(kv.cached_prefix_summary(REPORTED))
    assert system_hashes[0] not in reported and system_hashes[-1] in reported

    request = RoutedRequest(system + [rng.randrange(VOCAB) for _ in range(SUFFIX_TOKENS)], 16)
    view = ReplicaView.from_report(report(kv), time.monotonic())
    assert cached_prefix_blocks(request.block_hashes(BLOCK), view) == system_blocks
    assert len(kv.find_cached_prefix(request.prompt).blocks) == system_blocks
