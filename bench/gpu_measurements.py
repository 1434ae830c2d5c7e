"""What bench.gpu measures besides throughput: the device's copy bandwidth, the batch-1
decode step, and the Triton decode kernel's bandwidth, beside FlexAttention's
(bench/flex_decode.py)."""

import statistics
import time

import torch

from bench.runners import sync
from kvserve import LLM, SamplingParams


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device memory bandwidth (bytes/s) from a large copy: read + write bytes / time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def batch1_step(llm: LLM, prompt: list[int], steps: int, device: str) -> dict:
    """Median engine step and runner forward for one running request."""
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()  # prefill (+ first token)
    table = list(engine.kv.block_ids(rid))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    # The runner alone on the finished request's (now free) prompt blocks: graph replay + lm_head.
    runner, ctx = engine.runner, len(prompt)
    runner_times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.execute([[1]], [ctx], [table], [0])
        sync(device)
        runner_times.append(time.perf_counter() - start)
    return {
        "engine_step_s": statistics.median(times[5:] or times),
        "runner_step_s": statistics.median(runner_times[5:] or runner_times),
        "context_len": ctx,
        "cuda_graph": runner.graphs is not None,
    }


def _paged_inputs(batch: int, ctx: int, heads=32, kv_heads=8, head_dim=64, block_size=16, device="cuda"):
    per_seq = -(-ctx // block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(num_blocks, device=device).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    return q, k_cache, v_cache, tables, lens


def _cuda_seconds(call, reps: int = 50) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


# (batch, context): bench.gpu's batch-1 step, a long context, the cap-128 run's batch
DECODE_SHAPES = ((1, 512), (64, 4096), (128, 640))


def decode_kernel_bandwidth(bandwidth: float) -> dict:
    """The Triton decode kernel at batch 64 x 4096 context: seconds and K/V bandwidth."""
    from replica.attention.triton_decode import paged_decode

    q, k_cache, v_cache, tables, lens = _paged_inputs(64, 4096)
    out = torch.empty_like(q)
    seconds = _cuda_seconds(lambda: paged_decode(q, k_cache, v_cache, tables, lens, 64**-0.5, out=out))
    kv_bytes = 2 * 64 * 4096 * k_cache.shape[1] * k_cache.shape[3] * k_cache.element_size()
    return {
        "batch": 64,
        "context_len": 4096,
        "seconds": seconds,
        "kv_bytes": kv_bytes,
        "bandwidth_bytes_per_s": kv_bytes / seconds,
        "fraction_of_copy_bandwidth": kv_bytes / seconds / bandwidth,
    }


def decode_candidates(bandwidth: float) -> dict:
    """The Triton decode kernel against FlexAttention (bench/flex_decode.py, compiled) on
    the same cache at each of DECODE_SHAPES: seconds, K/V bandwidth, how far apart their
    outputs are; then the Triton kernel's tuning sweep at 64 x 4096."""
    q, k_cache, v_cache, tables, lens = _paged_inputs(64, 4096)
    kv_bytes = 2 * 64 * 4096 * k_cache.shape[1] * k_cache.shape[3] * k_cache.element_size()
    return {
        "against_flex_attention": [flex_against_triton(b, c, bandwidth) for b, c in DECODE_SHAPES],
        "tuning_sweep": tuning_sweep(q, k_cache, v_cache, tables, lens, kv_bytes, bandwidth),
    }


def tuning_sweep(q, k_cache, v_cache, tables, lens, kv_bytes: int, bandwidth: float) -> dict:
    """The decode kernel's split count and key tile at its default warps, then its warps at
    the best of those: what its defaults (choose_num_splits, BLOCK_N, 4 warps) leave."""
    from replica.attention.triton_decode import BLOCK_N, choose_num_splits, paged_decode

    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5

    def fraction(splits: int, block_n: int, warps: int) -> float:
        def call():
            paged_decode(
                q, k_cache, v_cache, tables, lens, scale, splits, out, block_n=block_n, num_warps=warps
            )

        return kv_bytes / _cuda_seconds(call, reps=20) / bandwidth

    runs = [
        {"num_splits": s, "block_n": n, "num_warps": 4, "fraction_of_copy_bandwidth": fraction(s, n, 4)}
        for s in (1, 2, 4, 8, 16)
        for n in (16, 32, 64)
    ]
    best = max(runs, key=lambda r: r["fraction_of_copy_bandwidth"])
    splits, block_n = best["num_splits"], best["block_n"]
    runs += [
        {**best, "num_warps": w, "fraction_of_copy_bandwidth": fraction(splits, block_n, w)} for w in (2, 8)
    ]
    max_tokens = tables.shape[1] * k_cache.shape[2]
    default_splits = choose_num_splits(q.shape[0], k_cache.shape[1], max_tokens, q.device)
    return {
        "batch": q.shape[0],
        "context_len": int(lens.max()),
        "defaults": {"num_splits": default_splits, "block_n": BLOCK_N, "num_warps": 4},
        "best": max(runs, key=lambda r: r["fraction_of_copy_bandwidth"]),
        "runs": runs,
    }


def flex_against_triton(batch: int, ctx: int, bandwidth: float) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    from bench.flex_decode import flex_paged_decode, paged_block_mask
    from replica.attention.triton_decode import paged_decode

    q, k_cache, v_cache, tables, lens = _paged_inputs(batch, ctx)
    num_blocks, kv_heads, block_size, head_dim = k_cache.shape
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * k_cache.element_size()
    row = {"batch": batch, "context_len": ctx}
    triton_out = torch.empty_like(q)
    row["triton_s"] = _cuda_seconds(
        lambda: paged_decode(q, k_cache, v_cache, tables, lens, scale, out=triton_out)
    )
    row["triton_fraction_of_copy_bandwidth"] = kv_bytes / row["triton_s"] / bandwidth
    mask = paged_block_mask(tables, lens, num_blocks, q.shape[1], kv_heads, block_size)
    flex = torch.compile(flex_attention)
    errors = []
    # The library's default tiles first; then key tiles of one page, where those refuse it.
    for options in (None, {"BLOCK_N": block_size}):
        try:
            flex_out = flex_paged_decode(q, k_cache, v_cache, mask, scale, flex, options)
            row["flex_s"] = _cuda_seconds(
                lambda o=options: flex_paged_decode(q, k_cache, v_cache, mask, scale, flex, o)
            )
        except Exception as e:  # a compile or shape the library refuses is a result too
            errors.append(f"kernel_options={options}: {type(e).__name__}: {e}"[:500])
            continue
        row["flex_kernel_options"] = options
        row["flex_fraction_of_copy_bandwidth"] = kv_bytes / row["flex_s"] / bandwidth
        row["max_abs_difference"] = (flex_out.float() - triton_out.float()).abs().max().item()
        row["faster"] = "flex_attention" if row["flex_s"] < row["triton_s"] else "triton"
        break
    if errors:
        row["flex_errors"] = errors
    return row
