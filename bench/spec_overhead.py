"""What n-gram speculation costs on text it cannot predict, measured on one server so
that the machine's drift cancels: `kvserve serve --speculative-config` (ngram), loaded
with random-token prompts in waves that alternate between speculating requests and
requests that opt out (`"speculative": false`), in ABBA order, each pair of waves on the
same prompts.

bench.spec_decode compares separate servers, one after the other; on a machine whose
speed drifts by 10-15% over minutes, that reads the drift as well as any overhead. Here
both halves run on the same server in alternating waves of a few seconds, so what
differs between them is speculation itself: proposals made and verified (rarely, on
random text), and the per-step checks for a lead.

A wave is `--wave-requests` prompts (random token ids, --input-len of them), at most
`concurrency` in flight, --output-len tokens each with EOS ignored and the server's
default sampling, as `vllm bench serve --dataset-name random --ignore-eos` sends them
(with greedy sampling the 135M model falls into loops on random prompts, which n-grams
then predict); its throughput is the output tokens over the seconds from its first
request to its last answer.

    python -m bench.spec_overhead    # bench/results/spec_overhead_<machine>.json
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import machine, write_result
from bench.servers import Server
from bench.spec_decode import PORT, SPECULATIVE, server_command
from bench.spec_results import acceptance, spec_counters, sum_counters
from replica.model_loader import BUNDLED_NAME, resolve_model

ON, OFF = "speculative", "opted_out"


async def wave(
    url: str, prompts: list[list[int]], concurrency: int, output_len: int, speculative: bool
) -> dict:
    """The prompts at most `concurrency` at a time: output tokens and seconds."""
    limit = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        body = {
            "model": BUNDLED_NAME, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "speculative": speculative,
        }  # fmt: skip
        async with limit:
            response = await client.post(f"{url}/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, p) for p in prompts))
        seconds = time.perf_counter() - start
    return {"tokens": sum(tokens), "seconds": seconds, "output_throughput": sum(tokens) / seconds}


def measure(url: str, concurrency: int, args, rng: random.Random, vocab: int) -> dict:
    """--waves pairs of waves, ABBA; each pair on the same fresh prompts."""
    per_wave = max(args.wave_requests, concurrency)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(per_wave)]

    warm = prompts()
    for speculative in (True, False):  # one untimed wave of each
        asyncio.run(wave(url, warm, concurrency, args.output_len, speculative))
    waves: dict[str, list[dict]] = {ON: [], OFF: []}
    pair_ratios = []
    for i in range(args.waves):
        batch = prompts()
        order = (ON, OFF) if i % 2 == 0 else (OFF, ON)
        for mode in order:
            before = spec_counters(url)
            result = asyncio.run(wave(url, batch, concurrency, args.output_len, mode == ON))
            result["spec_decode"] = acceptance(before, spec_counters(url))
            waves[mode].append(result)
        pair_ratios.append(waves[ON][-1]["output_throughput"] / waves[OFF][-1]["output_throughput"])
    totals = {
        mode: sum(w["tokens"] for w in runs) / sum(w["seconds"] for w in runs) for mode, runs in waves.items()
    }
    out = {
        "concurrency": concurrency,
        "requests_per_wave": per_wave,
        "output_throughput": totals,
        "speculative_over_opted_out": totals[ON] / totals[OFF],
        "pair_ratios": pair_ratios,
        "median_pair_ratio": statistics.median(pair_ratios),
        "proposals": sum_counters([w["spec_decode"] for w in waves[ON]]),
        "proposals_opted_out": sum_counters([w["spec_decode"] for w in waves[OFF]]),
        "waves": waves,
    }
    print(
        f"c{concurrency}: speculative {totals[ON]:.1f} tok/s, opted out {totals[OFF]:.1f} tok/s, "
        f"ratio {out['speculative_over_opted_out']:.3f} (per pair {min(pair_ratios):.2f}-"
        f"{max(pair_ratios):.2f}, median {out['median_pair_ratio']:.3f}), proposals {out['proposals']}",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--waves", type=int, default=8, help="pairs of waves per concurrency")
    parser.add_argument("--wave-requests", type=int, default=4, help="at least the concurrency")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/spec_overhead_<machine>.json"
    )
    args = parser.parse_args()
    model = resolve_model(None)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    command, env = server_command("kvserve-ngram", model, args.port, args.dtype)
    host = machine(platform=platform.platform(), load_average=os.getloadavg())
    result = {
        "dtype": args.dtype,
        "model": BUNDLED_NAME,
        "speculative_config": SPECULATIVE,
        "command": " ".join(command),
        "workload": f"waves of max({args.wave_requests}, concurrency) random-token prompts, "
        f"{args.input_len} in / {args.output_len} out, default sampling, EOS ignored; {args.waves} pairs of "
        "waves per concurrency, speculating and opted out in ABBA order, each pair on the same "
        "prompts, after one untimed wave of each",
        "runs": [],
    }
    server = Server(
        command, args.port, Path(tempfile.gettempdir()) / "spec_overhead_kvserve.log", env
    ).start()
    try:
        result["ready_after_s"] = server.wait_ready()
        rng = random.Random(args.seed)
        for concurrency in args.concurrency:
            result["runs"].append(measure(server.url, concurrency, args, rng, vocab))
    finally:
        result.update(server.stop())
    print(f"wrote {write_result('spec_overhead', args, result, host, args.out)}")


if __name__ == "__main__":
    main()
