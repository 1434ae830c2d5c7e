"""The collectives one tensor-parallel replica needs, over its own process group.

The group is built from a TCPStore the driver (rank 0) serves, rather than through
torch.distributed's global default group: several engines may live in one process
(tests, a batch actor restarted in place), and each needs a group of its own.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Long enough for the slowest rank to load its weights before the first collective.
TIMEOUT = datetime.timedelta(minutes=10)


def serve_store(host: str, world_size: int) -> dist.TCPStore:
    """Rank 0's store, on a free port (`.port`) that the other ranks are then told."""
    return dist.TCPStore(host, 0, world_size, True, timeout=TIMEOUT, wait_for_workers=False)


def connect_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, False, timeout=TIMEOUT)


@dataclass
class TPGroup:
    rank: int
    world_size: int
    process_group: dist.ProcessGroup
    store: dist.Store  # rank 0's is the server, which must outlive the group

    @classmethod
    def join(cls, store: dist.Store, rank: int, world_size: int, device: torch.device) -> "TPGroup":
        """Returns once every rank has joined (NCCL on CUDA, gloo on CPU)."""
        prefixed = dist.PrefixStore("kvserve-tp", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, TIMEOUT)
        return cls(rank, world_size, group, store)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self.process_group.allreduce([tensor]).wait()
        return tensor

    def min(self, value: int, device: torch.device) -> int:
        tensor = torch.tensor([value], dtype=torch.long, device=device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.process_group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's `tensor`, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.process_group.broadcast([tensor], options).wait()
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` (same shape on all) concatenated along the last
        dimension on rank 0, in rank order; None on the other ranks."""
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == 0 else []
        self.process_group.gather(parts, [tensor.contiguous()], options).wait()
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None
