"""Online serving over HTTP: latency under Poisson load, and the KV-aware router against
Serve's default power-of-two router. Every experiment deploys a fresh app (2 replicas
unless said) on a local Ray and drives it with streaming requests (SSE), timing each
token event.

  rates    Poisson arrivals at several rates (KV router): TTFT and inter-token latency
           p50/p99, output throughput.
  routing  Small KV caches and a mix of long and short prompts, the same arrival
           schedule for both routers: p99 TTFT and preemptions.
  prefix   Multi-turn chats, each turn sent once the previous reply is in and the user
           has thought: the replicas' prefix-cache hit rate (cached blocks / queried
           blocks) under both routers, with 2 and with 4 replicas.
  bursts   Bursts of equal requests (one prompt for all of them, so the replica that
           cached it looks cheapest) sent at once to 2 idle replicas, under both
           routers: the share of each burst that the busiest replica got, read from
           the x-kvserve-replica header of every response.

    python -m bench.serving            # bench/results/serving_<machine>.{json,png}
    python -m bench.serving --smoke    # tiny run, to the temp dir

bench.serving_peers compares `kvserve serve` with `vllm serve` under vLLM's own load
generator; it runs both as subprocess servers, so it is a script of its own.
"""

import argparse
import asyncio
import itertools
import platform
import random
import time
from pathlib import Path

import httpx
import ray

from bench.machine import machine, write_result
from bench.plots import plot_serving
from bench.serve_apps import deploy, local_serve, snapshot, undeploy, wait_for_replicas
from bench.sse import Result, latency_summary, send_at, stream

PORT = 18555
MODEL = "kvserve-bench"
WORDS = "river stone light paper garden window music silver orange cloud forest engine market"


async def poisson(base_url: str, jobs: list[tuple[str, dict]], rate: float, seed: int):
    """Send jobs at Poisson arrival times; returns (results, seconds until the last finished)."""
    rng = random.Random(seed)
    dues = itertools.accumulate(rng.expovariate(rate) for _ in jobs)
    timed = [
        (due, path, {**payload, "model": MODEL}) for due, (path, payload) in zip(dues, jobs, strict=True)
    ]
    return await send_at(base_url, timed)


async def conversations(base_url: str, args, seed: int) -> list[Result]:
    """Multi-turn chats in the open: staggered starts, and a think time before each turn
    (both exponential), as users do. Each turn carries the whole history."""

    async def one(index: int) -> list[Result]:
        rng = random.Random(seed * 1000 + index)
        await asyncio.sleep(index * args.chat_stagger)
        messages, results = [], []
        for _ in range(args.turns):
            messages.append(
                {"role": "user", "content": " ".join(rng.choices(WORDS.split(), k=args.user_words))}
            )
            payload = {"messages": messages, "max_tokens": args.reply_tokens, "temperature": 0}
            result = await stream(client, "/v1/chat/completions", {**payload, "model": MODEL})
            results.append(result)
            messages.append({"role": "assistant", "content": result.text})
            await asyncio.sleep(rng.expovariate(1 / args.think_time))
        return results

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        per_conversation = await asyncio.gather(*(one(i) for i in range(args.chats)))
    return [r for results in per_conversation for r in results]


def token_jobs(rng: random.Random, n: int, prompt_len: int, output_len: int) -> list[tuple[str, dict]]:
    payload = {"max_tokens": output_len, "ignore_eos": True, "temperature": 0}
    return [
        ("/v1/completions", {**payload, "prompt": [rng.randrange(1000, 40000) for _ in range(prompt_len)]})
        for _ in range(n)
    ]


class App:
    """A freshly deployed app; `totals()` sums its replicas' engine counters."""

    def __init__(self, name: str, router: str, engine_args: dict, replicas: int = 2):
        self.name = name
        config = {
            "app_name": name,
            "served_model_name": MODEL,
            "replicas": replicas,
            "router": router,
            "engine_args": engine_args,
        }
        deploy(config, route_prefix="/")
        wait_for_replicas(name, replicas)
        self.base_url = f"http://127.0.0.1:{PORT}"
        # Warm up both replicas' first-call paths outside the measurement.
        warm = token_jobs(random.Random(99), 2 * replicas, 16, 4)
        asyncio.run(poisson(self.base_url, warm, rate=100.0, seed=99))

    def totals(self) -> dict:
        reports = snapshot(self.name)
        keys = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
        return {k: sum(getattr(s, k) for s in reports.values()) for k in keys}

    def close(self) -> None:
        undeploy(self.name)


def run_rates(args, engine: dict) -> list[dict]:
    app = App("bench-rates", "kv", {**engine, "num_kv_blocks": args.rates_kv_blocks})
    out = []
    for i, rate in enumerate(args.rates):
        jobs = token_jobs(random.Random(i), args.rates_requests, args.rates_prompt, args.rates_output)
        results, seconds = asyncio.run(poisson(app.base_url, jobs, rate, seed=i))
        out.append({"rate_rps": rate, **latency_summary(results, seconds)})
        print(f"rate {rate}/s: {out[-1]}", flush=True)
    app.close()
    return out


def run_routing(args, engine: dict) -> dict:
    rng = random.Random(7)
    long_jobs = token_jobs(rng, args.routing_requests, args.long_prompt, args.routing_output)
    short_jobs = token_jobs(rng, args.routing_requests, args.short_prompt, args.routing_output)
    mix = random.Random(8)
    jobs = [
        long_jobs[i] if mix.random() < args.long_fraction else short_jobs[i]
        for i in range(args.routing_requests)
    ]
    out = {}
    for router in ("kv", "pow2"):
        app = App(f"bench-routing-{router}", router, {**engine, "num_kv_blocks": args.routing_kv_blocks})
        results, seconds = asyncio.run(poisson(app.base_url, jobs, args.routing_rate, seed=9))
        out[router] = {**latency_summary(results, seconds), **app.totals()}
        app.close()
        print(f"routing {router}: {out[router]}", flush=True)
    out["p99_ttft_kv_over_pow2"] = out["kv"]["ttft_p99_s"] / out["pow2"]["ttft_p99_s"]
    return out


def run_prefix(args, engine: dict) -> dict:
    """Hit rates with 2 and with 4 replicas: with 2, a random pick lands on the replica
    holding the conversation half the time, so power-of-two is at its strongest there."""
    out = {}
    for replicas in args.prefix_replicas:
        runs = {}
        for router in ("kv", "pow2"):
            name = f"bench-prefix-{router}-{replicas}"
            app = App(name, router, {**engine, "num_kv_blocks": args.prefix_kv_blocks}, replicas=replicas)
            start = time.perf_counter()
            results = asyncio.run(conversations(app.base_url, args, seed=11))
            totals = app.totals()
            runs[router] = {
                **latency_summary(results, time.perf_counter() - start),
                **totals,
                "hit_rate": totals["prefix_cache_hits"] / max(1, totals["prefix_cache_queries"]),
            }
            app.close()
            print(f"prefix {router} x{replicas}: {runs[router]}", flush=True)
        runs["hit_rate_kv_over_pow2"] = runs["kv"]["hit_rate"] / max(1e-9, runs["pow2"]["hit_rate"])
        out[f"replicas_{replicas}"] = runs
    return out


async def burst(base_url: str, jobs: list[tuple[str, dict]]) -> list[str]:
    """Send jobs at once (not streamed); the replica that served each one."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        responses = await asyncio.gather(
            *(client.post(path, json={**payload, "model": MODEL}) for path, payload in jobs)
        )
    for response in responses:
        response.raise_for_status()
    return [response.headers["x-kvserve-replica"] for response in responses]


def run_bursts(args, engine: dict) -> dict:
    (job,) = token_jobs(random.Random(13), 1, args.burst_prompt, args.burst_output)
    out = {}
    for router in ("kv", "pow2"):
        app = App(f"bench-bursts-{router}", router, engine)
        shares = []
        for _ in range(args.bursts):
            served = asyncio.run(burst(app.base_url, [job] * args.burst_size))
            shares.append(max(served.count(r) for r in set(served)) / len(served))
            time.sleep(args.burst_gap)  # idle replicas again, and their reports say so
        app.close()
        out[router] = {"busiest_share_per_burst": shares, "max_busiest_share": max(shares)}
        print(f"bursts {router}: {out[router]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--rates-requests", type=int, default=40)
    parser.add_argument("--rates-prompt", type=int, default=128)
    parser.add_argument("--rates-output", type=int, default=32)
    parser.add_argument("--rates-kv-blocks", type=int, default=512)
    parser.add_argument("--routing-requests", type=int, default=150)
    parser.add_argument("--routing-rate", type=float, default=1.0)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--long-prompt", type=int, default=448)
    parser.add_argument("--short-prompt", type=int, default=32)
    parser.add_argument("--routing-output", type=int, default=48)
    parser.add_argument("--routing-kv-blocks", type=int, default=40)
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--think-time", type=float, default=2.0, help="mean seconds between turns")
    parser.add_argument("--chat-stagger", type=float, default=0.5, help="seconds between chat starts")
    parser.add_argument("--prefix-kv-blocks", type=int, default=128)
    parser.add_argument("--prefix-replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--burst-size", type=int, default=8)
    parser.add_argument("--burst-prompt", type=int, default=128)
    parser.add_argument("--burst-output", type=int, default=16)
    parser.add_argument("--burst-gap", type=float, default=1.0, help="seconds between bursts")
    parser.add_argument("--only", choices=["rates", "routing", "prefix", "bursts"], nargs="+")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/serving_<machine>.json"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run, written to the temp dir")
    args = parser.parse_args()
    engine = {"dtype": "bfloat16", "device": "cpu", "block_size": 16}
    if args.smoke:
        args.rates, args.rates_requests, args.routing_requests = [2.0], 6, 8
        args.chats, args.turns, args.prefix_replicas = 2, 2, [2]
        args.bursts = 2

    host = machine(platform=platform.platform(), ray=ray.__version__)
    result = {"engine_args": engine}
    experiments = {"rates": run_rates, "routing": run_routing, "prefix": run_prefix, "bursts": run_bursts}
    with local_serve(PORT):
        for name, run in experiments.items():
            if args.only is None or name in args.only:
                result[name] = run(args, engine)
    path = write_result("serving", args, result, host, args.out, args.smoke)
    if all(k in result for k in ("rates", "routing", "prefix")):
        plot_serving(result, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
