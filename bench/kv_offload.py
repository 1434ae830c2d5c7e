"""Multi-turn conversations with and without the host KV tier (`--kv-offloading-size`).

Each conversation resends its whole history every turn, as chat clients and agents do:
turn 1 is a long first message, and every later turn is the previous turn's prompt, a
reply and a new message. The device KV cache (`--kv-cache-memory-gb`) holds only a few
conversations, and `--concurrency` of them are in flight at once, so between two turns of
one conversation the others evict its blocks. Without the tier its next turn prefills its
whole history again; with it the evicted blocks are copied back.

The reply in a turn's history is a fixed stand-in, not the text the server generated:
re-tokenized text need not match the generated ids, and every system then sees the same
prompts. The previous prompt's blocks are what the next turn can find cached.

Each system is `kvserve serve` as a user starts it (bench/servers.py), both with the same
device cache, alternated round by round; with `--vllm`, also `vllm serve` (its CPU build,
bench/setup_vllm.sh) with a device cache of the same size, with `--kv-offloading-size`
and without. Figures: TTFT per turn (median and p99), the
median TTFT of turns 2 and later, output tok/s, and each tier's prefix hit rate (from
/metrics: vllm:prefix_cache_* for the device, vllm:external_prefix_cache_* for the host).

    python -m bench.kv_offload            # -> bench/results/kv_offload_<machine>.json
    python -m bench.kv_offload --smoke    # 4 conversations of 3 turns, to the temp dir
"""

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from transformers import AutoConfig

from bench.machine import machine, write_result
from bench.servers import VLLM_ENV, Server, free_port, kvserve_command, vllm_command
from bench.sse import Result, percentile, stream
from replica.model_loader import BUNDLED_NAME, resolve_model

VOCAB = (1000, 40000)  # ordinary tokens of the bundled model's vocabulary
VLLM_BLOCK = 32  # tokens per block of vLLM's CPU build


def conversations(args) -> list[list[list[int]]]:
    """Per conversation, per turn: the tokens that turn adds to the history."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    reply = tokens(args.reply_tokens)
    return [
        [tokens(args.first_tokens)] + [reply + tokens(args.message_tokens) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]


async def converse(client: httpx.AsyncClient, turns: list[list[int]], max_tokens: int) -> list[Result]:
    history, results = [], []
    for added in turns:
        history = history + added
        payload = {"model": BUNDLED_NAME, "prompt": history, "max_tokens": max_tokens}
        payload |= {"temperature": 0, "ignore_eos": True}
        results.append(await stream(client, "/v1/completions", payload))
    return results


async def run_load(url: str, convs: list[list[list[int]]], args) -> tuple[list[list[Result]], float]:
    """Every conversation, `concurrency` at a time: results per conversation, per turn."""
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def one(turns):
            async with gate:
                return await converse(client, turns, args.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(turns) for turns in convs))
    return results, time.perf_counter() - start


def counters(url: str) -> dict[str, float]:
    """The prefix-cache counters of /metrics, summed over labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"vllm:((?:external_)?prefix_cache_\w+?)_total(?:\{[^}]*\})?\s+(\S+)$", line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def summary(results: list[list[Result]], seconds: float, before: dict, after: dict) -> dict:
    errors = [r.error for conv in results for r in conv if not r.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    turns = len(results[0])
    ttft = [[conv[t].ttft for conv in results] for t in range(turns)]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def rate(hits: str, queries: str) -> float | None:
        return delta[hits] / delta[queries] if delta.get(queries) else None

    return {
        "ttft_p50_s_per_turn": [statistics.median(t) for t in ttft],
        "ttft_p99_s_per_turn": [percentile(t, 99) for t in ttft],
        "ttft_p50_s_turns_2_on": statistics.median(x for t in ttft[1:] for x in t),
        "output_tokens_per_s": sum(r.output_tokens for conv in results for r in conv) / seconds,
        "seconds": seconds,
        "device_prefix_hit_rate": rate("prefix_cache_hits", "prefix_cache_queries"),
        "host_prefix_hit_rate": rate("external_prefix_cache_hits", "external_prefix_cache_queries"),
        "counters": delta,
        "texts": [[r.text for r in conv] for conv in results],
    }


def server_command(system: str, offloading_gib: float, port: int, args) -> tuple[list[str], dict]:
    """The system's command line and environment, with a device cache of args.kv_cache_gb."""
    if system == "kvserve":
        command = kvserve_command(port, args.dtype, free_port())
        return command + ["--kv-cache-memory-gb", str(args.kv_cache_gb)] + offloading(offloading_gib), {}
    # vLLM's CPU cache is sized in whole GiB (VLLM_CPU_KVCACHE_SPACE); a block count sets it exactly.
    model = resolve_model(None)
    hf = AutoConfig.from_pretrained(model)
    head_dim = hf.hidden_size // hf.num_attention_heads
    block_bytes = hf.num_hidden_layers * 2 * VLLM_BLOCK * hf.num_key_value_heads * head_dim * 2
    blocks = int(args.kv_cache_gb * 2**30) // block_bytes
    command = vllm_command(model, port, args.dtype)
    command += ["--block-size", str(VLLM_BLOCK), "--num-gpu-blocks-override", str(blocks)]
    return command + offloading(offloading_gib), VLLM_ENV


def offloading(gib: float) -> list[str]:
    return ["--kv-offloading-size", str(gib)] if gib else []


def run_system(name: str, offloading_gib: float, convs, args) -> dict:
    port = free_port()
    command, env = server_command(name.split("_")[0], offloading_gib, port, args)
    log = Path(tempfile.gettempdir()) / f"kv_offload_{name}.log"
    server = Server(command, port, log, env).start()
    try:
        server.wait_ready()
        asyncio.run(run_load(server.url, convs[:1], args))  # warm-up: one conversation, untimed
        before = counters(server.url)
        results, seconds = asyncio.run(run_load(server.url, convs[1:], args))
        return {"command": " ".join(command), **summary(results, seconds, before, counters(server.url))}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=32, help="timed, after one untimed")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=1000)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--message-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    parser.add_argument("--kv-cache-gb", type=float, default=0.25, help="the device cache, both systems")
    parser.add_argument("--offloading-gib", type=float, default=4.0, help="the host tier, where on")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=1, help="each system once per round, in turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="also vllm serve, with and without offloading")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.first_tokens, args.message_tokens = 4, 3, 200, 64
        args.concurrency, args.max_tokens = 2, 8
    convs = conversations(argparse.Namespace(**{**vars(args), "conversations": args.conversations + 1}))
    systems = {"kvserve_without_tier": 0.0, "kvserve_with_tier": args.offloading_gib}
    if args.vllm:
        systems |= {"vllm_without_tier": 0.0, "vllm_with_tier": args.offloading_gib}
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    failed: dict[str, str] = {}
    for round_ in range(args.rounds):
        order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
        for name in order:
            try:
                runs[name].append(run_system(name, systems[name], convs, args))
            except (RuntimeError, TimeoutError) as e:  # a peer that cannot run this: say why
                failed[name] = f"{type(e).__name__}: {e}; see {tempfile.gettempdir()}/kv_offload_{name}.log"
                print(name, "failed:", failed[name], flush=True)
                continue
            run = runs[name][-1]
            print(name, round_, {k: run[k] for k in ("ttft_p50_s_turns_2_on", "output_tokens_per_s")})

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    def over(a: str, b: str) -> dict[str, float]:
        return {
            "ttft_p50_turns_2_on": median(a, "ttft_p50_s_turns_2_on") / median(b, "ttft_p50_s_turns_2_on"),
            "output_tokens_per_s": median(a, "output_tokens_per_s") / median(b, "output_tokens_per_s"),
        }

    with_tier, without = "kvserve_with_tier", "kvserve_without_tier"
    ratios = {"kvserve_with_over_without": over(with_tier, without)}
    for pair, (a, b) in {
        "vllm_with_over_without": ("vllm_with_tier", "vllm_without_tier"),
        "kvserve_over_vllm_both_with_tier": (with_tier, "vllm_with_tier"),
        "kvserve_over_vllm_both_without": (without, "vllm_without_tier"),
    }.items():
        if runs.get(a) and runs.get(b):
            ratios[pair] = over(a, b)
    equal = sum(
        a == b
        for run_with, run_without in zip(runs[with_tier], runs[without], strict=True)
        for conv_with, conv_without in zip(run_with["texts"], run_without["texts"], strict=True)
        for a, b in zip(conv_with, conv_without, strict=True)
    )
    total = sum(len(conv) for run in runs[with_tier] for conv in run["texts"])
    result = {
        "what": f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at a time, "
        f"kvserve serve with a {args.kv_cache_gb} GiB device KV cache, with a {args.offloading_gib} GiB "
        "host tier and without",
        "ratios": ratios,
        "failed": failed,
        "greedy_texts_equal": f"{equal} of {total} ({args.dtype}; the bar's fp32 equality is a test)",
        "runs": runs,
    }
    path = write_result("kv_offload", args, result, machine(), smoke=args.smoke)
    print(ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
