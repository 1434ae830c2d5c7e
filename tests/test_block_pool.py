import pytest

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
