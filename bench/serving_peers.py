"""`kvserve serve` against `vllm serve`, both measured by vLLM's own load generator
(`vllm bench serve`), one after the other in one run on the same machine: the same
model (the bundled SmolLM2, bf16 unless --dtype says otherwise), the same random
prompts, at several concurrencies.

Each server is started as a user starts it (bench/servers.py), waited for (/health),
probed with one request and then ten (first-request latency against the tenth), loaded
at every concurrency, and stopped with SIGTERM (time to exit). vLLM's CPU build lives in
its own venv (bench/setup_vllm.sh), which also provides the `vllm bench serve` client; the
servers and the client share this machine's cores, so the client's own CPU time is
reported next to each figure. Every figure comes from a single run.

Beside them, the engine alone (`--offline`, on by default): kvserve's `LLM.generate`, in
this process on every core, on as many random prompts as the largest run sent, of the same
lengths, with the sampling the servers give these requests (the model's generation config).
Served throughput at the largest concurrency over it says what serving costs.

`--systems kvserve-gguf llama-server`: the bundled GGUF's own Q4_1 blocks in both, kvserve
with `--quantization gguf` and llama.cpp's `llama-server` (built from source, see
docs/development.md), compared the same way.

    python -m bench.serving_peers          # bench/results/serving_peers_<machine>.{json,png}
    python -m bench.serving_peers --smoke  # concurrency 2, 8 prompts, to the temp dir
"""

import argparse
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.machine import machine, write_result
from bench.peers import VLLM_VENV
from bench.plots import plot_serving_peers
from bench.servers import VLLM_ENV, Server, kvserve_command, llama_server_command, vllm_command
from bench.vllm_bench_serve import bench_serve
from kvserve import LLM, SamplingParams
from replica.model_files import sampling_defaults
from replica.model_loader import BUNDLED_NAME, bundled_gguf_path, resolve_model

PORT = 18600


def first_and_tenth(url: str, requests: int = 10) -> dict:
    """Seconds for the first request after start-up, and for the tenth, sent one by one."""
    body = {"model": BUNDLED_NAME, "prompt": "Hello there, my friend", "max_tokens": 16, "temperature": 0}
    seconds = []
    for _ in range(requests):
        start = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        seconds.append(time.perf_counter() - start)
    return {"first_s": seconds[0], "tenth_s": seconds[-1], "first_over_tenth": seconds[0] / seconds[-1]}


def num_prompts(concurrency: int, args) -> int:
    return args.num_prompts or min(max(16, 4 * concurrency), 128)


SYSTEMS = ("kvserve", "vllm", "kvserve-gguf", "llama-server")
PAIRS = (("kvserve", "vllm"), ("kvserve-gguf", "llama-server"))  # kvserve first, its peer second


def offline_engine(model: Path, args, requests: int) -> dict:
    """LLM.generate on `requests` random prompts of args.input_len tokens, args.output_len
    tokens each (EOS ignored), with the model's sampling defaults; timed after a warm-up."""
    llm = LLM(str(model), dtype=args.dtype)
    defaults = sampling_defaults(model)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **defaults)
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]

    llm.generate(prompts(4), params, use_tqdm=False)
    batch = prompts(requests)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "num_prompts": requests,
        "sampling": defaults,
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "output_throughput": tokens / seconds,
    }


def server_command(system: str, model: Path, args) -> tuple[list[str], dict]:
    """(command, environment) of each system: kvserve on the dequantized model or on the
    GGUF's own blocks (kvserve-gguf), vLLM, and llama-server on the bundled GGUF itself."""
    if system == "kvserve":
        return kvserve_command(PORT, args.dtype), {}
    if system == "kvserve-gguf":
        return [*kvserve_command(PORT, args.dtype), "--quantization", "gguf"], {}
    if system == "llama-server":
        slots = max(args.concurrency)
        context = slots * (args.input_len + args.output_len + 16)
        return llama_server_command(args.llama_server, bundled_gguf_path(), PORT, slots, context), {}
    return vllm_command(model, PORT, args.dtype), VLLM_ENV


def run_system(system: str, model: Path, args) -> dict:
    command, env = server_command(system, model, args)
    log = Path(tempfile.gettempdir()) / f"serving_peers_{system}.log"
    server = Server(command, PORT, log, env).start()
    out = {"command": " ".join(command), "env": env}
    try:
        out["ready_after_s"] = server.wait_ready()
        out["first_request"] = first_and_tenth(server.url)
        out["runs"] = []
        for concurrency in args.concurrency:
            run = bench_serve(
                server.url,
                model,
                args.input_len,
                args.output_len,
                concurrency,
                num_prompts(concurrency, args),
            )
            out["runs"].append(run)
            print(system, json.dumps(run), flush=True)
    finally:
        out.update(server.stop())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency, 16 to 128")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=["kvserve", "vllm"], choices=SYSTEMS)
    parser.add_argument(
        "--llama-server", type=Path, default=shutil.which("llama-server"), help="llama.cpp's server binary"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="both servers'; float32 on CPUs without AVX512-BF16 or AMX, which emulate bf16",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/serving_peers_<machine>.json"
    )
    parser.add_argument(
        "--no-offline", dest="offline", action="store_false", help="skip the engine-alone run"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny run, written to the temp dir")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.num_prompts, args.output_len = [2], 8, 16
    if not (VLLM_VENV / "bin/vllm").exists():
        sys.exit("the vLLM peer (and its load generator) is missing: run bash bench/setup_vllm.sh first")
    if "llama-server" in args.systems and not (args.llama_server and Path(args.llama_server).exists()):
        sys.exit("llama-server is missing: build it (docs/development.md) and pass --llama-server")
    model = resolve_model(None)
    host = machine(platform=platform.platform())
    result = {
        "dtype": args.dtype,
        "workload": f"random {args.input_len} in / {args.output_len} out, --ignore-eos, 4 warm-ups",
        "note": "each figure is from a single run; servers and client share the machine",
        "systems": {system: run_system(system, model, args) for system in args.systems},
    }
    for ours, peer in PAIRS:
        if ours in args.systems and peer in args.systems:
            kv, other = (result["systems"][s]["runs"] for s in (ours, peer))
            result[f"{ours}_over_{peer}".replace("-", "_")] = [
                {
                    "concurrency": a["concurrency"],
                    "output_throughput": a["output_throughput"] / b["output_throughput"],
                    "median_tpot": a["median_tpot_ms"] / b["median_tpot_ms"],
                    "p99_ttft": a["p99_ttft_ms"] / b["p99_ttft_ms"],
                }
                for a, b in zip(kv, other, strict=True)
            ]
    if args.offline:
        largest = max(args.concurrency)
        offline = result["offline_kvserve"] = offline_engine(model, args, num_prompts(largest, args))
        print("offline", json.dumps(offline), flush=True)
        if "kvserve" in result["systems"]:
            served = next(r for r in result["systems"]["kvserve"]["runs"] if r["concurrency"] == largest)
            result["served_over_offline"] = {
                "concurrency": largest,
                "ratio": served["output_throughput"] / offline["output_throughput"],
            }
    path = write_result("serving_peers", args, result, host, args.out, args.smoke)
    if not args.smoke and "kvserve_over_vllm" in result:
        plot_serving_peers({**result, "machine": host}, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
