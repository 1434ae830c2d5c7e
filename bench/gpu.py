"""GPU benchmark (H100/H200): the numbers the GPU path is held to, in one run.

Model: random weights (seeded) with Llama-3.2-1B's shape in bf16, saved to a temp dir with
the bundled tokenizer. Its vocab is smaller than the model's, so prompts are token ids and
out-of-vocab output ids just decode to nothing.

a. Throughput on the Anyscale workload: 512-token random prompts, output lengths drawn
   from an exponential with mean 128, capped at 32/128/512/1536, EOS ignored. kvserve
   (auto backend, CUDA graphs) vs HF static `generate` (fixed batches; all prompts have one
   length, so no padding; a batch runs until its longest request, min_new_tokens =
   max_new_tokens) vs transformers' continuous batching (the manager behind
   `generate_batch`, given each request's own max_new_tokens). Each system gets the GPU to
   itself in turn; throughput counts only the tokens each request asked for.
b. Batch-1 decode step (engine step, and the runner's forward + lm_head alone) against the
   memory floor: bytes a step must read (weights + the context's KV) / measured
   device-to-device copy bandwidth.
c. The Triton decode kernel at batch 64 x 4096 context: K/V bytes read / time, as a
   fraction of the copy bandwidth.

    python bench/gpu.py                                   # -> bench/results/gpu_<device>.json
    python bench/gpu.py --smoke                           # tiny CPU run of every path -> /tmp
"""

import argparse
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig  # noqa: E402

from bench.offline import generate_all, make_workload, run_kvserve, warm_up_workload  # noqa: E402
from replica import LLM, SamplingParams  # noqa: E402
from replica.model_loader import resolve_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TARGETS = {
    "speedup_vs_hf_static_at_cap_1536": 15.0,
    "speedup_vs_hf_generate_batch": 2.0,
    "batch1_step_over_floor": 1.3,  # at most
    "decode_kernel_bandwidth_fraction": 0.7,
}

LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=4096,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def build_model(path: Path, shape: dict, device: str) -> None:
    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.2B weights is much faster on the GPU
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(path)
    del model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def run_hf_static(model, prompts, lengths, batch_size: int, device: str) -> float:
    eos = model.config.eos_token_id
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size], device=device)
        longest = max(lengths[i : i + batch_size])
        config = GenerationConfig(
            max_new_tokens=longest, min_new_tokens=longest, do_sample=False, eos_token_id=eos, pad_token_id=0
        )
        with torch.inference_mode():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=config)
        assert out.shape[1] == batch.shape[1] + longest
    sync(device)
    return time.perf_counter() - start


def run_hf_generate_batch(model, prompts, lengths, max_batch: int, smoke: bool) -> float:
    """Timed from the first request to the last result, like kvserve: the manager's start
    (cache allocation, CUDA-graph warm-up) and shutdown are left out."""
    from transformers import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(lengths))
    # On GPU transformers sizes its cache and picks graphs itself; on CPU it would claim most of RAM.
    extra = dict(use_cuda_graph=False, num_blocks=64) if smoke else {}
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=max_batch, **extra)
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=60
    ) as manager:
        start = time.perf_counter()
        generate_all(manager, prompts, lengths)
        return time.perf_counter() - start


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


def versions() -> dict:
    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("triton", "flash_attn"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--mean-output", type=float, default=128)
    parser.add_argument("--caps", type=int, nargs="+", default=[32, 128, 512, 1536])
    parser.add_argument("--batch-size", type=int, default=256, help="max concurrent sequences, every system")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--systems", nargs="+", default=["kvserve", "hf_static", "hf_generate_batch"])
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="reuse (or create) the random model here"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, torch backend, seconds")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = TINY if args.smoke else LLAMA_1B
    if args.smoke:
        args.num_requests, args.prompt_len, args.mean_output = 8, 32, 8
        args.caps, args.batch_size, args.max_num_batched_tokens = [4, 16], 4, 256
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out_path = args.out or (Path(tempfile.gettempdir()) / "kvserve_gpu_smoke.json" if args.smoke else None)
    out_path = out_path or RESULTS / f"gpu_{slug(device_name)}.json"
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="kvserve-bench-"))
    print(f"device: {device_name}; model: {model_dir}", flush=True)
    build_model(model_dir, shape, device)
    torch.manual_seed(args.seed)

    skipped: dict[str, str] = {}
    bandwidth = copy_bandwidth(device, 2**30 if device == "cuda" else 2**26)
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    workloads = {
        cap: make_workload(
            args.num_requests, args.prompt_len, args.mean_output, cap, shape["vocab_size"], args.seed
        )
        for cap in args.caps
    }
    warm = warm_up_workload(args.prompt_len, shape["vocab_size"], args.seed)
    seconds: dict[str, dict[int, float]] = {}
    engine_info, batch1 = {}, None

    if "kvserve" in args.systems:
        memory = {"gpu_memory_utilization": args.gpu_memory_utilization} if device == "cuda" else {}
        llm = LLM(
            str(model_dir),
            dtype="bfloat16",
            device=device,
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.prompt_len + max(args.caps),
            enable_prefix_caching=False,
            kv_cache_memory_gb=0.25,
            **memory,
        )
        runner = llm.engine.runner
        engine_info = {
            "attention_backend": runner.backend.name,
            "block_size": runner.block_size,
            "num_kv_blocks": runner.num_blocks,
            "cuda_graph_batch_sizes": runner.graphs.sizes if runner.graphs else None,
        }
        print(f"kvserve: {engine_info}", flush=True)
        run_kvserve(llm, *warm)
        seconds["kvserve"] = {}
        for cap, (prompts, lengths) in workloads.items():
            seconds["kvserve"][cap] = run_kvserve(llm, prompts, lengths)
            print(f"cap={cap} kvserve: {sum(lengths) / seconds['kvserve'][cap]:.0f} tok/s", flush=True)
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        batch1 = batch1_step(llm, workloads[args.caps[0]][0][0], 16 if args.smoke else 200, device)
        kv_bytes = batch1["context_len"] * runner.bytes_per_block // runner.block_size
        floor = (weight_bytes + kv_bytes) / bandwidth
        batch1.update(
            weight_bytes=weight_bytes,
            kv_bytes=kv_bytes,
            floor_s=floor,
            engine_step_over_floor=batch1["engine_step_s"] / floor,
            runner_step_over_floor=batch1["runner_step_s"] / floor,
        )
        print(f"batch-1 step: {batch1}", flush=True)
        del llm, runner
        free_memory()

    hf_systems = [s for s in ("hf_static", "hf_generate_batch") if s in args.systems]
    if hf_systems:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        hf = hf.to(device).eval()

        def run(system: str, prompts, lengths) -> float:
            if system == "hf_static":
                return run_hf_static(hf, prompts, lengths, args.batch_size, device)
            return run_hf_generate_batch(hf, prompts, lengths, args.batch_size, args.smoke)

        for system in hf_systems:
            run(system, *warm)
            seconds[system] = {}
            for cap, (prompts, lengths) in workloads.items():
                seconds[system][cap] = run(system, prompts, lengths)
                print(f"cap={cap} {system}: {sum(lengths) / seconds[system][cap]:.0f} tok/s", flush=True)
        engine_info["hf_attn_implementation_after_generate_batch"] = hf.config._attn_implementation
        del hf
        free_memory()

    rows = []
    for cap, (_, lengths) in workloads.items():
        tps = {s: sum(lengths) / seconds[s][cap] for s in seconds}
        row = {
            "cap": cap,
            "generated_tokens": sum(lengths),
            "max_output": max(lengths),
            "output_tokens_per_s": tps,
        }
        if "kvserve" in tps:
            row["speedup_vs"] = {s: tps["kvserve"] / v for s, v in tps.items() if s != "kvserve"}
        rows.append(row)

    kernel = None
    if device == "cuda" and "triton" in versions() and versions()["triton"]:
        kernel = decode_kernel_bandwidth(bandwidth)
        print(f"decode kernel: {kernel}", flush=True)
    else:
        skipped["decode_kernel"] = "needs a CUDA GPU and triton"
    if device != "cuda":
        skipped["cuda_graphs"] = "CPU run: no CUDA graphs, torch attention backend"

    checks = {}
    by_cap = {r["cap"]: r for r in rows}
    if 1536 in by_cap and "hf_static" in by_cap[1536].get("speedup_vs", {}):
        checks["speedup_vs_hf_static_at_cap_1536"] = by_cap[1536]["speedup_vs"]["hf_static"]
    generate_batch = [
        r["speedup_vs"]["hf_generate_batch"] for r in rows if "hf_generate_batch" in r.get("speedup_vs", {})
    ]
    if generate_batch:
        checks["speedup_vs_hf_generate_batch"] = min(generate_batch)
    if batch1:
        checks["batch1_step_over_floor"] = batch1["engine_step_over_floor"]
    if kernel:
        checks["decode_kernel_bandwidth_fraction"] = kernel["fraction_of_copy_bandwidth"]
    report = {}
    for name, value in checks.items():
        target = TARGETS[name]
        ok = value <= target if name == "batch1_step_over_floor" else value >= target
        report[name] = {"value": value, "target": target, "met": ok}
        print(
            f"{name}: {value:.2f} (target {'<=' if name == 'batch1_step_over_floor' else '>='} {target}) "
            f"{'MET' if ok else 'MISSED'}",
            flush=True,
        )

    result = {
        "benchmark": "gpu",
        "device": device_name,
        "versions": versions(),
        "smoke": args.smoke,
        "model": "random-weight Llama-3.2-1B shape" if not args.smoke else "tiny random Llama",
        "model_config": shape,
        "dtype": "bfloat16",
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "mean_output": args.mean_output,
            "caps": args.caps,
            "batch_size": args.batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "ignore_eos": True,
            "seed": args.seed,
        },
        "engine": engine_info,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "throughput": rows,
        "batch1_decode": batch1,
        "decode_kernel": kernel,
        "targets": report,
        "skipped": skipped,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
