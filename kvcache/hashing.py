"""Chained hashes of full token blocks.

A block's hash covers its own tokens and, through its parent's hash, every token before
it, so equal hashes mean equal prefixes. sha256 keeps the value stable across processes
(the router and the replicas hash the same prompt independently).
"""

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()[:16]


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of every full block of token_ids, in order."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
