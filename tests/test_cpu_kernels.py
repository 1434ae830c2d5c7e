"""kvserve's C kernels (replica/cpu) against the torch and transformers code they stand
in for: paged attention against dense causal attention (both page layouts, rotary fused
or not), and the norms, activation, argmax and packed linears against their modules."""

import ctypes
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention_reference import dense_reference
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from replica.attention import build_metadata
from replica.attention.torch_backend import kv_cache_shape
from replica.cpu import abi, build, linear_kernels, ops
from replica.cpu.kernel_choice import LinearChoice
from replica.cpu.layers import PackedLinear, RotaryTable

# Tolerances against an fp32 reference: bf16 inputs, outputs and probabilities round.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(params=[False, True], ids=["fresh-by-kernel", "fresh-by-sdpa"])
def fresh_prefills_by_sdpa(request, monkeypatch):
    """Both ways a fresh prefill is attended, whichever one measured faster here."""
    monkeypatch.setattr(ops, "FRESH_PREFILLS_BY_SDPA", request.param)


def _rotary(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None].float() * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def random_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed):
    """For each (cached, new) token count in seqs: a block table scattered over a cache of
    num_blocks (two spare), and random q, k and v for all its tokens."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    qs, ks, vs = [], [], []
    for c, n in seqs:
        qs.append(torch.randn(c + n, heads, head_dim, generator=g).to(dtype))
        ks.append(torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype))
        vs.append(torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype))
    return num_blocks, tables, qs, ks, vs


def run_attention(seqs, heads, kv_heads, head_dim, block_size, dtype, rotary, seed):
    """Two kernel steps over a scattered paged cache: first each sequence's history
    (cached tokens) as a prefill, then the step under test (decode rows, fresh prefills,
    chunks after a prefix), each compared with dense attention over the whole sequence."""
    num_blocks, tables, qs, ks, vs = random_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed)
    # NaN wherever nothing was written: a kernel that lets unwritten cache memory reach
    # its output (even times a zero probability) fails the comparison.
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    scale = head_dim**-0.5

    def step(rows: list[int], starts: list[int], ends: list[int]):
        meta = build_metadata(
            [tables[i] for i in rows],
            ends,
            [e - s for s, e in zip(starts, ends, strict=True)],
            block_size,
            "cpu",
        )
        pick = lambda xs: torch.cat([xs[i][s:e] for i, s, e in zip(rows, starts, ends, strict=True)])  # noqa: E731
        cos = sin = None
        if rotary:
            positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
            cos, sin = (t.to(dtype) for t in _rotary(positions, head_dim))
        out = ops.paged_attention(pick(qs), pick(ks), pick(vs), k_cache, v_cache, meta, scale, cos, sin)
        row = 0
        for i, s, e in zip(rows, starts, ends, strict=True):
            q, k, v = (t.float() for t in (qs[i][:e], ks[i][:e], vs[i][:e]))
            if rotary:
                cos, sin = _rotary(torch.arange(e), head_dim)
                q, k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
                q, k = q.transpose(0, 1), k.transpose(0, 1)
            expected = dense_reference(q[s:], k, v, scale)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(out[row : row + e - s].float(), expected, atol=tol, rtol=tol)
            row += e - s

    history = [i for i, (c, _) in enumerate(seqs) if c > 0]
    if history:
        step(history, [0] * len(history), [seqs[i][0] for i in history])
    # build_metadata wants decode rows (one new token after a history) first.
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0] > 0))
    step(order, [seqs[i][0] for i in order], [sum(seqs[i]) for i in order])


# (250, 12) and (290, 13): chunks past the paired prefill kernel's first 256 keys, one
# with rows on both sides of that boundary.
SEQS = [(5, 1), (40, 1), (1, 1), (0, 19), (23, 9), (0, 1), (64, 3), (250, 12), (290, 13)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "block_size"),
    # (16, 4): generic pages; (64, 16), (128, 16), (32, 32) and (256, 64): in bf16 on
    # AVX512-BF16 CPUs, the paired pages (D % 32 == 0, BS % 16 == 0), including the
    # specialised shapes, both query-row tile sizes (4 rows up to D = 64, 2 above) and
    # shapes past the specialisations, up to more of attend_rows' register bounds.
    [(16, 4), (64, 16), (128, 16), (32, 32), (256, 64)],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_paged_attention_matches_dense(dtype, head_dim, block_size, heads, kv_heads, fresh_prefills_by_sdpa):
    run_attention(SEQS, heads, kv_heads, head_dim, block_size, dtype, rotary=False, seed=heads + head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(16, 4), (64, 16)])
def test_fused_rotary_matches_transformers(dtype, head_dim, block_size, fresh_prefills_by_sdpa):
    run_attention(SEQS, 4, 2, head_dim, block_size, dtype, rotary=True, seed=7)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 3, 16, 32]),
    group=st.sampled_from([1, 3]),
    bf16=st.booleans(),
    fresh_by_sdpa=st.booleans(),
)
def test_paged_attention_any_batch(seqs, block_size, group, bf16, fresh_by_sdpa):
    dtype = torch.bfloat16 if bf16 else torch.float32
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "FRESH_PREFILLS_BY_SDPA", fresh_by_sdpa)
        run_attention(seqs, 2 * group, 2, 32, block_size, dtype, rotary=bf16, seed=len(seqs))


def test_negative_slots_write_nothing():
    """Padded rows (slot -1) of a CUDA-graph-style batch must leave the cache untouched."""
    k_cache = torch.zeros(kv_cache_shape(2, 4, 1, 16))
    v_cache = torch.zeros_like(k_cache)
    meta = build_metadata([[0]], [1], [1], 4, "cpu")
    meta.slot_mapping.fill_(-1)
    q, k, v = (torch.randn(1, 1, 16) for _ in range(3))
    ops.paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    assert not k_cache.any() and not v_cache.any()


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 3000), min_size=1, max_size=12), min_size=1, max_size=4),
    bf16=st.booleans(),
    head_dim=st.sampled_from([16, 48, 64, 80]),
    scaling=st.sampled_from([None, {"rope_type": "linear", "factor": 2.0}]),
)
def test_rotary_table_equals_the_module_at_any_positions(steps, bf16, head_dim, scaling):
    """Each step's positions (any order, repeats, growing past the table) get the module's
    own cos and sin, bit for bit."""
    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=4096,
        rope_scaling=scaling,
    )  # fmt: skip
    module = LlamaRotaryEmbedding(config)
    table = RotaryTable(module)
    assert table.static
    x = torch.empty(0, dtype=torch.bfloat16 if bf16 else torch.float32)
    for positions in map(torch.tensor, steps):
        cos, sin = table(x, positions)
        expected_cos, expected_sin = module(x, positions[None])
        assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
        assert cos.dtype == x.dtype and cos.is_contiguous()


def test_rotary_table_stays_within_the_context_until_a_position_passes_it():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=100)
    module = LlamaRotaryEmbedding(config)
    table, x = RotaryTable(module), torch.empty(0)
    for position, size in [(3, 100), (99, 100), (150, 256), (255, 256), (256, 512)]:
        cos, sin = table(x, torch.tensor([position]))
        expected_cos, expected_sin = module(x, torch.tensor([[position]]))
        assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
        assert table.cos.shape[0] == size, position


def test_rotary_table_leaves_length_dependent_ropes_to_the_module():
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    module = LlamaRotaryEmbedding(config)
    table = RotaryTable(module)
    assert not table.static
    x, positions = torch.empty(0), torch.arange(200)  # past max_position_embeddings: rescaled
    cos, _ = table(x, positions)
    assert torch.equal(cos, module(x, positions[None])[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, residual = torch.randn(2, 7, 96).to(dtype), torch.randn(2, 7, 96).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x))
    expected_sum = residual + x
    fused = ops.rms_norm(x, norm.weight, 1e-5, residual=residual)
    torch.testing.assert_close(residual, expected_sum)  # the skip connection, in place
    torch.testing.assert_close(fused, norm(expected_sum))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gate_up = torch.randn(5, 3, 2 * 40).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_including_ties(dtype):
    x = torch.randn(33, 49157).to(dtype)
    x[3, [10, 4000, 49000]] = 100.0  # ties resolve to the first index, as in torch
    x[4] = 0.0
    assert torch.equal(ops.argmax(x), torch.argmax(x, dim=-1))


# The sampling kernel (replica/cpu/sampling.c) draws by inverse CDF: the first token whose
# running sum of weights exceeds draw x total, walked in vocabulary order, or by rank
# among a filtered row's kept tokens. Its float32 rounding moves the CDF's edges from
# where float64 puts them; these are first-order bounds on how far, in units of float32's
# rounding, 2^-24. They are bounds, not statistics: a check that fails with them is a
# kernel (or a bound) that is wrong, whatever the seed.
ULP = 2.0**-24
# Each weight exp((x - max) / T) is off by at most 4 |x - max| / T + 4 ulps of itself:
# four roundings of the exponent (x - max, T, 1 / T, their product), then exp_clamped's
# 2 ulp of the result (4 of 2^-24); |x - max| / T <= 87, below which weights are 0.
WEIGHT_ULPS = 4 * 87 + 4
# Weights off by a relative r move a normalised edge by at most r / 2. A filtered row
# sums its kept weights in float64, so only the weights move its edges: 1.05e-5.
FILTERED_EDGE = WEIGHT_ULPS / 2 * ULP
# Two weights trade ranks, or one its side of min_p x the top weight, only within the
# error of both (and of min_p in float32): 4.2e-5 of the weight.
TIE = (2 * WEIGHT_ULPS + 2) * ULP


def walk_edge(vocab: int) -> float:
    """How far the unfiltered walk can move an edge, as a fraction of the total: it sums
    each 64-token chunk (at most 63 roundings), then adds the chunk sums one by one and at
    most 64 weights after them, so its running sum carries at most chunks + 127 ulps of
    the total, and draw x total chunks + 64; the weights add WEIGHT_ULPS / 2. 2.4e-5 at
    vocabulary 1000, 1.1e-4 at 49157."""
    return (2 * math.ceil(vocab / 64) + 191 + WEIGHT_ULPS / 2) * ULP


def inverse_cdf_miss(position: int, probs: torch.Tensor, draw: float, eps: float) -> str | None:
    """Why picking `position` of probs (float64, in the order the walk takes them) is not
    inverse-CDF sampling of `draw` with edges moved by up to eps; None when it is.

    The exact pick, e, is the position whose interval [lo, hi) of the normalised CDF
    holds the draw. Another position, t, is a near tie only if the draw lies within eps
    of e's edge on t's side and t's own interval reaches to within eps of the draw: t is
    the next position with probability across that edge, past at most eps of mass
    (positions without probability have empty intervals, and rounding steps over
    intervals narrower than itself)."""
    hi = probs.cumsum(0) / probs.sum()
    lo = hi - probs / probs.sum()
    exact = min(int(torch.searchsorted(hi, torch.tensor([draw], dtype=hi.dtype), right=True)), len(probs) - 1)
    if position == exact:
        return None
    if not probs[position] > 0:
        return f"{position} has no probability; the draw {draw} picks {exact}"
    if position > exact:
        edge, reach = hi[exact] - draw, lo[position] - draw
    else:
        edge, reach = draw - lo[exact], draw - hi[position]
    if edge >= eps:
        return f"the draw {draw} lies {edge:.3g} inside {exact}'s interval [{lo[exact]:.8f}, {hi[exact]:.8f})"
    if reach >= eps:
        interval = f"[{lo[position]:.8f}, {hi[position]:.8f})"
        return f"{position}'s interval {interval} is {reach:.3g} from the draw {draw}"
    return None


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    vocab=st.sampled_from([1, 5, 64, 65, 1000, 49157]),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    bf16=st.booleans(),
)
def test_sample_draws_what_the_torch_inverse_cdf_draws(seed, vocab, temperature, bf16):
    """The same draw picks the same token as softmax and cumsum in float64, or, where the
    draw lies within float32 rounding (walk_edge) of that token's edge, the token across
    it."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, vocab, generator=g) * 4).to(torch.bfloat16 if bf16 else torch.float32)
    draws = torch.rand(6, 1, generator=g)
    tokens = ops.sample(logits, torch.full((6,), temperature), draws)
    if temperature == 0:
        assert torch.equal(tokens, logits.float().argmax(-1))
        return
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    for row in range(6):
        miss = inverse_cdf_miss(int(tokens[row]), probs[row], draws[row].item(), walk_edge(vocab))
        assert miss is None, (row, miss)


def test_sample_never_picks_a_token_without_probability():
    logits = torch.full((4000, 100), -1e4)
    logits[:, [3, 50, 99]] = torch.tensor([1.0, 0.0, 2.0])
    uniform = torch.rand(4000, 1, generator=torch.Generator().manual_seed(0))
    for draws in (uniform, torch.zeros(4000, 1), torch.full((4000, 1), 1 - 2**-24)):
        assert set(ops.sample(logits, torch.ones(4000), draws).tolist()) <= {3, 50, 99}


def _kept_by_rank(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> list[int]:
    """One row's kept tokens, by rank (probability, then index), in float64: the
    definition the kernel's filters follow."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
    kept, before = [], 0.0
    for rank, i in enumerate(order):
        p = probs[i].item()
        if p == 0 or (rank and (rank >= top_k or before >= top_p or p < min_p * probs[order[0]].item())):
            break
        kept.append(i)
        before += p
    return kept


def _kept_count(ranked: torch.Tensor, top_k: int, top_p: float, min_p: float) -> int:
    """len(_kept_by_rank(...)) for probabilities already ranked, in one pass of torch ops."""
    before = ranked.cumsum(0) - ranked
    keep = (torch.arange(len(ranked)) < top_k) & (before < top_p) & (ranked >= min_p * ranked[0])
    keep &= ranked > 0
    keep[0] = ranked[0] > 0
    return int(keep.long().cumprod(0).sum())


def filtered_miss(token: int, probs: torch.Tensor, draw: float, top_k: int, top_p: float, min_p: float):
    """Why `token` is not what the kernel's filtered walk can pick for `draw` from probs
    (a row's float64 softmax), or None when it is. The walk ranks the tokens (probability,
    then index), keeps a prefix (_kept_by_rank) and picks by inverse CDF along it.
    Rounding may keep one token more or fewer where the mass before it lies within the
    rounding of the total of top_p, or its weight within TIE of min_p x the top one, and
    may rank two tokens the other way where their weights lie within TIE of each other:
    so each prefix those allow is tried, with the token in its own place or in that of a
    token it ties with (which moves its interval by at most TIE of their weights)."""
    order = torch.sort(-probs, stable=True).indices
    ranked = probs[order]
    # The kernel compares the mass before a token with top_p x its float32 total (no
    # limit at top_p 1): the total's summation adds chunks + 63 ulps to the weights' error.
    p_margin = (math.ceil(len(probs) / 64) + 64 + WEIGHT_ULPS / 2) * ULP if top_p < 1 else 0.0
    fewest = _kept_count(ranked, top_k, top_p - p_margin, min_p * (1 + TIE))
    most = _kept_count(ranked, top_k, top_p + p_margin, min_p * (1 - TIE))
    places = ((ranked - probs[token]).abs() <= TIE * probs[token]).nonzero()[:, 0].tolist()
    misses = []
    exact = _kept_count(ranked, top_k, top_p, min_p)  # first: where nothing lies near a boundary
    for count in [exact, *(c for c in range(fewest, most + 1) if c != exact)]:
        swap = (len(places) - 1) * TIE * float(probs[token] / ranked[:count].sum())
        for place in (p for p in places if p < count):
            miss = inverse_cdf_miss(place, ranked[:count], draw, FILTERED_EDGE + swap)
            if miss is None:
                return None
            misses.append(f"at rank {place} of {count} kept: {miss}")
    return f"token {token}: " + ("; ".join(misses) or f"not among the {most} kept at most")


# (top_k with 0 for none, top_p, min_p)
FILTERS = st.tuples(
    st.sampled_from([0, 1, 2, 5, 40]),
    st.sampled_from([1.0, 0.95, 0.5, 0.05]),
    st.sampled_from([0.0, 0.05, 0.5]),
)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    vocab=st.sampled_from([5, 64, 65, 1000, 49157]),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    filters=FILTERS,
)
def test_filtered_sample_draws_by_rank_among_the_kept_tokens(seed, vocab, temperature, filters):
    """The same draw picks the same token as walking the kept tokens by rank in float64,
    or one that float32 rounding can put in its place (filtered_miss); a row that
    filters nothing walks the vocabulary (walk_edge)."""
    top_k, top_p, min_p = filters
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g) * 4
    draws = torch.rand(6, 1, generator=g)
    tokens = ops.sample(
        logits, torch.full((6,), temperature), draws, torch.full((6,), top_k or vocab),
        torch.full((6,), top_p), torch.full((6,), min_p),
    )  # fmt: skip
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    for row in range(6):
        token, draw = int(tokens[row]), draws[row].item()
        if (top_k or vocab) >= vocab and top_p == 1.0 and min_p == 0.0:
            miss = inverse_cdf_miss(token, probs[row], draw, walk_edge(vocab))
        else:
            miss = filtered_miss(token, probs[row], draw, top_k or vocab, top_p, min_p)
        assert miss is None, (row, miss)


def test_the_near_tie_checks_reject_a_wrong_token():
    """The rounding allowance names the one edge the draw is near: a token across another
    edge, or past its neighbour's interval, is wrong however narrow the intervals are.
    At vocabulary 49157 and temperature 2 about 70% of draws lie within 1e-4 of some
    edge, where an allowance for any edge would pass any token."""
    probs = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4], dtype=torch.double)  # edges 0.1, 0.3, 0.3, 0.6
    eps = 1e-4
    for position, draw in [(3, 0.45), (1, 0.3 + 5e-5), (3, 0.3 - 5e-5), (4, 0.6 - 5e-5), (0, 0.1 + 5e-5)]:
        assert inverse_cdf_miss(position, probs, draw, eps) is None, (position, draw)
    # Across the other edge, onto the empty interval, past the neighbour, or beyond eps.
    wrong = [(1, 0.45), (4, 0.45), (2, 0.30005), (0, 0.30005), (4, 0.30005), (1, 0.3002), (4, 0.5998)]
    for position, draw in wrong:
        assert inverse_cdf_miss(position, probs, draw, eps) is not None, (position, draw)

    # The kernel's own picks at a large vocabulary, for a draw within 1e-4 of some edge,
    # and tokens a chunk of 64 away (what a walk that miscounted chunks would give), then
    # 64 ranks away or outside the kept ones.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49157, generator=g) * 4
    draws = torch.rand(8, 1, generator=g)
    probs = torch.softmax(logits.double() / 2, dim=-1)
    edges = torch.cat([torch.zeros(8, 1, dtype=torch.double), probs.cumsum(-1)], dim=-1)
    row = next(r for r in range(8) if (edges[r] - draws[r].item()).abs().min() < 1e-4)
    p, draw = probs[row], draws[row].item()
    token = int(ops.sample(logits[row : row + 1], torch.tensor([2.0]), draws[row : row + 1]))
    assert inverse_cdf_miss(token, p, draw, walk_edge(49157)) is None
    for planted in (token - 64, token + 64):
        assert inverse_cdf_miss(planted, p, draw, walk_edge(49157)) is not None, planted

    top_p = 0.95
    one = (logits[row : row + 1], torch.tensor([2.0]), draws[row : row + 1])
    token = int(ops.sample(*one, None, torch.tensor([top_p])))
    assert filtered_miss(token, p, draw, 49157, top_p, 0.0) is None
    order = torch.sort(-p, stable=True).indices.tolist()
    kept, rank = _kept_count(p[order], 49157, top_p, 0.0), order.index(token)
    for planted in (order[max(rank - 64, 0)], order[min(rank + 64, kept - 1)], order[kept + 10]):
        assert filtered_miss(planted, p, draw, 49157, top_p, 0.0) is not None, planted


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.sampled_from([-math.inf, -3.0, -1.0, 0.0, 0.0, 1.0, 2.5]), min_size=1, max_size=200),
    temperature=st.sampled_from([0.5, 1.0]),
    filters=FILTERS,
    draw=st.sampled_from([0.0, 0.3, 0.999, 1 - 2**-24]),
    bf16=st.booleans(),
)
def test_filtered_sample_only_picks_kept_tokens(logits, temperature, filters, draw, bf16):
    """Ties, -inf and edge draws: the token is one the filters keep (ties ranked by index)."""
    top_k, top_p, min_p = filters
    row = torch.tensor([logits]).to(torch.bfloat16 if bf16 else torch.float32)
    if row.isinf().all():
        return
    token = ops.sample(
        row, torch.tensor([temperature]), torch.tensor([[draw]]), torch.tensor([top_k or len(logits)]),
        torch.tensor([top_p]), torch.tensor([min_p]),
    ).item()  # fmt: skip
    probs = torch.softmax(row.double()[0] / temperature, dim=-1)
    assert token in _kept_by_rank(probs, top_k or len(logits), top_p + 1e-6, min_p * (1 - 1e-6))


def _forced(kernel: str, dtype: torch.dtype) -> LinearChoice:
    if not linear_kernels.can_run(kernel, dtype, 64):
        pytest.skip(f"{kernel} cannot run {dtype} on this CPU")
    return LinearChoice.forced(kernel)


# Each kernel forced, and a choice that switches kernels between row buckets.
CHOICES = [*linear_kernels.LINEAR_KERNELS, "by rows"]


def _choice(name: str, dtype: torch.dtype) -> LinearChoice:
    if name != "by rows":
        return _forced(name, dtype)
    runnable = [k for k in linear_kernels.LINEAR_KERNELS if linear_kernels.can_run(k, dtype, 64)]
    return LinearChoice((1, 8, 32, 128), tuple(runnable[i % len(runnable)] for i in range(4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", CHOICES)
def test_packed_linear_matches_linear(dtype, bias, kernel):
    """Every kernel that can run here, and a choice that changes kernel with the row
    count: widths that are not whole panels, and rows that are not whole tiles or chunks
    of them."""
    torch.manual_seed(0)
    first, second = (
        torch.nn.Linear(64, 40, bias=bias).to(dtype),
        torch.nn.Linear(64, 16, bias=False).to(dtype),
    )
    weight = torch.cat([first.weight, second.weight])
    bias_ = torch.cat([first.bias, torch.zeros(16, dtype=dtype)]) if bias else None
    fused = PackedLinear(weight, bias_, _choice(kernel, dtype))
    assert set(fused.layouts) == fused.choice.used()  # no layout for a kernel that never runs
    for rows in (1, 7, 13, 130, 500):
        x = torch.randn(rows, 64).to(dtype)
        expected = torch.cat([first(x), second(x)], dim=-1)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(fused(x), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [36, 96])
@pytest.mark.parametrize("kernel", CHOICES)
def test_gated_linear_matches_silu_mlp(dtype, bias, width, kernel):
    """A gated PackedLinear against transformers' MLP expression act_fn(gate(x)) * up(x)."""
    torch.manual_seed(1)
    gate, up = (torch.nn.Linear(128, width, bias=bias).to(dtype) for _ in range(2))
    weight = torch.cat([gate.weight, up.weight])
    gated = PackedLinear(
        weight, torch.cat([gate.bias, up.bias]) if bias else None, _choice(kernel, dtype), gated=True
    )
    for rows in (1, 5, 12, 400):
        x = torch.randn(rows, 128).to(dtype)
        expected = torch.nn.functional.silu(gate(x)) * up(x)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(gated(x), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="gemm.c's kernel needs AVX512-BF16 (vdpbf16ps)"
)
def test_own_bf16_gemm_rounds_like_onednn():
    """gemm.c accumulates in fp32 and rounds once, as oneDNN does: on a decoder's shapes
    they agree on all but a few elements in a thousand, and those by one bf16 step."""
    torch.manual_seed(2)
    assert ops.bf16_gemm_available()
    for n, k in ((960, 576), (576, 1536)):
        weight = torch.randn(n, k).bfloat16() * 0.05
        ours = PackedLinear(weight, None, LinearChoice.forced(linear_kernels.GEMM_C))
        onednn = PackedLinear(weight, None, LinearChoice.forced(linear_kernels.ONEDNN))
        for rows in (1, 64, 777):
            x = torch.randn(rows, k).bfloat16()
            got, expected = ours(x), onednn(x)
            assert (got == expected).float().mean() > 0.99
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=2**-7)


def test_own_f32_gemm_every_tile_split():
    """gemm_f32 splits the rows into tiles of equal heights up to 6 (8 rows as 4 + 4): every
    row count up to three tiles, against F.linear in fp32, on a width that is not whole
    panels."""
    if not ops.f32_gemm_available():
        pytest.skip("gemm.c's fp32 kernel needs AVX2 and FMA")
    torch.manual_seed(3)
    weight, bias = torch.randn(37, 96), torch.randn(37)
    packed = ops.pack_f32_weight(weight)
    for rows in range(1, 19):
        x = torch.randn(rows, 96)
        expected = torch.nn.functional.linear(x, weight, bias)
        torch.testing.assert_close(ops.gemm_f32(x, packed, bias, 37), expected, atol=1e-4, rtol=1e-5)


def test_own_f32_gemm_row_blocks():
    """Rows beyond one block of x (F32_BLOCK_BYTES, 384 KiB: 16 tiles of 6 rows at
    k = 1024) go in several blocks, the last one partial and with tiles of 5 and 6 rows,
    and every row gets its result."""
    if not ops.f32_gemm_available():
        pytest.skip("gemm.c's fp32 kernel needs AVX2 and FMA")
    torch.manual_seed(4)
    weight, bias = torch.randn(40, 1024), torch.randn(40)
    packed = ops.pack_f32_weight(weight)
    for rows in (96, 97, 250):
        x = torch.randn(rows, 1024)
        expected = torch.nn.functional.linear(x, weight, bias)
        torch.testing.assert_close(ops.gemm_f32(x, packed, bias, 40), expected, atol=1e-3, rtol=1e-5)


def test_kernels_refuse_other_dtypes():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.silu_mul(torch.randn(2, 8, dtype=torch.float16))


def test_a_failing_build_says_why(monkeypatch, tmp_path):
    """A compiler that fails is reported (and `auto` then falls back to torch)."""
    from replica.attention.select import cpu_kernels_built

    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(build, "SOURCES", [tmp_path / "kernels.c"])
    (tmp_path / "kernels.c").write_text("int broken(;\n")
    build.load_library.cache_clear()
    try:
        with pytest.raises(build.CpuKernelsUnavailable, match="failed to build"):
            build.load_library()
        assert not cpu_kernels_built()
    finally:
        build.load_library.cache_clear()


def _header_prototypes() -> dict[str, tuple[list, object]]:
    """kvserve_abi.h's function prototypes, as ctypes (argument types, result type)."""
    header = next(h for h in build.HEADERS if h.name == "kvserve_abi.h")
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    text = re.sub(r"typedef struct \{.*?\} \w+;", "", text, flags=re.S)
    scalars = {"void": None, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
               "float": ctypes.c_float, "size_t": ctypes.c_size_t}  # fmt: skip
    structs = {
        s.__name__: ctypes.POINTER(s)
        for s in (abi.StepLayout, abi.DecoderShape, abi.DecoderLayer, abi.GroupWeight)
    }

    def ctype(declaration: str):
        words = declaration.replace("*", " * ").split()
        if "*" not in words:
            return scalars[words[-2] if len(words) > 1 else words[0]]
        return next((structs[w] for w in words if w in structs), ctypes.c_void_p)

    prototypes = {}
    for result, name, params in re.findall(r"(\w+)\s+(\w+)\(([^)]*)\);", text):
        args = [] if params.strip() == "void" else [ctype(p) for p in params.split(",")]
        prototypes[name] = (args, scalars[result])
    return prototypes


def test_bindings_match_the_header():
    """build.py binds every function kvserve_abi.h declares, with the header's argument
    and result types: the compiler checks the C side against the header, this the Python side."""
    prototypes = _header_prototypes()
    assert "paged_attention" in prototypes and "decoder_forward" in prototypes
    assert set(build.SIGNATURES) == set(prototypes)
    for name, (argtypes, restype) in build.SIGNATURES.items():
        assert (argtypes, restype) == prototypes[name], name


def test_a_struct_that_differs_from_the_header_fails_at_load(monkeypatch):
    class Shorter(ctypes.Structure):
        _fields_ = [("slots", ctypes.c_void_p)]

    lib = build.load_library()
    monkeypatch.setattr(build, "SIZE_FUNCTIONS", {Shorter: "kvserve_step_layout_size"})
    with pytest.raises(RuntimeError, match="abi.Shorter is 8 bytes"):
        build._declare(lib)
