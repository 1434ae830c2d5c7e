"""What the attention function needs to know about one packed step, built once on the
CPU side and shared by every layer.

Packed order: all decode rows (one query token each) first, then each prefill chunk.
Decode rows are batched together; prefill chunks are few per step and run one by one.
Reads go through block tables (whole blocks at a time), writes through slot_mapping.
The torch backend walks `prefills`; kernels (Triton, flash-attn) take the same facts as
flat int32 tensors, so one launch covers every chunk and CUDA graphs see fixed shapes.
"""

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the packed batch
    end: int
    context_len: int  # tokens of this sequence with KV after this step (earlier + chunk)
    block_table: torch.Tensor | None  # blocks covering the context; None when nothing precedes the chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every packed token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32, padded with block 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True where valid
    prefills: list[PrefillChunk]
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    # Kernel view of the prefill chunks, P of them; tables cover the whole context,
    # including this step's tokens (the write happens before attention reads).
    prefill_query_starts: torch.Tensor | None  # [P + 1] int32 packed rows, starting at num_decodes
    prefill_context_lens: torch.Tensor | None  # [P] int32
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] int32, padded with block 0
    max_prefill_query_len: int = 0
    # A kernel backend's own form of the fields above, derived on the step's first layer
    # and reused by the rest (the CPU kernels keep their ctypes arguments here).
    kernel_args: tuple | None = None


def build_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
    decode_mask: bool = True,
) -> AttentionMetadata:
    """Rows must come decodes first (query_len 1), then prefill chunks. decode_mask=False
    leaves decode_mask None, for backends that read the context lengths instead (only the
    torch backend reads it; on a CPU its few small ops are part of every step's host work)."""
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1

    slot_mapping = []
    for table, ctx, q in zip(block_tables, context_lens, query_lens, strict=True):
        slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx))

    decode_tables = mask = decode_lens = None
    if num_decodes:
        lens = context_lens[:num_decodes]
        width = -(-max(lens) // block_size)
        rows = [t[:width] + [0] * (width - len(t[:width])) for t in block_tables[:num_decodes]]
        decode_tables = torch.tensor(rows, dtype=torch.int32, device=device)
        if decode_mask:
            positions = torch.arange(width * block_size)
            mask = (positions[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].to(device)
        decode_lens = torch.tensor(lens, dtype=torch.int32, device=device)

    prefills = []
    row = num_decodes
    for i in range(num_decodes, len(query_lens)):
        ctx, q = context_lens[i], query_lens[i]
        table = None
        if ctx > q:
            table = torch.tensor(block_tables[i][: -(-ctx // block_size)], dtype=torch.long, device=device)
        prefills.append(PrefillChunk(row, row + q, ctx, table))
        row += q

    starts = lens = tables = None
    if prefills:
        starts = torch.tensor([c.start for c in prefills] + [row], dtype=torch.int32, device=device)
        lens = torch.tensor([c.context_len for c in prefills], dtype=torch.int32, device=device)
        width = -(-max(c.context_len for c in prefills) // block_size)
        rows = [
            block_tables[i][:width] + [0] * (width - len(block_tables[i][:width]))
            for i in range(num_decodes, len(query_lens))
        ]
        tables = torch.tensor(rows, dtype=torch.int32, device=device)

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_block_tables=decode_tables,
        decode_mask=mask,
        prefills=prefills,
        decode_context_lens=decode_lens,
        prefill_query_starts=starts,
        prefill_context_lens=lens,
        prefill_block_tables=tables,
        max_prefill_query_len=max((c.end - c.start for c in prefills), default=0),
    )
