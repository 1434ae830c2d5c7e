"""Offline throughput: kvserve continuous vs kvserve static vs HF static `generate` vs
transformers' own continuous batching (`generate_batch`), on one workload, in one run.

Workload (after Anyscale's continuous-batching study, scaled to a 2-core CPU): N requests
of fixed-length random-token prompts; output lengths drawn from an exponential with mean
M, capped; EOS ignored. Higher caps raise the variance of output lengths, which is what
static batching pays for: a static batch runs until its longest member is done.

Throughput counts only the tokens each request asked for. The roofline fraction is
model FLOPs x (prompt + generated tokens)/s over a measured bf16 GEMM rate.

    python bench/offline.py                 # full run, writes bench/results/offline_cpu.{json,png}
    python bench/offline.py --quick         # smoke run
"""

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

from replica import LLM, SamplingParams  # noqa: E402
from replica.model_loader import resolve_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def make_workload(n: int, prompt_len: int, mean: float, cap: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(n)]
    rng = random.Random(seed + 1)  # same draws for every cap: only the cap changes
    lengths = [min(cap, max(1, round(rng.expovariate(1 / mean)))) for _ in range(n)]
    return prompts, lengths


def run_kvserve(llm: LLM, prompts, lengths) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == lengths
    return elapsed


def run_hf_static(model, prompts, lengths, batch_size: int) -> float:
    """HF generate, batch after batch; each batch runs until its longest request is done."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size])
        longest = max(lengths[i : i + batch_size])
        config = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=config)
        assert out.shape[1] == batch.shape[1] + longest
    return time.perf_counter() - start


def run_hf_generate_batch(model, prompts, lengths, max_batch: int) -> float:
    """transformers' continuous batching (the manager behind `generate_batch`), given
    each request's own max_new_tokens so it generates exactly what kvserve does."""
    from transformers import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(lengths))
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=max_batch, use_cuda_graph=False)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        generate_all(manager, prompts, lengths)
    return time.perf_counter() - start


def generate_all(manager, prompts, lengths) -> None:
    """Hands every request to a running transformers continuous-batching manager and waits
    until each has generated exactly its own length."""
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        manager.add_request(p, request_id=str(i), max_new_tokens=n, eos_token_id=-1)
    done = {}
    while len(done) < len(prompts):
        result = manager.get_result(timeout=5)
        if result is not None and result.is_finished():
            done[result.request_id] = len(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped early")
    assert [done[str(i)] for i in range(len(prompts))] == lengths


def gemm_rate(dtype: torch.dtype) -> float:
    """Best measured dense GEMM rate (FLOP/s) on this machine, the roofline's ceiling."""
    best = 0.0
    for n in (1024, 2048, 4096):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        reps = max(2, int(2e10 / (2 * n**3)))
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def model_flops_per_token(model) -> int:
    """2 x parameters touched per token: every linear of the decoder plus lm_head."""
    linears = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    params = sum(m.weight.numel() for m in linears) + model.get_output_embeddings().weight.numel()
    return 2 * params


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--mean-output", type=float, default=64)
    parser.add_argument("--caps", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="max concurrent sequences for every system (HF static batch size)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["kvserve_continuous", "kvserve_static", "hf_static", "hf_generate_batch"],
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "offline_cpu.json")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.caps, args.batch_size = 16, [16], 8

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16
    model_path = resolve_model(args.model)
    engine_args = dict(
        dtype="bfloat16", max_num_seqs=args.batch_size, kv_cache_memory_gb=2.0, enable_prefix_caching=False
    )
    llms = {}
    if "kvserve_continuous" in args.systems:
        llms["kvserve_continuous"] = LLM(str(model_path), **engine_args)
    if "kvserve_static" in args.systems:
        llms["kvserve_static"] = LLM(str(model_path), scheduling_policy="static", **engine_args)
    hf = None
    if {"hf_static", "hf_generate_batch"} & set(args.systems):
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    any_llm = next(iter(llms.values()), None)
    flops_model = hf if hf is not None else any_llm.engine.runner.model
    flops_per_token = model_flops_per_token(flops_model)
    vocab = flops_model.config.vocab_size

    print("measuring bf16 GEMM rate ...", flush=True)
    peak = gemm_rate(dtype)
    print(f"  {peak / 1e9:.0f} GFLOP/s", flush=True)

    # Warm every system once so first-call costs stay out of the timings.
    warm_prompts, warm_lengths = make_workload(4, args.prompt_len, 4, 4, vocab, args.seed + 99)
    for llm in llms.values():
        run_kvserve(llm, warm_prompts, warm_lengths)
    if "hf_static" in args.systems:
        run_hf_static(hf, warm_prompts, warm_lengths, 4)

    rows = []
    for cap in args.caps:
        prompts, lengths = make_workload(
            args.num_requests, args.prompt_len, args.mean_output, cap, vocab, args.seed
        )
        generated = sum(lengths)
        processed = generated + args.num_requests * args.prompt_len
        row = {
            "cap": cap,
            "generated_tokens": generated,
            "mean_output": generated / len(lengths),
            "max_output": max(lengths),
            "systems": {},
        }
        for system in args.systems:
            print(f"cap={cap} {system} ...", flush=True)
            if system in llms:
                elapsed = run_kvserve(llms[system], prompts, lengths)
            elif system == "hf_static":
                elapsed = run_hf_static(hf, prompts, lengths, args.batch_size)
            elif system == "hf_generate_batch":
                elapsed = run_hf_generate_batch(hf, prompts, lengths, args.batch_size)
            else:
                raise SystemExit(f"unknown system {system}")
            achieved = flops_per_token * processed / elapsed
            row["systems"][system] = {
                "seconds": elapsed,
                "output_tokens_per_s": generated / elapsed,
                "roofline_fraction": achieved / peak,
            }
            print(
                f"  {generated / elapsed:.1f} output tok/s, {elapsed:.1f} s, "
                f"{achieved / peak:.1%} of roofline",
                flush=True,
            )
        base = row["systems"]
        if "kvserve_continuous" in base:
            ours = base["kvserve_continuous"]["output_tokens_per_s"]
            row["speedup_vs"] = {
                s: ours / v["output_tokens_per_s"] for s, v in base.items() if s != "kvserve_continuous"
            }
            print(f"  kvserve continuous speedup: {row['speedup_vs']}", flush=True)
        rows.append(row)

    result = {
        "benchmark": "offline",
        "device": f"cpu: {platform.processor() or platform.machine()}, {args.threads} threads",
        "torch": torch.__version__,
        "model": str(args.model or "bundled SmolLM2-135M-Instruct"),
        "dtype": "bfloat16",
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "mean_output": args.mean_output,
            "caps": args.caps,
            "batch_size": args.batch_size,
            "ignore_eos": True,
            "seed": args.seed,
        },
        "notes": "hf_generate_batch drives transformers' ContinuousBatchingManager (the engine behind "
        "generate_batch) with each request's own max_new_tokens.",
        "gemm_bf16_flops": peak,
        "model_flops_per_token": flops_per_token,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    caps = [r["cap"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in rows[0]["systems"]:
        ax.plot(caps, [r["systems"][system]["output_tokens_per_s"] for r in rows], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(caps, [str(c) for c in caps])
    ax.set_xlabel(f"output length cap (tokens); mean {result['workload']['mean_output']:g}")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput, {result['model']} {result['dtype']}, {result['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
