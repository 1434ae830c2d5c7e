"""Offline throughput, every system side by side on the same workloads in one run:
kvserve continuous (and with quantization="int8": kvserve_int8), kvserve static, HF
`generate` with static batching, transformers' own
continuous batching (`generate_batch`), and vLLM's CPU build (the peer, in its own venv).

Workloads (bench/workloads.py; EOS ignored, throughput counts only the tokens each
request asked for):
- anyscale: after Anyscale's continuous-batching study, scaled to a 2-core CPU: N
  requests of fixed-length random-token prompts, output lengths drawn from an
  exponential with mean M and capped (one case per cap).
- mixed: prompts of 32-160 tokens (uniform), capped-exponential outputs with mean 48, all
  submitted at once.

Fairness: every system runs with the same limits (max sequences, KV block size, token
budget per step, context length, KV cache size, no prefix caching), gets one warm-up,
and is timed from its first submitted request to its last token; start-up (model load,
vLLM's compilation, generate_batch's manager) stays outside the window. vLLM runs twice:
`vllm` as it installs, and `vllm_tuned`, its fastest configuration on this machine (the
engine in-process, and the tcmalloc and Intel OpenMP preloads its docs recommend where
present). kvserve and vLLM are timed --repeats times, round-robin with a pause between
systems, and reported by their median (machines here are shared and noisy); the HF
baselines, 3-30x slower, once.

Roofline: model FLOPs needed by the workload's GEMMs over the fastest GEMM rate this CPU
reaches on the model's own linear shapes, at the rows of a decode step (max sequences)
and of a prefill step (the token budget): the faster of oneDNN with prepacked weights
and kvserve's own bf16 kernel (replica/cpu/gemm.c, on AVX512-BF16 CPUs), each timed with
a layer's weights streamed as a step streams them.

    bash bench/setup_vllm.sh && python -m bench.offline  # -> bench/results/offline_<machine>.{json,png}
    python -m bench.offline --smoke                       # tiny run, to the temp dir
"""

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.machine import machine, write_result
from bench.peers import VLLM_VENV, VllmPeer
from bench.plots import plot_offline
from bench.runners import (
    engine_record,
    generate_batch_manager,
    run_hf_generate_batch,
    run_hf_static,
    run_kvserve,
)
from bench.workloads import make_mixed_workload, make_workload, warm_up_workload
from kvserve import LLM
from replica.cpu import linear_kernels
from replica.model_loader import resolve_model

# Repeated, round-robin; kvserve_<kernel> is kvserve continuous with cpu_kernels=<kernel>.
FAST_SYSTEMS = ("kvserve_continuous", "kvserve_static", "vllm", "vllm_tuned")


def repeated(system: str) -> bool:
    return system in FAST_SYSTEMS or system.startswith("kvserve_")


class GenerateBatch:
    """transformers' continuous batching with every system's limits. Each run starts the
    manager and warms it up outside the timed window, and stops it after: its idle
    background thread, left running, slows the other systems in this process."""

    def __init__(self, model, max_new_tokens: int, args):
        self.model, self.max_new_tokens = model, max_new_tokens
        # The same limits as every system (by default it sizes its cache from free memory).
        hf = model.config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        bytes_per_block = hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * args.block_size * 2
        self.batching = dict(
            page_size=args.block_size,
            num_blocks=args.kv_cache_gb * 2**30 // bytes_per_block,
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests_per_batch=args.batch_size,
            use_cuda_graph=False,
        )
        self.warm_up = warm_up_workload(args.prompt_len, hf.vocab_size, args.seed)

    def run(self, prompts, lengths) -> float:
        with generate_batch_manager(self.model, self.max_new_tokens, **self.batching) as manager:
            run_hf_generate_batch(manager, *self.warm_up)
            return run_hf_generate_batch(manager, prompts, lengths).seconds


def model_flops(model) -> tuple[int, int]:
    """FLOPs per token of the decoder's linears, and of lm_head (run only for rows that
    sample): 2 x the weights each touches."""
    decoder = sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    return 2 * decoder, 2 * model.get_output_embeddings().weight.numel()


def gemm_rate(model, rows: int, dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s over the model's own linear shapes (each distinct shape once per layer, as a
    step runs them) at `rows` rows: oneDNN with prepacked weights, and gemm.c's kernel
    where this CPU has it."""
    from replica.cpu import ops

    shapes = [tuple(m.weight.shape) for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    weights = [torch.randn(s, dtype=dtype) for s in shapes]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {s[1] for s in shapes}}
    # name -> (the weights as that kernel takes them, one GEMM of input width k, output width n)
    kernels = {
        "onednn": (
            [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights],
            lambda w, k, n: torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], ""),
        )
    }
    if dtype == torch.bfloat16 and ops.bf16_gemm_available():
        kernels["kvserve"] = (
            [ops.pack_bf16_weight(w) for w in weights],
            lambda w, k, n: ops.gemm_bf16(inputs[k], w, None, n),
        )
    rates = {}
    for name, (packed, kernel) in kernels.items():

        def step(packed=packed, kernel=kernel) -> None:
            for w, (n, k) in zip(packed, shapes, strict=True):
                kernel(w, k, n)

        step()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
        rates[name] = 2 * rows * sum(n * k for n, k in shapes) / best
    return rates


def build_cases(args, vocab: int) -> list[dict]:
    cases = []
    if "anyscale" in args.workloads:
        for cap in args.caps:
            prompts, lengths = make_workload(
                args.num_requests, args.prompt_len, args.mean_output, cap, vocab, args.seed
            )
            name = f"anyscale cap {cap}"
            cases.append(
                {"workload": "anyscale", "name": name, "cap": cap, "prompts": prompts, "lengths": lengths}
            )
    if "mixed" in args.workloads:
        prompts, lengths = make_mixed_workload(
            args.mixed_requests, (32, 160), args.mixed_mean_output, args.mixed_cap, vocab, args.seed
        )
        cases.append({"workload": "mixed", "name": "mixed", "cap": args.mixed_cap, "prompts": prompts,
                      "lengths": lengths})  # fmt: skip
    return cases


def gemm_rates(hf, args, dtype: torch.dtype) -> dict:
    """The fastest rate at a decode step's and a prefill step's rows, and each kernel's."""
    print("measuring GEMM rates ...", flush=True)
    decode = gemm_rate(hf, args.batch_size, dtype)
    prefill = gemm_rate(hf, args.max_num_batched_tokens, dtype)
    rates = {
        "decode_rows": args.batch_size,
        "decode_flops": max(decode.values()),
        "prefill_rows": args.max_num_batched_tokens,
        "prefill_flops": max(prefill.values()),
        "by_kernel": {"decode": decode, "prefill": prefill},
    }
    print(f"  {rates['decode_flops'] / 1e9:.0f} GFLOP/s at {args.batch_size} rows, "
          f"{rates['prefill_flops'] / 1e9:.0f} at {args.max_num_batched_tokens}", flush=True)  # fmt: skip
    return rates


def warm_up(runners: dict, args, vocab: int) -> None:
    """One warm-up each, so first-call costs stay out of the timings."""
    prompts, lengths = warm_up_workload(args.prompt_len, vocab, args.seed)
    for system, run in runners.items():
        print(f"warm-up {system} ...", flush=True)
        run(prompts, lengths)


def measure(case: dict, runners: dict, rates: dict, flops: tuple[int, int], args) -> dict:
    """One workload case: every system's timed runs, round-robin."""
    decoder_flops, lm_head_flops = flops
    prompts, lengths = case["prompts"], case["lengths"]
    generated, prompt_tokens = sum(lengths), sum(len(p) for p in prompts)
    roofline_s = (
        prompt_tokens * decoder_flops / rates["prefill_flops"]
        + generated * (decoder_flops + lm_head_flops) / rates["decode_flops"]
    )
    samples = {system: [] for system in runners}
    for rep in range(args.repeats):
        for system, run in runners.items():
            if rep > 0 and not repeated(system):
                continue
            time.sleep(args.pause)  # let the previous system's threads go quiet
            print(f"{case['name']} {system} (run {rep + 1}) ...", flush=True)
            samples[system].append(run(prompts, lengths))
            print(f"  {generated / samples[system][-1]:.1f} output tok/s", flush=True)
    row = {
        "workload": case["workload"],
        "case": case["name"],
        "cap": case["cap"],
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "mean_output": generated / len(lengths),
        "max_output": max(lengths),
        "roofline_seconds": roofline_s,
        "systems": {},
    }
    for system, seconds in samples.items():
        median = statistics.median(seconds)
        row["systems"][system] = {
            "seconds": seconds,
            "median_seconds": median,
            "output_tokens_per_s": generated / median,
            "roofline_fraction": roofline_s / median,
        }
    if "kvserve_continuous" in row["systems"]:
        ours = row["systems"]["kvserve_continuous"]["output_tokens_per_s"]
        row["speedup_vs"] = {
            s: ours / v["output_tokens_per_s"] for s, v in row["systems"].items() if s != "kvserve_continuous"
        }
        print(f"  kvserve continuous speedup: {row['speedup_vs']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--workloads", nargs="+", default=["anyscale", "mixed"])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--mean-output", type=float, default=64)
    parser.add_argument("--caps", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--mixed-requests", type=int, default=96)
    parser.add_argument("--mixed-mean-output", type=float, default=48)
    parser.add_argument("--mixed-cap", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="max concurrent sequences, every system")
    parser.add_argument(
        "--block-size", type=int, default=32, help="KV block size (vLLM's CPU build needs 32k)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="every system's; float32 on CPUs without AVX512-BF16 or AMX, where kvserve's auto dtype "
        "is float32 "
        "and bf16 is emulated",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="kvserve continuous's weights, as LLM takes them (\"gguf\": the bundled file's own blocks)",
    )
    # Every system holds its cache at once: 6 of them must fit in the machine's memory.
    parser.add_argument(
        "--kv-cache-gb", type=int, default=1, help="KV cache per system (64 sequences need 0.6)"
    )
    parser.add_argument("--repeats", type=int, default=3, help=f"timed runs of {', '.join(FAST_SYSTEMS)}")
    all_systems = [
        "kvserve_continuous",
        "kvserve_int8",
        "kvserve_static",
        "hf_static",
        "hf_generate_batch",
        "vllm",
        "vllm_tuned",
    ]
    parser.add_argument("--systems", nargs="+", default=all_systems)
    parser.add_argument(
        "--kernel-ab",
        action="store_true",
        help="also run kvserve continuous with each CPU kernel that can run here forced (kvserve_gemm.c, "
        "kvserve_onednn, kvserve_torch), against the automatic choice (kvserve_continuous)",
    )
    parser.add_argument("--vllm-python", type=Path, default=VLLM_VENV / "bin" / "python")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds of quiet before each timed run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/offline_<machine>.json"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run, written to the temp dir")
    args = parser.parse_args()
    if args.smoke:
        args.num_requests, args.caps, args.mixed_requests, args.batch_size, args.repeats = 16, [16], 16, 8, 1

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model_path = resolve_model(args.model)
    limits = dict(
        max_num_seqs=args.batch_size,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    engine_args = dict(dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_gb, **limits)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    decoder_flops, lm_head_flops = model_flops(hf)
    cases = build_cases(args, hf.config.vocab_size)

    runners, engines = {}, {}
    if "kvserve_continuous" in args.systems:
        engines["kvserve_continuous"] = LLM(str(model_path), quantization=args.quantization, **engine_args)
    if "kvserve_int8" in args.systems:
        engines["kvserve_int8"] = LLM(str(model_path), quantization="int8", **engine_args)
    if "kvserve_static" in args.systems:
        engines["kvserve_static"] = LLM(str(model_path), scheduling_policy="static", **engine_args)
    if args.kernel_ab:
        for kernel in linear_kernels.LINEAR_KERNELS:
            if linear_kernels.can_run(kernel, dtype, hf.config.hidden_size):
                engines[f"kvserve_{kernel}"] = LLM(str(model_path), cpu_kernels=kernel, **engine_args)
    for system, llm in engines.items():
        runners[system] = lambda p, n, llm=llm: run_kvserve(llm, p, n).seconds
    if "hf_static" in args.systems:
        runners["hf_static"] = lambda p, n: run_hf_static(hf, p, n, args.batch_size).seconds
    # The vLLM processes must stop even on an error.
    with contextlib.ExitStack() as cleanup:
        if "hf_generate_batch" in args.systems:
            longest = max(max(c["lengths"]) for c in cases)
            runners["hf_generate_batch"] = GenerateBatch(hf, longest, args).run
        peers = {}
        for system in ("vllm", "vllm_tuned"):
            if system in args.systems:
                vllm_engine = dict(dtype=args.dtype, seed=args.seed, **limits)
                tuned = system == "vllm_tuned"
                peers[system] = VllmPeer(
                    args.vllm_python, model_path, vllm_engine, args.threads, tuned, args.kv_cache_gb
                )
                cleanup.callback(peers[system].close)
                runners[system] = peers[system].run
        rates = gemm_rates(hf, args, dtype)
        warm_up(runners, args, hf.config.vocab_size)
        rows = [measure(case, runners, rates, (decoder_flops, lm_head_flops), args) for case in cases]

    host = machine(threads=args.threads)
    result = {
        "device": f"cpu: {host['cpu']}, {args.threads} threads",
        "vllm": next(iter(peers.values())).version if peers else None,
        "model": str(args.model or "bundled SmolLM2-135M-Instruct"),
        "dtype": args.dtype,
        "limits": {**limits, "kv_cache_gb": args.kv_cache_gb},
        "kvserve_engines": {system: engine_record(llm) for system, llm in engines.items()},
        "workloads": {
            "anyscale": {
                "num_requests": args.num_requests,
                "prompt_len": args.prompt_len,
                "mean_output": args.mean_output,
                "caps": args.caps,
            },
            "mixed": {
                "num_requests": args.mixed_requests,
                "prompt_lens": [32, 160],
                "mean_output": args.mixed_mean_output,
                "cap": args.mixed_cap,
            },
            "ignore_eos": True,
            "seed": args.seed,
        },  # fmt: skip
        "repeats": args.repeats,
        "notes": "Median of `repeats` round-robin runs for kvserve (continuous, static) and vLLM; one run "
        "for the HF baselines. "
        + "".join(f"{name}: {p.setup}. " for name, p in peers.items())
        + "hf_generate_batch drives "
        "transformers' ContinuousBatchingManager (the engine behind generate_batch), started and warmed up "
        "before timing, with each request's own max_new_tokens.",
        "gemm_rates": rates,
        "model_flops_per_token": {"decoder": decoder_flops, "lm_head": lm_head_flops},
        "results": rows,
    }
    path = write_result("offline", args, result, host, args.out, args.smoke)
    plot_offline(result, path.with_suffix(".png"))
    print(f"wrote {path} and its .png")


if __name__ == "__main__":
    main()
