"""Priority scheduling under a queue: time to first token per priority class, and what
ordering by priority costs in throughput.

Two apps on one local Ray, each one replica with the same engine arguments, one with
`scheduling_policy: priority`, one with fcfs. The same load goes to each: streaming
completions (prompts of 128 random tokens, 32 output tokens), half at priority 0 and
half at priority 1, interleaved, arriving by a seeded Poisson schedule much faster than
one replica drains them, so that a waiting queue builds (max_num_seqs bounds the running
batch). The fcfs app gets the same requests without a priority. Runs alternate
priority, fcfs, fcfs, priority (ABBA), so that drift in the machine's load falls on
both sides.

Bars: p50 TTFT of the priority-0 requests at most 0.5x that of the priority-1 ones;
output throughput within 5% of the fcfs run's.

    python -m bench.priority           # bench/results/priority_<machine>.json
    python -m bench.priority --smoke   # tiny run, to the temp dir
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
from pathlib import Path

import ray

from bench.machine import machine, write_result
from bench.serve_apps import deploy as deploy_app
from bench.serve_apps import local_serve, undeploy
from bench.sse import Result, percentile, send_at

PORT = 18556
MODEL = "kvserve-bench"
POLICIES = ("priority", "fcfs")


def deploy(policy: str, engine_args: dict, warm_up: list) -> str:
    """A one-replica app at /<policy>; returns its base URL once `warm_up` (requests of
    the load's shape, sent at once) went through, so that no run pays for first calls."""
    config = {
        "app_name": f"bench-{policy}",
        "served_model_name": MODEL,
        "replicas": 1,
        "engine_args": {**engine_args, "scheduling_policy": policy},
    }
    deploy_app(config, route_prefix=f"/{policy}")
    base_url = f"http://127.0.0.1:{PORT}/{policy}"
    asyncio.run(send(base_url, [(0.0, cls, payload) for _, cls, payload in warm_up], with_priority=False))
    return base_url


def load(args) -> list[tuple[float, int, dict]]:
    """(arrival offset in s, priority class, completion payload) per request; the same
    every run."""
    rng = random.Random(args.seed)
    jobs, due = [], 0.0
    for i in range(args.requests):
        due += rng.expovariate(args.rate)
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        payload = {"prompt": prompt, "max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0}
        jobs.append((due, i % 2, payload))
    return jobs


async def send(base_url: str, jobs, with_priority: bool) -> tuple[list[Result], float]:
    """Send each job at its offset, with its class as `priority` if asked."""
    timed = [
        (due, "/v1/completions", {**payload, "model": MODEL, **({"priority": cls} if with_priority else {})})
        for due, cls, payload in jobs
    ]
    return await send_at(base_url, timed)


def measure(base_url: str, policy: str, jobs) -> dict:
    results, seconds = asyncio.run(send(base_url, jobs, with_priority=policy == "priority"))
    errors = [r.error for r in results if not r.ok]
    assert not errors, errors[:3]
    output_tokens = sum(r.output_tokens for r in results)
    ttfts = {cls: [r.ttft for r, job in zip(results, jobs, strict=True) if job[1] == cls] for cls in (0, 1)}
    return {
        "policy": policy,
        "seconds": seconds,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds,
        "ttft_p50_s": {f"priority_{cls}": percentile(v, 50) for cls, v in ttfts.items()},
        "ttft_s": {f"priority_{cls}": v for cls, v in ttfts.items()},
    }


def summary(runs: list[dict]) -> dict:
    """Per policy: p50 TTFT per class over all its runs, and its mean throughput."""
    out = {}
    for policy in POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        out[policy] = {
            "ttft_p50_s": {
                cls: percentile([t for r in mine for t in r["ttft_s"][cls]], 50)
                for cls in ("priority_0", "priority_1")
            },
            "output_tokens_per_s": statistics.mean(r["output_tokens_per_s"] for r in mine),
        }
    ttft = out["priority"]["ttft_p50_s"]
    out["ttft_p50_ratio_high_to_low"] = ttft["priority_0"] / ttft["priority_1"]
    out["throughput_ratio_priority_to_fcfs"] = (
        out["priority"]["output_tokens_per_s"] / out["fcfs"]["output_tokens_per_s"]
    )
    out["bars_met"] = {
        "ttft_p50_high_at_most_half_low": out["ttft_p50_ratio_high_to_low"] <= 0.5,
        "throughput_within_5pct_of_fcfs": abs(out["throughput_ratio_priority_to_fcfs"] - 1) <= 0.05,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the running batch's bound")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each adds 2 runs per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/priority_<machine>.json"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run, written to the temp dir")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.output_tokens = 8, 4
    engine_args = {"dtype": "auto", "device": "cpu", "cpu_cores": "auto", "max_num_seqs": args.max_num_seqs}
    jobs = load(args)
    before = machine(
        platform=platform.platform(),
        python=platform.python_version(),
        ray=ray.__version__,
        load_average_1_5_15=os.getloadavg(),
    )

    runs = []
    with local_serve(PORT):
        warm_up = load(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))[: args.max_num_seqs]
        urls = {policy: deploy(policy, engine_args, warm_up) for policy in POLICIES}
        for policy in ("priority", "fcfs", "fcfs", "priority") * args.rounds:
            runs.append(measure(urls[policy], policy, jobs))
            print(
                f"{policy}: {runs[-1]['output_tokens_per_s']:.1f} output tok/s, "
                f"TTFT p50 {runs[-1]['ttft_p50_s']}",
                flush=True,
            )
        for policy in POLICIES:
            undeploy(f"bench-{policy}")
    result = {
        "load_average_after": os.getloadavg(),
        "note": "absolute figures follow the machine's load (recorded before and after); the "
        "policies run alternately (ABBA), so the ratios compare like with like.",
        "engine_args": engine_args,
        "summary": summary(runs),
        "runs": runs,
    }
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {write_result('priority', args, result, before, args.out, args.smoke)}")


if __name__ == "__main__":
    main()
