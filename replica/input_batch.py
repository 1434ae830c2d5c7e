"""A step's rows packed into the one 1 x T forward the runner makes of them, and which
of the packed rows' hidden states the step keeps.

Row i of a step feeds its new tokens as the last of a context of context_lens[i]; all
rows' tokens are laid end to end, decode rows (one token each) first.
"""

import itertools
from dataclasses import dataclass

import torch

from replica.attention import AttentionMetadata, build_metadata

# Decode rows whose input token is still on the device: (row indices, token ids).
Fill = tuple[list[int], torch.Tensor]


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    meta: AttentionMetadata


def pack_inputs(
    token_ids: list[list[int]],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    fill: Fill | None = None,
    decode_mask: bool = True,
) -> PackedInputs:
    """`fill`'s tokens replace their rows' placeholders in token_ids on the device, so
    that the host never waits for them. decode_mask: as build_metadata's."""
    query_lens = [len(t) for t in token_ids]
    flat = [t for row in token_ids for t in row]
    positions = [p for ctx, q in zip(context_lens, query_lens, strict=True) for p in range(ctx - q, ctx)]
    meta = build_metadata(block_tables, context_lens, query_lens, block_size, device, decode_mask)
    input_ids = torch.tensor([flat], dtype=torch.long, device=device)
    if fill is not None:  # decode rows come first, so decode row i is packed token i
        input_ids[0, fill[0]] = fill[1]
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)
    return PackedInputs(input_ids, position_ids, meta)


def rows_to_keep(
    query_lens: list[int], sample_rows: list[int], prompt_rows: list[int] | None
) -> tuple[list[int] | None, list[int] | None]:
    """The packed rows whose hidden states the step wants, ascending (None: every row),
    and the order that puts the sampling rows' (each row's last token) first and the
    prompt rows' after them (None: already in that order)."""
    last_rows = list(itertools.accumulate(query_lens))
    rows = [last_rows[i] - 1 for i in sample_rows]
    order = None
    if prompt_rows:  # the fused decoder wants ascending rows: merge, then reorder
        rows, order = _merge_rows(rows, prompt_rows)
    if rows == list(range(last_rows[-1])):  # a decode step where every row samples
        rows = None
    return rows, order


def _merge_rows(sample_rows: list[int], prompt_rows: list[int]) -> tuple[list[int], list[int]]:
    """Both sets of (disjoint) packed rows, ascending, and the order that puts the
    sampling rows' hidden states first and the prompt rows' after them."""
    merged = sorted(sample_rows + prompt_rows)
    where = {row: i for i, row in enumerate(merged)}
    return merged, [where[r] for r in (*sample_rows, *prompt_rows)]
