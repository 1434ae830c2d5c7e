"""Per-request block tables on top of the block pool, plus prefix-cache lookups and stats.

The manager knows requests only by id and token ids; the scheduler decides who gets
blocks, the manager decides which blocks. With a host tier (host_tier.py), a prefix
lookup runs on past the device cache's hits into the host's, and the blocks it finds
there are restored into fresh device blocks: to the scheduler they are cached tokens like
any other. The copies each step needs are taken with take_copies.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block_math import cdiv
from kvcache.block_pool import Block, BlockPool
from kvcache.hashing import ROOT_HASH, hash_block, hash_full_blocks
from kvcache.host_tier import HostTier, KVCopies


@dataclass
class KVStats:
    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # The host tier (0 blocks: none). Its queries are the blocks looked up past the device
    # cache's hits; its hits are the blocks restored from it.
    num_host_blocks: int = 0
    num_host_cached_blocks: int = 0
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    num_offloaded_blocks: int = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass
class CachedPrefix:
    """Result of a prefix-cache lookup, consumed by the request's first allocation:
    device blocks to share, then hashes of blocks to restore from the host tier."""

    blocks: list[Block]
    num_queried: int
    host_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Leading prompt blocks that need no prefill."""
        return len(self.blocks) + len(self.host_hashes)


@dataclass
class _RequestBlocks:
    blocks: list[Block] = field(default_factory=list)
    # Chained hashes of the blocks already published to the prefix cache.
    hashes: list[bytes] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ):
        """num_host_blocks: slots of the host tier (0: none; it needs prefix caching)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks and not enable_prefix_caching:
            raise ValueError("a host KV tier keeps prefix blocks: it needs enable_prefix_caching")
        self.block_size = block_size
        self.host = HostTier(num_host_blocks) if num_host_blocks else None
        on_evict = self.host.offload if self.host is not None else None
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, on_evict=on_evict)
        self.enable_prefix_caching = enable_prefix_caching
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_cache_queries = 0
        self.host_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        entry = self._requests.get(request_id)
        return [] if entry is None else [b.block_id for b in entry.blocks]

    def find_cached_prefix(self, token_ids: Sequence[int], root: bytes = ROOT_HASH) -> CachedPrefix:
        """Longest run of cached full blocks matching the start of token_ids.

        The last token is never taken from cache: the model must run on at least one
        token to produce logits. root: the first block's parent hash (a LoRA adapter's
        requests chain from their own, so they share KV only with each other).
        """
        if not self.enable_prefix_caching:
            return CachedPrefix([], 0)
        hashes = hash_full_blocks(token_ids[: len(token_ids) - 1], self.block_size, root)
        hits: list[Block] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        host_hashes = []
        if self.host is not None:
            for block_hash in hashes[len(hits) :]:
                if block_hash not in self.host:
                    break
                host_hashes.append(block_hash)
        return CachedPrefix(hits, len(hashes), host_hashes)

    def allocate(self, request_id: str, num_tokens: int, cached: CachedPrefix | None = None) -> bool:
        """Make the request hold enough blocks for num_tokens tokens in total.

        `cached` is only taken on the request's first allocation; its host-tier blocks
        are the first of the new ones, restored before the step's forward. Returns False,
        changing nothing, when the pool cannot cover the new blocks.
        """
        entry = self._requests.get(request_id)
        prefix = cached.blocks if entry is None and cached is not None else []
        restored = cached.host_hashes if entry is None and cached is not None else []
        # Idle cached blocks sit in the free queue: reviving them consumes free slots too.
        revived = sum(1 for b in prefix if b.ref_count == 0)
        held = len(prefix) if entry is None else len(entry.blocks)
        new = max(0, cdiv(num_tokens, self.block_size) - held)
        if new + revived > self.pool.num_free_blocks:
            return False
        if entry is None:
            entry = self._requests[request_id] = _RequestBlocks()
            if cached is not None:
                self.prefix_cache_queries += cached.num_queried
                self.prefix_cache_hits += len(cached.blocks)
                if self.host is not None:
                    self.host_cache_queries += cached.num_queried - len(cached.blocks)
                    self.host_cache_hits += len(restored)
            for block in prefix:
                self.pool.share(block)
            # Taken, not just looked up (the scheduler looks the head of its queue up
            # every step): only now do these blocks count as recently used.
            self.pool.touch(prefix)
            entry.blocks.extend(prefix)
            entry.hashes.extend(b.block_hash for b in prefix)
        for block_hash in restored:  # before allocating, whose evictions may take slots
            self.host.pin(block_hash)
        fresh = self.pool.allocate(new)
        for block, block_hash in zip(fresh[: len(restored)], restored, strict=True):
            self.host.restore(block_hash, block.block_id)
            self.pool.cache(block, block_hash)
            entry.hashes.append(block_hash)
        entry.blocks.extend(fresh)
        return True

    def take_copies(self) -> KVCopies:
        """The block copies that the allocations since the last call need, in order, for
        the step about to run (host_tier.py)."""
        return self.host.take_copies() if self.host is not None else KVCopies()

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int, root: bytes = ROOT_HASH
    ) -> None:
        """Publish the blocks that became full once num_computed tokens hold KV; root as
        in find_cached_prefix."""
        if not self.enable_prefix_caching:
            return
        entry = self._requests[request_id]
        num_full = min(num_computed // self.block_size, len(entry.blocks))
        parent = entry.hashes[-1] if entry.hashes else root
        for i in range(len(entry.hashes), num_full):
            start = i * self.block_size
            parent = hash_block(parent, token_ids[start : start + self.block_size])
            entry.hashes.append(parent)
            self.pool.cache(entry.blocks[i], parent)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (speculative decoding's
        rejected tokens). Only blocks never published are dropped: a published block holds
        known tokens, and num_tokens never falls below those."""
        entry = self._requests[request_id]
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(entry.hashes):
            raise ValueError(f"cannot trim {request_id} to {num_tokens} tokens: its blocks are published")
        if keep < len(entry.blocks):
            self.pool.free(entry.blocks[keep:])
            del entry.blocks[keep:]

    def free(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.pool.free(entry.blocks)

    def cached_prefix_summary(self, limit: int) -> list[bytes]:
        """A bounded sample of the prefix cache for routers: the hashes of the most
        recently used cached blocks (cached, or reused by a request), newest first, so
        that a prefix many requests share stays in it. Hashes are chained, so a router
        that finds one of its prompt's block hashes here knows the whole prefix up to
        that block was cached, even when earlier blocks fell outside the limit."""
        return self.pool.recent_hashes(limit)

    def host_prefix_summary(self, limit: int) -> list[bytes]:
        """The same for the host tier: its most recently used hashes, newest first."""
        return self.host.recent_hashes(limit) if self.host is not None else []

    def reset_prefix_cache(self, counters: KVStats) -> None:
        """Empty the prefix cache, both tiers, and set the counters to `counters`': the
        engine's warm-up forgets its dummy requests' blocks and lookups, and keeps the
        counts of the real ones."""
        self.pool.reset_prefix_cache()
        self.prefix_cache_queries = counters.prefix_cache_queries
        self.prefix_cache_hits = counters.prefix_cache_hits
        self.host_cache_queries = counters.host_cache_queries
        self.host_cache_hits = counters.host_cache_hits
        if self.host is not None:
            self.host.clear()
            self.host.num_offloaded = counters.num_offloaded_blocks
            self.host.num_restored = counters.host_cache_hits

    def stats(self) -> KVStats:
        return KVStats(
            num_free_blocks=self.pool.num_free_blocks,
            num_total_blocks=self.pool.num_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_host_blocks=self.host.num_slots if self.host is not None else 0,
            num_host_cached_blocks=self.host.num_cached_blocks if self.host is not None else 0,
            host_cache_queries=self.host_cache_queries,
            host_cache_hits=self.host_cache_hits,
            num_offloaded_blocks=self.host.num_offloaded if self.host is not None else 0,
        )
