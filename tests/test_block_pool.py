import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache import BlockPool, KVCacheManager, NoFreeBlocksError, hash_full_blocks


def test_allocate_and_free_roundtrip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    assert all(b.ref_count == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_is_detected():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


def test_cached_free_blocks_are_evicted_lru():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.free([a])
    pool.free([b])
    pool.free([c])  # uncached: goes to the front, reused first
    assert pool.allocate(1)[0] is c
    assert pool.lookup(b"a") is a and pool.lookup(b"b") is b
    assert pool.allocate(1)[0] is a  # a was freed before b: least recently used
    assert pool.lookup(b"a") is None
    assert pool.lookup(b"b") is b


def test_sharing_a_cached_block_revives_it():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"h")
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.share(a)
    assert a.ref_count == 1 and pool.num_free_blocks == 1


def test_chained_hashes_depend_on_the_whole_prefix():
    x = hash_full_blocks([1, 2, 3, 4, 5, 6], 2)
    y = hash_full_blocks([9, 2, 3, 4, 5, 6], 2)
    assert len(x) == 3
    assert x[1] != y[1]  # same tokens in block 1, different prefix
    assert hash_full_blocks([1, 2, 3, 4, 5], 2) == x[:2]  # partial block not hashed


def test_manager_shares_prefix_blocks_and_counts_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    assert kv.allocate("a", len(prompt), kv.find_cached_prefix(prompt))
    kv.cache_full_blocks("a", prompt, num_computed=10)
    hit = kv.find_cached_prefix(prompt + [99])
    assert len(hit.blocks) == 2  # the two full blocks of "a"
    assert kv.allocate("b", 11, hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.stats().prefix_cache_hits == 2
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_manager_never_serves_the_last_token_from_cache():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(8))
    kv.allocate("a", 8)
    kv.cache_full_blocks("a", prompt, 8)
    assert len(kv.find_cached_prefix(prompt).blocks) == 1


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert not kv.allocate("a", 9)
    assert kv.num_free_blocks == 2
    assert kv.block_ids("a") == []


def _run(kv: KVCacheManager, request_id: str, prompt: list[int]) -> None:
    """Admit a request as the scheduler does and compute its whole prompt."""
    assert kv.allocate(request_id, len(prompt), kv.find_cached_prefix(prompt))
    kv.cache_full_blocks(request_id, prompt, len(prompt))


def test_a_reused_block_is_reported_ahead_of_newer_untouched_ones():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    shared, other = list(range(9)), list(range(100, 109))  # 2 cacheable blocks each
    _run(kv, "a", shared)
    _run(kv, "b", other)
    kv.free("a")
    kv.free("b")
    shared_hashes, other_hashes = hash_full_blocks(shared, 4), hash_full_blocks(other, 4)
    assert kv.cached_prefix_summary(2) == other_hashes[::-1]  # newest first
    _run(kv, "c", shared[:8] + [7])  # reuses both of the shared prompt's blocks
    assert kv.cached_prefix_summary(2) == shared_hashes[::-1]
    assert kv.cached_prefix_summary(4) == shared_hashes[::-1] + other_hashes[::-1]


def test_looking_a_prefix_up_without_taking_it_leaves_the_report_alone():
    """The scheduler looks the head of its queue up every step, even while it cannot
    admit it: only taking the blocks counts as use."""
    kv = KVCacheManager(num_blocks=5, block_size=4)
    shared, other = list(range(9)), list(range(100, 109))
    _run(kv, "a", shared)
    kv.free("a")
    _run(kv, "b", other)
    before = kv.cached_prefix_summary(10)
    cached = kv.find_cached_prefix(shared + [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(cached.blocks) == 2
    assert not kv.allocate("c", 25, cached)  # 7 blocks: 2 to revive + 5 new > 2 free
    assert kv.cached_prefix_summary(10) == before


def test_touch_skips_blocks_that_hold_no_cached_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"a")
    pool.touch([b, a])
    assert pool.recent_hashes(5) == [b"a"]


@given(st.lists(st.tuples(st.sampled_from(["cache", "reuse", "free"]), st.integers(0, 63)), max_size=80))
def test_reported_hashes_follow_last_use(ops):
    """Against a plain list model: caching or reusing a block makes it the most recent;
    eviction (allocating over an idle cached block) drops it; nothing else reorders."""
    pool = BlockPool(6)
    order: list[bytes] = []  # least recently used first
    held: list = []
    next_hash = 0
    for op, i in ops:
        if op == "cache" and pool.num_free_blocks:
            (block,) = pool.allocate(1)
            order = [h for h in order if pool.lookup(h) is not None]  # evicted hashes leave
            block_hash = next_hash.to_bytes(4, "big")
            next_hash += 1
            pool.cache(block, block_hash)
            order.append(block_hash)
            held.append(block)
        elif op == "reuse" and order:
            block = pool.lookup(order[i % len(order)])
            pool.share(block)
            pool.touch([block])
            order.remove(block.block_hash)
            order.append(block.block_hash)
            held.append(block)
        elif op == "free" and held:
            pool.free([held.pop(i % len(held))])
        assert pool.recent_hashes(len(order) + 1) == order[::-1]
        assert pool.recent_hashes(2) == order[::-1][:2]
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_count == 0)
