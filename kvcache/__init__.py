"""Paged KV memory: block pool, per-request block tables, prefix-cache hashing. No model code."""

from kvcache.block_pool import Block, BlockPool, NoFreeBlocksError
from kvcache.hashing import hash_block, hash_full_blocks
from kvcache.kv_manager import CachedPrefix, KVCacheManager, KVStats

__all__ = [
    "Block",
    "CachedPrefix",
    "BlockPool",
    "KVCacheManager",
    "KVStats",
    "NoFreeBlocksError",
    "hash_block",
    "hash_full_blocks",
]
