"""One rank's paged KV cache: its layout, how many blocks it holds, and its tensors.

Off CUDA the cache is the size `kv_cache_memory_gb` asks for. On CUDA it takes what
`gpu_memory_utilization` of the device leaves after the weights, non-torch memory (CUDA
context, other processes) and the peak of the largest step the scheduler can send,
which the runner profiles on a throwaway cache.
"""

import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replica.attention import Backend

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # (K, V) per layer


@dataclass
class KVCacheLayout:
    backend: Backend  # whose kernels read the cache, in their own layout
    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate(self, num_blocks: int) -> KVCaches:
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            return [
                (lazy_zeros(shape, self.dtype), lazy_zeros(shape, self.dtype)) for _ in range(self.num_layers)
            ]
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on anonymous memory of its own: the kernel maps each page when
    it is first written and unmaps all of them when the tensor goes. torch.zeros writes
    every page at once, so a cache of which a few blocks are used would be resident in
    full, and its freed pages would stay with the allocator rather than the machine."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=count).view(shape)


def kv_blocks_for_memory(memory_gb: float, bytes_per_block: int) -> int:
    return max(1, int(memory_gb * 2**30) // bytes_per_block)


def kv_blocks_for_gpu(total_bytes: int, utilization: float, used_bytes: int, bytes_per_block: int) -> int:
    """Blocks for the block pool: the utilization share of the device, minus what the
    weights, the profiled peak activations and non-torch memory (CUDA context, other
    processes) already use, minus the one scratch block CUDA-graph padding writes to."""
    budget = int(total_bytes * utilization) - used_bytes - bytes_per_block
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"no room for a KV cache: the model and its peak step use {used_bytes / 2**30:.2f} GiB of the "
            f"{total_bytes * utilization / 2**30:.2f} GiB that gpu_memory_utilization={utilization} allows; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return blocks


def measure_kv_blocks_on_gpu(
    layout: KVCacheLayout, utilization: float, profile_step: Callable[[], None]
) -> int:
    """Blocks that fit beside the loaded weights and the peak of `profile_step`, which
    runs the largest step on a cache of its own and frees it."""
    device = layout.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    profile_step()
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    blocks = kv_blocks_for_gpu(total, utilization, peak + non_torch, layout.bytes_per_block)
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB); peak step %.2f GiB, non-torch %.2f GiB of %.2f GiB",
        blocks,
        layout.block_size,
        blocks * layout.bytes_per_block / 2**30,
        peak / 2**30,
        non_torch / 2**30,
        total / 2**30,
    )
    return blocks


def largest_step(
    max_num_batched_tokens: int, max_seq_len: int, block_size: int
) -> tuple[list[int], list[list[int]]]:
    """The largest step the scheduler can send: max_num_batched_tokens of prefill in as
    few sequences as max_seq_len positions allow. Returns their lengths and block tables,
    which use blocks 0, 1, ... in turn."""
    lens = [max_seq_len] * (max_num_batched_tokens // max_seq_len)
    if max_num_batched_tokens % max_seq_len:
        lens.append(max_num_batched_tokens % max_seq_len)
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    return lens, tables
