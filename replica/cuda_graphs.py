"""CUDA graphs for pure-decode steps.

A decode step of a small model is dozens of short kernel launches per layer, so at small
batch the GPU waits on Python and the launch queue, not on memory. A captured graph
replays the whole forward with one launch. Graphs fix shapes and addresses, so:

- batches are padded up to a bucket size (1, 2, 4, ... up to the cap) and each bucket
  has its own graph;
- every input lives in a static buffer sized for the largest bucket, and a step copies
  its values in before replay;
- block tables are always full width (max_model_len / block_size columns); kernels read
  only up to each row's context length, so stale columns are never looked at;
- pad rows feed token 0 at position 0, write their K/V into a scratch block that the
  block pool never hands out, and attend to that one slot (context length 1), so they
  can't touch a real sequence's KV.

The padded path also runs eagerly (capture=False), which is how it is tested on CPU.
"""

import bisect
from collections.abc import Callable

import torch

from replica.attention import AttentionMetadata
from replica.input_batch import Fill
from replica.lora.batch import LoRABatch

# Columns of the packed per-row inputs: one host-to-device copy fills them all. LORA is
# the row's LoRA adapter slot (-1: none; pad rows have none).
TOKEN, POSITION, SLOT, CONTEXT_LEN, LORA = range(5)

Forward = Callable[..., torch.Tensor]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself. Decoding is memory-bound, so a
    padded row costs little next to one more captured graph."""
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def pad_decode_batch(
    token_ids: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    bucket: int,
    block_size: int,
    scratch_block: int,
    lora_slots: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side of one padded decode step. Returns rows [bucket, 5] int64 (token,
    position, slot, context length, LoRA slot) and block tables [bucket, width] int32,
    where width covers the longest real context."""
    n = len(token_ids)
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit a bucket of {bucket}")
    rows = []
    loras = lora_slots or [-1] * n
    for token, ctx, table, lora in zip(token_ids, context_lens, block_tables, loras, strict=True):
        pos = ctx - 1
        rows.append((token, pos, table[pos // block_size] * block_size + pos % block_size, ctx, lora))
    rows += [(0, 0, scratch_block * block_size, 1, -1)] * (bucket - n)

    width = max([-(-ctx // block_size) for ctx in context_lens], default=1)
    tables = [table[:width] + [scratch_block] * (width - len(table[:width])) for table in block_tables]
    tables += [[scratch_block] * width] * (bucket - n)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(tables, dtype=torch.int32)


class DecodeGraphRunner:
    """Static buffers, one graph per bucket, and the step that fills and replays them."""

    def __init__(
        self,
        forward: Forward,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        build_mask: bool = False,
        lora: bool = False,
    ):
        """lora: the model has LoRA adapters (enable_lora): every graph applies each row's
        adapter slot, -1 for none, so steps with adapter rows replay graphs too."""
        self.forward = forward  # (input_ids [1, B], positions [1, B], metadata) -> hidden [1, B, E]
        self.lora = lora
        self.sizes = graph_batch_sizes(max_batch)
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.build_mask = build_mask  # the torch backend reads a [B, 1, 1, positions] mask
        self.rows = torch.zeros((max_batch, 5), dtype=torch.long, device=device)
        self.tables = torch.full(
            (max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_batch

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        pool = None
        for bucket in reversed(self.sizes):
            self._load([], [], [], bucket)  # all pad rows: capture never touches real KV
            self._body(bucket)  # warm-up outside the graph: Triton JIT, cuBLAS workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._body(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def run(
        self,
        token_ids: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        fill: Fill | None = None,
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """One decode step of len(token_ids) sequences; returns their hidden states [n, E].
        `fill` (row indices, token ids) sets tokens that are still on the device (async
        scheduling); lora_slots, each row's adapter slot (None: none has one). The result
        is a view into graph memory, valid until the next run."""
        if lora_slots is not None and not self.lora:
            raise ValueError("LoRA rows in a graph runner built without lora")
        n = len(token_ids)
        bucket = bucket_for(n, self.sizes)
        if bucket is None:
            raise ValueError(f"{n} sequences exceed the largest graph batch {self.max_batch}")
        self._load(token_ids, context_lens, block_tables, bucket, lora_slots)
        if fill is not None:
            self.rows[fill[0], TOKEN] = fill[1]
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            hidden = self.outputs[bucket]
        else:
            hidden = self._body(bucket)
        return hidden[0, :n]

    def _load(self, token_ids, context_lens, block_tables, bucket: int, lora_slots=None) -> None:
        rows, tables = pad_decode_batch(
            token_ids, context_lens, block_tables, bucket, self.block_size, self.scratch_block, lora_slots
        )
        self.rows[:bucket].copy_(rows, non_blocking=True)
        self.tables[:bucket, : tables.shape[1]].copy_(tables, non_blocking=True)

    def _body(self, bucket: int) -> torch.Tensor:
        """What a graph holds: typed views of the static buffers, then the forward."""
        rows = self.rows[:bucket]
        context_lens = rows[:, CONTEXT_LEN].to(torch.int32)
        tables = self.tables[:bucket]
        mask = None
        if self.build_mask:
            positions = torch.arange(tables.shape[1] * self.block_size, device=rows.device)
            mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=rows[:, SLOT].contiguous(),
            num_decodes=bucket,
            decode_block_tables=tables,
            decode_mask=mask,
            prefills=[],
            decode_context_lens=context_lens,
            prefill_query_starts=None,
            prefill_context_lens=None,
            prefill_block_tables=None,
        )
        input_ids = rows[:, TOKEN].contiguous()[None]
        positions = rows[:, POSITION].contiguous()[None]
        if not self.lora:
            return self.forward(input_ids, positions, meta)
        return self.forward(input_ids, positions, meta, lora=LoRABatch(rows[:, LORA].contiguous()))
