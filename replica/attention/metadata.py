"""What the attention function needs to know about one packed step, built once on the
CPU side and shared by every layer.

Packed order: all decode rows (one query token each) first, then each prefill chunk.
Decode rows are batched together; prefill chunks are few per step and run one by one.
"""

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the packed batch
    end: int
    context_len: int  # tokens of this sequence with KV after this step (cached + chunk)
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when nothing precedes the chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every packed token
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] cache slots (padded)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] True where valid
    prefills: list[PrefillChunk]


def build_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Rows must come decodes first (query_len 1), then prefill chunks."""
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1

    slot_mapping = []
    for table, ctx, q in zip(block_tables, context_lens, query_lens, strict=True):
        slot_mapping.extend(_slots(table, range(ctx - q, ctx), block_size))

    decode_slots = decode_mask = None
    if num_decodes:
        lens = torch.tensor(context_lens[:num_decodes])
        width = int(lens.max())
        max_blocks = -(-width // block_size)
        tables = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in block_tables[:num_decodes]])
        positions = torch.arange(width)
        decode_slots = tables[:, positions // block_size] * block_size + positions % block_size
        decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        decode_slots, decode_mask = decode_slots.to(device), decode_mask.to(device)

    prefills = []
    row = num_decodes
    for table, ctx, q in zip(
        block_tables[num_decodes:], context_lens[num_decodes:], query_lens[num_decodes:], strict=True
    ):
        context_slots = None
        if ctx > q:
            context_slots = torch.tensor(_slots(table, range(ctx), block_size), device=device)
        prefills.append(PrefillChunk(row, row + q, ctx, context_slots))
        row += q

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
    )


def _slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]
