"""FlexAttention as a paged decode candidate (bench/flex_decode.py), which bench.gpu times
compiled against the Triton kernel: here, eagerly on CPU, its mask over kvserve's own cache
gives dense attention's result for every sequence and head."""

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention_reference import dense_reference

from bench.flex_decode import flex_paged_decode, paged_block_mask


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 99),
)
def test_flex_paged_decode_equals_dense_attention(lens, kv_heads, group, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    heads, head_dim = kv_heads * group, 8
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 2  # blocks no sequence holds, too
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(used) + 1  # the engine pads each table with block 0
    tables, start = [], 0
    for n in used:
        tables.append(order[start : start + n] + [0] * (width - n))
        start += n
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g) for _ in range(2))
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    mask = paged_block_mask(
        torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
        num_blocks, heads, kv_heads, block_size,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's note that eager mode is unfused
        out = flex_paged_decode(q, k_cache, v_cache, mask, head_dim**-0.5)
    for b, n in enumerate(lens):
        keys = k_cache[tables[b][: used[b]]].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        values = v_cache[tables[b][: used[b]]].transpose(1, 2).reshape(-1, kv_heads, head_dim)[:n]
        expected = dense_reference(q[b : b + 1], keys, values, head_dim**-0.5)[0]
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)
