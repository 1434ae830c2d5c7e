"""The second KV tier: host-memory slots that keep prefix blocks the device cache evicts.

A device block that holds a published prefix block and is about to be reused is copied
down to a slot here first (offload), keyed by the same chained hash. A later prompt whose
prefix runs on past the device cache's hits into hashes held here gets those blocks
copied back into fresh device blocks before its prefill (restore), which then starts
after them. Copying a block costs far less than recomputing its tokens.

Only bookkeeping lives here; the copies are device work. Each step's copies are
collected as KVCopies, in the order they must run: every offload before any restore, so
that a device block evicted and refilled in the same step is read before it is
overwritten. A slot that a pending copy reads or writes is pinned until the step takes
its copies, so that no later eviction in the same step hands it out again.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice


@dataclass
class KVCopies:
    """One step's block copies, run before its forward: offloads, then restores."""

    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restore: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)

    def __bool__(self) -> bool:
        return bool(self.offload or self.restore)


class HostTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # hash -> slot, least recently used first (offloaded, or restored from).
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._copies = KVCopies()
        self.num_offloaded = 0  # blocks copied down, since start
        self.num_restored = 0  # blocks copied back

    @property
    def num_cached_blocks(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def offload(self, device_block: int, block_hash: bytes) -> None:
        """The device is about to reuse `device_block`, which holds `block_hash`: keep a
        copy, in a free slot or the least recently used unpinned one. A hash already held
        is only marked as used; with every slot pinned the block is dropped."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slots[block_hash] = slot
        self._pinned.add(slot)
        self._copies.offload.append((device_block, slot))
        self.num_offloaded += 1

    def restore(self, block_hash: bytes, device_block: int) -> None:
        """Copy the block held under `block_hash` into `device_block` before this step's
        forward. The slot keeps its copy (a device block can be evicted again)."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._pinned.add(slot)
        self._copies.restore.append((slot, device_block))
        self.num_restored += 1

    def pin(self, block_hash: bytes) -> None:
        """Keep this hash's slot through the step's evictions: a restore of it follows."""
        self._pinned.add(self._slots[block_hash])

    def take_copies(self) -> KVCopies:
        """The copies collected since the last call, for the step about to run; every
        slot is evictable again once they are handed over, since later copies run after."""
        copies, self._copies = self._copies, KVCopies()
        self._pinned.clear()
        return copies

    def recent_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` held hashes, most recently used first."""
        return list(islice(reversed(self._slots), limit))

    def clear(self) -> None:
        """Forget every block (the engine's warm-up). Copies not yet taken still run."""
        for block_hash in [h for h, slot in self._slots.items() if slot not in self._pinned]:
            self._free.append(self._slots.pop(block_hash))

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[block_hash]
                return slot
        return None
