"""Where a GPU decode step's time goes (bench.gpu), and the usual single-stream baseline.

profile_decode_steps runs steady decode steps of the engine under torch.profiler and
returns, per step: the kernels launched, the top 20 kernels by GPU time with their counts,
the GPU's idle share within the steps, and the host's time outside the runner's forward
(scheduling, sampling, outputs) and inside it outside the graph replay (input copies,
lm_head's launch). On a CPU run (bench.gpu --smoke, the device kit's rehearsal) the
"kernels" are the top-level aten ops, so the same code is exercised without a GPU.

hf_static_cache_step times transformers' `generate` at batch 1 with a static cache,
compiled (torch.compile, mode "reduce-overhead": CUDA graphs) on a GPU.
"""

import statistics
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM, CompileConfig

from bench.runners import sync
from kvserve import LLM, SamplingParams

STEP, EXECUTE, GRAPH = "kvserve.step", "kvserve.runner.execute", "kvserve.graph_replay"


def _labelled(name: str, fn):
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return run


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, -float("inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profile_decode_steps(
    llm: LLM, prompt_len: int, batch: int, steps: int, device: str, seed: int = 0
) -> dict:
    """`batch` requests of `prompt_len` random tokens are prefilled, then `steps` decode
    steps of all of them are profiled."""
    engine, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, runner.vocab_size, (prompt_len,), generator=g).tolist(), params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(device)
    execute, graphs = runner.execute, runner.graphs
    runner.execute = _labelled(EXECUTE, execute)
    if graphs is not None:
        graph_run, graphs.run = graphs.run, _labelled(GRAPH, graphs.run)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function(STEP):
                    engine.step()
            sync(device)
    finally:
        del runner.execute  # the bound method again
        if graphs is not None:
            graphs.run = graph_run
    while engine.has_unfinished():
        engine.step()
    return _summarise(prof.events(), steps, device, batch, prompt_len)


def _summarise(events, steps: int, device: str, batch: int, prompt_len: int) -> dict:
    ranges = defaultdict(list)
    for e in events:
        if e.name in (STEP, EXECUTE, GRAPH) and e.device_type == DeviceType.CPU:
            ranges[e.name].append((e.time_range.start, e.time_range.end))
    if device == "cuda":
        launched = [e for e in events if e.device_type == DeviceType.CUDA]
        kind = "CUDA kernels and copies"
    else:  # the rehearsal: top-level aten ops stand in for kernels
        launched = [
            e
            for e in events
            if e.name.startswith("aten::")
            and e.device_type == DeviceType.CPU
            and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        ]
        kind = "top-level aten ops (a CPU run)"
    copies = [e for e in launched if e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in launched if e not in copies]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:20]
    window = (
        max(end for _, end in ranges[STEP]) - min(start for start, _ in ranges[STEP]) if ranges[STEP] else 0.0
    )
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in launched])

    def per_step_ms(name: str) -> float:
        return sum(end - start for start, end in ranges[name]) / steps / 1e3

    step_ms, execute_ms = per_step_ms(STEP), per_step_ms(EXECUTE)
    return {
        "batch": batch,
        "context_len": prompt_len,
        "steps": steps,
        "what_is_counted": kind,
        "kernels_per_step": len(kernels) / steps,
        "copies_per_step": len(copies) / steps,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "step_ms": step_ms,
        "gpu_idle_share": 1 - busy / window if window else None,
        "host_outside_execute_ms": step_ms - execute_ms,
        "host_in_execute_outside_graph_ms": execute_ms - per_step_ms(GRAPH) if ranges[GRAPH] else None,
        "graph_replays_per_step": len(ranges[GRAPH]) / steps,
        "top_kernels": [
            {"name": name[:160], "count_per_step": len(times) / steps, "us_per_step": sum(times) / steps}
            for name, times in top
        ],
    }


def hf_static_cache_step(
    model_dir, device: str, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0
) -> dict:
    """transformers' batch-1 time per token with a static cache: generate(new_tokens)
    against generate(1) (prefill and the first token), medians of 3 after two warm-ups.
    On a GPU generate compiles the decoding forward (CompileConfig: torch.compile, mode
    "reduce-overhead", fullgraph); on a CPU it runs eagerly."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    compiled = device == "cuda"
    config = model.generation_config
    config.cache_implementation = "static"
    config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    config.disable_compile = not compiled
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed)).to(device)

    def generate(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        sync(device)
        return time.perf_counter() - start

    for n in (new_tokens, new_tokens):
        generate(n)
    long = statistics.median(generate(new_tokens) for _ in range(3))
    short = statistics.median(generate(1) for _ in range(3))
    model = None  # noqa: F841 (its memory, before the caller's next part)
    return {
        "compiled": compiled,
        "compile_config": {"mode": "reduce-overhead", "fullgraph": True} if compiled else None,
        "context_len": prompt_len,
        "new_tokens": new_tokens,
        "per_token_s": (long - short) / (new_tokens - 1),
    }
