"""What tensor parallelism costs on a CPU: the bundled model at tensor_parallel_size 1 and
2 on the same workload in one run, with one torch thread per rank, and the latency of
one gloo all-reduce of a decode step's hidden states between two processes.

Each step of a TP replica runs 2 all-reduces per layer, one for the embedding and a
gather for the logits; on GPUs NCCL does each in microseconds, on a CPU gloo goes
through loopback TCP. This bench says how much that is here.

    python -m bench.tensor_parallel   # bench/results/tensor_parallel_<machine>.json
"""

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from bench.machine import machine, write_result
from bench.servers import free_port
from kvserve import LLM, SamplingParams


def throughput(llm: LLM, num_requests: int, output_len: int, repeats: int) -> dict:
    """Output tokens per second of `num_requests` equal-length greedy requests submitted at
    once (EOS ignored), best and median of `repeats` runs after one warm-up."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = [f"Story number {i}, in which" for i in range(num_requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(num_requests * output_len / (time.perf_counter() - start))
    return {"output_tok_s_median": statistics.median(rates), "output_tok_s_best": max(rates), "runs": rates}


def _all_reduce_loop(rank: int, port: int, shape: tuple[int, int], n: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, 2)
    tensor = torch.randn(shape, dtype=torch.bfloat16)
    for _ in range(20):
        group.allreduce([tensor]).wait()
    start = time.perf_counter()
    for _ in range(n):
        group.allreduce([tensor]).wait()
    if rank == 0:
        out.put((time.perf_counter() - start) / n)


def gloo_all_reduce_s(shape: tuple[int, int], n: int = 300) -> float:
    port = free_port()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=_all_reduce_loop, args=(r, port, shape, n, out)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/tensor_parallel_<machine>.json"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # one thread per rank; Ray gives the worker one too
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    for size in (1, 2):
        llm = LLM(dtype="bfloat16", tensor_parallel_size=size)
        hidden = llm.engine.runner.model.config.hidden_size
        num_layers = llm.engine.runner.model.config.num_hidden_layers
        results[f"tp{size}"] = throughput(llm, args.requests, args.output_len, args.repeats)
        if size > 1:
            llm.engine.runner.workers.shutdown()
        del llm
    ray.shutdown()
    latency = gloo_all_reduce_s((args.requests, hidden))
    collectives = 2 * num_layers + 2  # per layer attention and MLP, the embedding, the logits
    host = machine(threads=1, ray=ray.__version__)  # one thread per rank
    report = {
        "model": "SmolLM2-135M-Instruct (bundled), bf16",
        "workload": {"requests": args.requests, "output_len": args.output_len, "submitted": "all at once"},
        "single_run": True,
        "tp1": results["tp1"],
        "tp2": results["tp2"],
        "tp2_over_tp1": results["tp2"]["output_tok_s_median"] / results["tp1"]["output_tok_s_median"],
        "decode_step_ms": {
            name: 1e3 * args.requests / results[name]["output_tok_s_median"] for name in ("tp1", "tp2")
        },
        "collectives_per_step": collectives,
        # Two processes doing nothing but all-reduces of [requests, hidden] bf16; in the
        # engine a collective waits on the other rank's compute as well.
        "gloo_all_reduce_ms_isolated": latency * 1e3,
    }
    print(json.dumps(report, indent=2))
    print(f"wrote {write_result('tensor_parallel', args, report, host, args.out)}")


if __name__ == "__main__":
    main()
