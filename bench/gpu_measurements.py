"""What bench.gpu measures besides throughput: the device's copy bandwidth, the batch-1
decode step, and the Triton decode kernel's bandwidth."""

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


def decode_kernel_bandwidth(bandwidth: float) -> dict:
    from replica.attention.triton_decode import paged_decode

    batch, ctx, heads, kv_heads, head_dim, block_size = 64, 4096, 32, 8, 64, 16
    per_seq = ctx // block_size
    num_blocks = batch * per_seq
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    for _ in range(3):
        paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out)
    torch.cuda.synchronize()
    reps = 50
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * k_cache.element_size()
    return {
        "batch": batch,
        "context_len": ctx,
        "seconds": seconds,
        "kv_bytes": kv_bytes,
        "bandwidth_bytes_per_s": kv_bytes / seconds,
        "fraction_of_copy_bandwidth": kv_bytes / seconds / bandwidth,
    }
