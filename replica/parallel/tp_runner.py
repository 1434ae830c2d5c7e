"""Rank 0 of a tensor-parallel replica, as the engine sees it: rank 0's ModelRunner,
with the other ranks (workers.py) started beside it.

Each step goes to the workers first and then to rank 0's runner: every rank runs the
same forward, whose collectives join them, and rank 0's returns the logits. The engine
uses this runner as it uses a ModelRunner; the workers' liveness is this one's to check.
"""

import torch
from transformers import AutoConfig

from kvcache.host_tier import KVCopies
from replica.config import EngineConfig
from replica.cpu.affinity import CorePlan
from replica.devices import resolve_device
from replica.input_batch import Fill
from replica.model_runner import ModelRunner
from replica.parallel.group import TPGroup
from replica.parallel.sharding import check_shardable
from replica.parallel.workers import WorkerSet


class TensorParallelRunner:
    def __init__(self, config: EngineConfig, model_path):
        """Start the workers, then build rank 0 beside them (its group joins theirs).
        A size that cannot split the model is refused before any worker starts."""
        check_shardable(AutoConfig.from_pretrained(model_path), config.tensor_parallel_size)
        self.workers = WorkerSet(config, model_path)
        device = resolve_device(config.device)

        def build_rank0() -> ModelRunner:
            group = TPGroup.join(self.workers.store, 0, config.tensor_parallel_size, device)
            return ModelRunner(config, model_path, group)

        self.rank0 = self.workers.run_beside(build_rank0)
        # What the engine reads, fixed once rank 0 is built. Every rank holds the same
        # number of blocks (ModelRunner takes the group's minimum).
        self.model = self.rank0.model
        self.device = self.rank0.device
        self.backend = self.rank0.backend
        self.block_size = self.rank0.block_size
        self.num_blocks = self.rank0.num_blocks
        self.num_host_blocks = self.rank0.num_host_blocks
        self.max_model_len = self.rank0.max_model_len
        self.vocab_size = self.rank0.vocab_size
        self.dtype = self.rank0.dtype
        self.kv_dtype = self.rank0.kv_dtype
        self.weights = self.rank0.weights

    def use_cores(self, plan: CorePlan) -> None:
        """Rank 0's steps only: each worker is a process of its own."""
        self.rank0.use_cores(plan)

    async def check_alive(self) -> None:
        """Raises when a worker is gone or stuck: the replica's steps fail from then on."""
        await self.workers.check_alive()

    def execute(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
        fill: Fill | None = None,
        prompt_rows: list[int] | None = None,
        lora_slots: list[int] | None = None,
        kv_copies: KVCopies | None = None,
    ) -> torch.Tensor:
        """ModelRunner.execute on every rank. The workers get the rows of `fill` only:
        its tokens stay on rank 0's device, which broadcasts them in the forward. No
        lora_slots: EngineConfig refuses LoRA with tensor parallelism."""
        assert lora_slots is None, "LoRA adapters do not run with tensor parallelism"
        fill_rows = fill[0] if fill is not None else None
        args = (token_ids, context_lens, block_tables, sample_rows)
        self.workers.execute(*args, fill_rows, prompt_rows, kv_copies)
        return self.rank0.execute(*args, fill=fill, prompt_rows=prompt_rows, kv_copies=kv_copies)
