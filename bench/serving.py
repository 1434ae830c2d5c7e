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

    python bench/serving.py            # writes bench/results/serving_cpu.{json,png}
    python bench/serving.py --quick    # smoke run

bench/serving_peers.py compares `kvserve serve` with `vllm serve` under vLLM's own load
generator; it runs both as subprocess servers, so it is a script of its own.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from bench.machine import machine  # noqa: E402
from deployments.app import build_app  # noqa: E402
from router.placement.coordinator import coordinator_address  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PORT = 18555
MODEL = "kvserve-bench"
WORDS = "river stone light paper garden window music silver orange cloud forest engine market"


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str | None = None


async def stream(client: httpx.AsyncClient, path: str, payload: dict) -> Result:
    """One streaming request; a token event is a chunk carrying completion text."""
    body = {**payload, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    result = Result(ok=True)
    pieces = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return Result(ok=False, error=f"{response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                delta = choice.get("delta", {})
                if "role" in delta:
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                pieces.append(choice.get("text") or delta.get("content") or "")
    result.text = "".join(pieces)
    return result


async def poisson(base_url: str, jobs: list[tuple[str, dict]], rate: float, seed: int):
    """Send jobs at Poisson arrival times; returns (results, seconds until the last finished)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        start, due, tasks = time.perf_counter(), 0.0, []
        for path, payload in jobs:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(stream(client, path, payload)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


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
            result = await stream(client, "/v1/chat/completions", payload)
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


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def latency_summary(results: list[Result], seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "seconds": seconds,
    }


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
        serve.run(build_app(config), name=name, route_prefix="/")
        namespace, coordinator_name = coordinator_address(name)
        self.coordinator = ray.get_actor(coordinator_name, namespace=namespace)
        while len(ray.get(self.coordinator.snapshot.remote())) < replicas:
            time.sleep(0.1)
        self.base_url = f"http://127.0.0.1:{PORT}"
        # Warm up both replicas' first-call paths outside the measurement.
        warm = token_jobs(random.Random(99), 2 * replicas, 16, 4)
        asyncio.run(poisson(self.base_url, warm, rate=100.0, seed=99))

    def totals(self) -> dict:
        snapshot = ray.get(self.coordinator.snapshot.remote())
        keys = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
        return {k: sum(getattr(s, k) for s in snapshot.values()) for k in keys}

    def close(self) -> None:
        serve.delete(self.name)
        ray.kill(self.coordinator)


def run_rates(args) -> list[dict]:
    app = App("bench-rates", "kv", {**args.engine, "num_kv_blocks": args.rates_kv_blocks})
    out = []
    for i, rate in enumerate(args.rates):
        jobs = token_jobs(random.Random(i), args.rates_requests, args.rates_prompt, args.rates_output)
        results, seconds = asyncio.run(poisson(app.base_url, jobs, rate, seed=i))
        out.append({"rate_rps": rate, **latency_summary(results, seconds)})
        print(f"rate {rate}/s: {out[-1]}", flush=True)
    app.close()
    return out


def run_routing(args) -> dict:
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
        app = App(f"bench-routing-{router}", router, {**args.engine, "num_kv_blocks": args.routing_kv_blocks})
        results, seconds = asyncio.run(poisson(app.base_url, jobs, args.routing_rate, seed=9))
        out[router] = {**latency_summary(results, seconds), **app.totals()}
        app.close()
        print(f"routing {router}: {out[router]}", flush=True)
    out["p99_ttft_kv_over_pow2"] = out["kv"]["ttft_p99_s"] / out["pow2"]["ttft_p99_s"]
    return out


def run_prefix(args) -> dict:
    """Hit rates with 2 and with 4 replicas: with 2, a random pick lands on the replica
    holding the conversation half the time, so power-of-two is at its strongest there."""
    out = {}
    for replicas in args.prefix_replicas:
        runs = {}
        for router in ("kv", "pow2"):
            name = f"bench-prefix-{router}-{replicas}"
            engine = {**args.engine, "num_kv_blocks": args.prefix_kv_blocks}
            app = App(name, router, engine, replicas=replicas)
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


def run_bursts(args) -> dict:
    (job,) = token_jobs(random.Random(13), 1, args.burst_prompt, args.burst_output)
    out = {}
    for router in ("kv", "pow2"):
        app = App(f"bench-bursts-{router}", router, args.engine)
        shares = []
        for _ in range(args.bursts):
            served = asyncio.run(burst(app.base_url, [job] * args.burst_size))
            shares.append(max(served.count(r) for r in set(served)) / len(served))
            time.sleep(args.burst_gap)  # idle replicas again, and their reports say so
        app.close()
        out[router] = {"busiest_share_per_burst": shares, "max_busiest_share": max(shares)}
        print(f"bursts {router}: {out[router]}", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    rates = result["rates"]
    x = [r["rate_rps"] for r in rates]
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
        a.plot(x, [r[key] * 1000 for r in rates], marker="o", label=label)
    for key, label in (("itl_p50_s", "ITL p50"), ("itl_p99_s", "ITL p99")):
        a.plot(x, [r[key] * 1000 for r in rates], marker="s", linestyle="--", label=label)
    a.set(xlabel="arrival rate (req/s)", ylabel="ms", title="Latency vs load (KV router, 2 replicas)")
    a.legend()
    routing = result["routing"]
    names = ["kv", "pow2"]
    b.bar(names, [routing[n]["ttft_p99_s"] for n in names], color=["tab:green", "tab:gray"])
    for i, n in enumerate(names):
        b.text(
            i,
            routing[n]["ttft_p99_s"],
            f"{routing[n]['num_preemptions']} preemptions",
            ha="center",
            va="bottom",
        )
    b.set(
        ylabel="p99 TTFT (s)",
        title=f"Long/short mix, small KV: kv/pow2 = {routing['p99_ttft_kv_over_pow2']:.2f}",
    )
    groups = list(result["prefix"].items())
    width = 0.38
    for offset, router, color in ((-width / 2, "kv", "tab:green"), (width / 2, "pow2", "tab:gray")):
        xs = [i + offset for i in range(len(groups))]
        c.bar(xs, [runs[router]["hit_rate"] for _, runs in groups], width, label=router, color=color)
    labels = [f"{k.split('_')[1]} replicas\nkv/pow2 = {r['hit_rate_kv_over_pow2']:.2f}x" for k, r in groups]
    c.set_xticks(range(len(groups)), labels)
    c.set(ylabel="prefix-cache hit rate", ylim=(0, 1), title="Multi-turn chats")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_cpu.json")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = parser.parse_args()
    args.engine = {"dtype": "bfloat16", "device": "cpu", "block_size": 16}
    if args.quick:
        args.rates, args.rates_requests, args.routing_requests = [2.0], 6, 8
        args.chats, args.turns, args.prefix_replicas = 2, 2, [2]
        args.bursts = 2

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    result = {
        "machine": machine(platform=platform.platform(), ray=ray.__version__),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "only")},
    }
    try:
        experiments = {"rates": run_rates, "routing": run_routing, "prefix": run_prefix, "bursts": run_bursts}
        for name, run in experiments.items():
            if args.only is None or name in args.only:
                result[name] = run(args)
    finally:
        serve.shutdown()
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    if all(k in result for k in ("rates", "routing", "prefix")):
        plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
