"""Fixed pool of KV blocks with reference counts and an LRU of evictable cached blocks.

A block whose reference count drops to zero goes back to the free queue but keeps its
prefix hash, so a later request with the same prefix can revive it without recompute.
Allocation takes from the head of the queue (least recently freed), which evicts the
coldest cached content first.

Separately, the cached hashes are kept in order of last use (cached or reused), which is
what routers are told about: a shared system prompt that every request reuses stays at
the front of the report however many new blocks are cached after it.

With a host tier (host_tier.py), `on_evict` hears of each cached block just before
allocation hands it out, so that its content can be copied down first.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_evict: Callable[[int, bytes], None] | None = None,
    ):
        """on_evict(block id, hash): a cached block is about to be reused."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is LRU order: evict from the front, append freed blocks at the back.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # hash -> block id, least recently used first (dicts keep insertion order; touch re-inserts).
        self._cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks off the free queue, evicting their cached content."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if self.on_evict is not None and self._holds_cached(block):
                self.on_evict(block_id, block.block_hash)
            self._forget_hash(block)
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def share(self, block: Block) -> None:
        """Add a reference to a cached block, pulling it off the free queue if idle."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def touch(self, blocks: list[Block]) -> None:
        """Mark cached blocks as just used, in order (the last one becomes the most
        recent), so that `recent_hashes` reports blocks that requests keep reusing.
        Only real reuse should touch: lookups that take nothing leave the order alone."""
        for block in blocks:
            if self._holds_cached(block):
                self._cached[block.block_hash] = self._cached.pop(block.block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block under its chained hash; the first holder of a hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block. Free them tail first so that the
        deepest (least reusable) blocks of a sequence are evicted first."""
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Uncached blocks hold nothing worth keeping: reuse them first.
                    self._free[block.block_id] = None
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = None

    def recent_hashes(self, limit: int) -> list[bytes]:
        """Hashes of up to `limit` cached blocks, most recently used (cached or reused) first."""
        return list(islice(reversed(self._cached), limit))

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()

    def _holds_cached(self, block: Block) -> bool:
        return block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id

    def _forget_hash(self, block: Block) -> None:
        if self._holds_cached(block):
            del self._cached[block.block_hash]
        block.block_hash = None
