"""The host tier's memory and its copies (the bookkeeping is kvcache/host_tier.py).

The host cache has the device cache's layout, one tensor per layer for K and for V, with
a slot where the device cache has a block, so a copy moves whole blocks of every layer
bytes for bytes, whatever the element type (fp8 caches' scales are per layer, not per
block). Off CUDA both tiers are RAM and a copy is a plain one; its memory is mapped
lazily (kv_sizing.lazy_zeros), so slots never used take none. On CUDA it is pinned, so
that copies run as DMA; they run on the step's stream, before its forward.
"""

import torch

from kvcache.host_tier import KVCopies
from replica.kv_sizing import KVCacheLayout, KVCaches, lazy_zeros


class HostKVCache:
    def __init__(self, layout: KVCacheLayout, num_slots: int):
        shape = layout.backend.kv_cache_shape(
            num_slots, layout.block_size, layout.num_kv_heads, layout.head_dim
        )
        pinned = layout.device.type == "cuda"
        self.caches: KVCaches = [
            (_host_tensor(shape, layout.dtype, pinned), _host_tensor(shape, layout.dtype, pinned))
            for _ in range(layout.num_layers)
        ]
        self.num_slots = num_slots

    def copy(self, copies: KVCopies, device_caches: KVCaches) -> None:
        """Run one step's copies in order: every offload, then every restore. They move
        bytes (torch has no index_copy for fp8 on CPU, and bytes are what must survive)."""
        device = device_caches[0][0].device
        pairs = [
            (_bytes(device_cache), _bytes(host_cache))
            for device_kv, host_kv in zip(device_caches, self.caches, strict=True)
            for device_cache, host_cache in zip(device_kv, host_kv, strict=True)
        ]
        if copies.offload:
            blocks = torch.tensor([block for block, _ in copies.offload], device=device)
            slots = torch.tensor([slot for _, slot in copies.offload])
            for device_cache, host_cache in pairs:
                host_cache.index_copy_(0, slots, device_cache.index_select(0, blocks).cpu())
        if copies.restore:
            slots = torch.tensor([slot for slot, _ in copies.restore])
            blocks = torch.tensor([block for _, block in copies.restore], device=device)
            for device_cache, host_cache in pairs:
                device_cache.index_copy_(0, blocks, host_cache.index_select(0, slots).to(device))


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache's bytes, one row per block."""
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True) if pinned else lazy_zeros(shape, dtype)
