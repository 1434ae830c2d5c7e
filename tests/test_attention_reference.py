"""The torch paged backend against plain dense causal attention (the math itself),
across block sizes, GQA ratios, ragged lengths, decode rows and prefix-hit chunks."""

import pytest
import torch

from replica.attention import ForwardContext, build_metadata, forward_context
from replica.attention.torch_backend import kv_cache_shape, torch_paged_attention


class _Layer(torch.nn.Module):
    layer_idx = 0


def dense_reference(q, k, v, scale):
    """q [Tq, H, D] are the last Tq positions of k/v [Tk, Hkv, D]."""
    tq, h, _ = q.shape
    tk, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_matches_dense(block_size, heads, kv_heads):
    g = torch.Generator().manual_seed(block_size * 100 + heads * 10 + kv_heads)
    d = 16
    # (cached tokens already in the cache, new tokens this step): decodes first, then
    # a fresh prefill, a chunk after a prefix hit, and a 1-token-prompt prefill.
    seqs = [(5, 1), (17, 1), (1, 1), (0, 9), (12, 7), (0, 1)]
    seqs.sort(key=lambda s: s[1] != 1 or s[0] == 0)  # decode rows (with history) first
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = torch.zeros(kv_cache_shape(num_blocks, block_size, kv_heads, d))
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks

    full_k, full_v, tables, queries = [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, kv_heads, d, generator=g)
        v = torch.randn(total, kv_heads, d, generator=g)
        for pos in range(cached):  # history written by earlier steps
            k_cache[table[pos // block_size], :, pos % block_size] = k[pos]
            v_cache[table[pos // block_size], :, pos % block_size] = v[pos]
        full_k.append(k)
        full_v.append(v)
        tables.append(table)
        queries.append(torch.randn(new, heads, d, generator=g))

    context_lens = [c + n for c, n in seqs]
    query_lens = [n for _, n in seqs]
    meta = build_metadata(tables, context_lens, query_lens, block_size, torch.device("cpu"))
    q = torch.cat(queries)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    scale = d**-0.5
    with forward_context(ForwardContext([(k_cache, v_cache)], meta)):
        out, _ = torch_paged_attention(
            _Layer(),
            q.transpose(0, 1)[None],
            k_new.transpose(0, 1)[None],
            v_new.transpose(0, 1)[None],
            None,
            scaling=scale,
        )
    out = out[0]
    row = 0
    for (_, new), qs, k, v in zip(seqs, queries, full_k, full_v, strict=True):
        expected = dense_reference(qs, k, v, scale)
        torch.testing.assert_close(out[row : row + new], expected, atol=1e-5, rtol=1e-5)
        row += new
