"""Speculative decoding (n-gram prompt lookup): kvserve against vLLM, each with and without
`--speculative-config`, one system at a time in one run on the same machine, the same
model (the bundled SmolLM2) in the same dtype (float32 unless --dtype says otherwise).

The run goes in --rounds rounds, the systems in turns (ABBA: the order reverses every
round), each round with its share of the workloads' prompts; a system's figures merge its
rounds. Machines here drift by 10-15% over minutes, more than the few percent a
speculation overhead bar is about, and one system measured after another reads the drift.

Each server is started as a user starts it (bench/servers.py), waited for
(/health), then measured on two workloads:

  repeat   chat prompts whose answers repeat their prompt ("Repeat this list exactly,
           then add one item:" + a numbered list of 100-300 tokens, and code snippets to
           rewrite with a variable renamed), greedy, one request at a time after one
           warm-up, by this script's own streaming client: per request TTFT and
           TPOT = (last token time - first token time) / (tokens - 1), tokens counted from
           the usage the server streams (a speculative step can send several in one
           chunk). Speculation should shine here.
  random   `vllm bench serve`, random 128 in / 64 out, --ignore-eos, at concurrency 1 and
           16: prompts that n-grams cannot predict, so this measures the overhead.

The servers' vllm:spec_decode_* counters (/metrics) give the acceptance on each workload,
and the greedy answers of a system with speculation are compared with those without it.

    python -m bench.spec_decode            # bench/results/spec_decode_<machine>.json
    python -m bench.spec_decode --smoke    # 3 repeat prompts, short random runs, to the temp dir
    python -m bench.spec_decode --systems vllm vllm-ngram

A system that fails (vLLM refusing the speculative config, say) is recorded with its
error text and the tail of its log, and the run goes on with the next one.
"""

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import machine, write_result
from bench.peers import TCMALLOC, VLLM_VENV, vllm_model
from bench.servers import VLLM_ENV, Server, kvserve_command, vllm_command
from bench.spec_prompts import items_echoed, repeat_prompts
from bench.spec_results import SYSTEMS, acceptance, merge_rounds, repeat_summary, spec_counters, summarize
from bench.sse import sse_event
from bench.vllm_bench_serve import bench_serve
from replica.model_loader import BUNDLED_NAME, resolve_model

PORT = 18700
# The same config for both systems (vLLM 0.32's names).
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def server_command(
    system: str, model: Path, port: int, dtype: str, preload: bool = False
) -> tuple[list[str], dict]:
    """The base system's command (bench/servers.py), with --speculative-config for -ngram;
    with `preload`, vLLM gets the tcmalloc and Intel OpenMP preloads its CPU docs ask for
    (without libiomp5 it warns that speculation "will cause significant performance loss")."""
    base = system.removesuffix("-ngram")
    if base == "kvserve":
        command, env = kvserve_command(port, dtype), {}
    else:
        command, env = vllm_command(model, port, dtype), VLLM_ENV
    if base == "vllm" and preload:
        libs = [p for p in (TCMALLOC, VLLM_VENV / "lib" / "libiomp5.so") if p.exists()]
        env = {**env, "LD_PRELOAD": ":".join(str(p) for p in libs)}
    if system.endswith("-ngram"):
        command = command + ["--speculative-config", json.dumps(SPECULATIVE)]
    return command, env


def stream_chat(url: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """One greedy streaming chat request: TTFT, TPOT from the usage's token count, the text."""
    body = {
        "model": BUNDLED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = time.perf_counter()
    first = last = any_first = any_last = None
    usage = None
    pieces = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if (event := sse_event(line)) is None:
                continue
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if "role" in delta and not content:
                    continue
                now = time.perf_counter()
                # Timed from chunks with text; chunks without are the fallback (an answer of
                # special tokens only, which decode to nothing).
                any_first, any_last = any_first or now, now
                if content:
                    first, last = first or now, now
                    pieces.append(content)
    end = time.perf_counter()
    if usage is None or any_first is None:
        raise RuntimeError("the stream carried no usage or no tokens")
    if first is None:
        first, last = any_first, any_last
    tokens = usage["completion_tokens"]
    text = "".join(pieces)
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "output_tokens": tokens,
        "ttft_s": first - start,
        "tpot_ms": (last - first) / (tokens - 1) * 1000 if tokens > 1 else None,
        "e2e_s": end - start,
        "text_sha1": hashlib.sha1(text.encode()).hexdigest()[:12],
        "text_head": text[:80],
        "text": text,
    }


def run_repeat(url: str, prompts: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    stream_chat(url, "Write one sentence about the sea.", 32, extra)  # warm-up
    before = spec_counters(url)
    requests = []
    start = time.perf_counter()
    for prompt in prompts:
        answer = stream_chat(url, prompt["text"], max_tokens, extra)
        requests.append({"prompt": prompt["index"], "kind": prompt["kind"], **answer})
    seconds = time.perf_counter() - start
    for prompt, request in zip(prompts, requests, strict=True):
        text = request.pop("text")
        if prompt["kind"] == "list":
            request["items_echoed"] = items_echoed(prompt["items"], text)
    return repeat_summary(requests, max_tokens, seconds, acceptance(before, spec_counters(url)))


def random_prompts(args, concurrency: int) -> int:
    """The random workload's prompts at a concurrency, over all rounds."""
    return args.num_prompts or min(max(32, 4 * concurrency), 128)


def run_random(url: str, model: Path, args, runs: list[dict]) -> None:
    """vllm bench serve at each concurrency, with one round's share of the prompts; each
    run appended to `runs` as it ends."""
    for concurrency in args.concurrency:
        num_prompts = -(-random_prompts(args, concurrency) // args.rounds)
        before = spec_counters(url)
        run = bench_serve(url, model, args.input_len, args.output_len, concurrency, num_prompts)
        run["spec_decode"] = acceptance(before, spec_counters(url))  # warm-ups included
        runs.append(run)
        if run["failed"] or not run["completed"]:
            raise RuntimeError(f"random c{concurrency}: {run['failed']} of {num_prompts} requests failed")
        print(f"  random c{concurrency}: {run['output_throughput']:.1f} tok/s, "
              f"median TPOT {run['median_tpot_ms']:.1f} ms", flush=True)  # fmt: skip


def log_error(log_path: Path) -> tuple[str | None, list[str]]:
    """The last error-looking line of a server's log, and the log's last 40 lines."""
    lines = log_path.read_text(errors="replace").splitlines()
    errors = [line for line in lines if re.search(r"Error|error:|Exception|refus|not supported", line)]
    return (errors[-1].strip() if errors else None), lines[-40:]


def run_system(system: str, model: Path, prompts: list[dict], args) -> dict:
    """One round of a system: its server started, the workloads' share run, stopped."""
    command, env = server_command(system, model, args.port, args.dtype, args.vllm_preload)
    log_path = Path(tempfile.gettempdir()) / f"spec_decode_{system}.log"
    print(f"{system}: {shlex.join(command)}", flush=True)
    server = Server(command, args.port, log_path, env).start()
    url = server.url
    out = {"command": shlex.join(command), "env": env, "log": str(log_path), "load_average": os.getloadavg()}
    try:
        out["ready_after_s"] = server.wait_ready(timeout_s=args.ready_timeout)
        out["repeat"] = run_repeat(url, prompts, args.max_tokens)
        print(f"  repeat: median TPOT {out['repeat']['median_tpot_ms']:.1f} ms, "
              f"{out['repeat']['output_throughput']:.1f} tok/s, "
              f"{out['repeat']['mean_output_tokens']:.0f} tokens/answer, "
              f"spec {out['repeat']['spec_decode']}", flush=True)  # fmt: skip
        if args.opt_out and system.endswith("-ngram"):
            # The same prompts with the per-request opt-out: should match the base system.
            out["repeat_opted_out"] = run_repeat(url, prompts, args.max_tokens, {"speculative": False})
        out["random"] = []
        run_random(url, model, args, out["random"])
    except Exception as error:  # noqa: BLE001 - recorded, and the next system runs
        server.log.flush()
        out["error"] = f"{type(error).__name__}: {error}"
        out["server_error"], out["log_tail"] = log_error(log_path)
        print(f"  FAILED: {out['error']}\n  server: {out['server_error']}", flush=True)
    finally:
        out.update(server.stop())
        out["speculation_warnings"] = speculation_warnings(log_path)
    return out


def speculation_warnings(log_path: Path) -> list[str]:
    """The server log's warnings about speculation (vLLM's: what it turns off, what it lacks)."""
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        if re.search(r"WARN", line) and re.search(r"(?i)specul|ngram|draft", line):
            message = line.split("] ", 1)[-1].strip()
            if message not in found:
                found.append(message)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--repeat-prompts", type=int, default=12, help="the last two are code snippets")
    parser.add_argument("--max-tokens", type=int, default=256, help="repeat workload")
    parser.add_argument("--seed", type=int, default=0, help="repeat workload's lists")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="random workload")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="random: default 4 x concurrency, 32 to 128"
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--opt-out", action="store_true", help='also repeat with "speculative": false on -ngram'
    )
    parser.add_argument(
        "--vllm-preload", action="store_true", help="vLLM with LD_PRELOAD of tcmalloc and libiomp5"
    )
    parser.add_argument("--port", type=int, default=PORT, help="the server's (kvserve's gRPC: port + 1)")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/spec_decode_<machine>.json"
    )
    parser.add_argument("--rounds", type=int, default=2, help="the systems in turns, ABBA")
    parser.add_argument("--smoke", action="store_true", help="tiny run, written to the temp dir")
    args = parser.parse_args()
    if args.smoke:
        args.repeat_prompts, args.max_tokens = 3, 96
        args.num_prompts, args.output_len, args.rounds = 8, 16, 1
    if any(s.startswith("vllm") for s in args.systems) and not (VLLM_VENV / "bin/vllm").exists():
        sys.exit("the vLLM peer is missing: run bash bench/setup_vllm.sh first")
    model = resolve_model(None)
    prompts = repeat_prompts(model, args.repeat_prompts, args.seed)
    # The load average before the run: the figures are only worth something on a quiet machine.
    host = machine(platform=platform.platform(), load_average=os.getloadavg())
    result = {
        "dtype": args.dtype,
        "model": BUNDLED_NAME,
        "speculative_config": SPECULATIVE,
        "workloads": {
            "repeat": f"{len(prompts)} chat prompts (lists to repeat, code to rewrite), greedy, "
            f"max_tokens {args.max_tokens}, concurrency 1, own streaming client, 1 warm-up",
            "random": f"vllm bench serve, random {args.input_len} in / {args.output_len} out, --ignore-eos, "
            f"4 warm-ups per round, concurrency {args.concurrency}, prompts "
            f"{[random_prompts(args, c) for c in args.concurrency]} over the rounds",
        },
        "note": f"{args.rounds} rounds, the systems in turns (ABBA), each round with its share of "
        "the prompts; servers and client share the machine",
        "systems": {},
    }
    if any(s.startswith("vllm") for s in args.systems):
        result["vllm_model"] = {
            "path": str(vllm_model(model)),
            "why": "the bundled model's embedding is stored as lm_head.weight only (tied); vLLM "
            "leaves model.embed_tokens.weight unloaded and answers token 0 every step, so it gets "
            "a copy with the tensor under model.embed_tokens.weight (same weights)",
        }
    rounds: dict[str, list[dict]] = {system: [] for system in args.systems}
    for r in range(args.rounds):
        for system in args.systems if r % 2 == 0 else args.systems[::-1]:
            print(f"round {r + 1} of {args.rounds}: ", end="")
            rounds[system].append(run_system(system, model, prompts[r :: args.rounds], args))
        result["systems"] = {system: merge_rounds(rounds[system]) for system in args.systems}
        result.update(summarize(result["systems"]))
        path = write_result("spec_decode", args, result, host, args.out, args.smoke)  # after each round
    print(json.dumps({k: result[k] for k in result if k != "systems"}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
