"""Speculative decoding (n-gram prompt lookup): kvserve against vLLM, each with and without
`--speculative-config`, one system at a time in one run on the same machine, the same
model (the bundled SmolLM2) in the same dtype (float32 unless --dtype says otherwise).

The run goes in --rounds rounds, the systems in turns (ABBA: the order reverses every
round), each round with its share of the workloads' prompts; a system's figures merge its
rounds. Machines here drift by 10-15% over minutes, more than the few percent a
speculation overhead bar is about, and one system measured after another reads the drift.

Each server is started as a user starts it (bench/serving_peers.py), waited for
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

    python bench/spec_decode.py            # bench/results/spec_decode_cpu.json
    python bench/spec_decode.py --quick    # smoke run: 3 repeat prompts, short random runs
    python bench/spec_decode.py --systems vllm vllm-ngram

A system that fails (vLLM refusing the speculative config, say) is recorded with its
error text and the tail of its log, and the run goes on with the next one.
"""

import argparse
import hashlib
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.serving_peers as peers  # noqa: E402
from bench.machine import machine  # noqa: E402
from bench.peers import TCMALLOC, vllm_model  # noqa: E402
from replica.model_loader import BUNDLED_NAME, resolve_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PORT = 18700
# The same config for both systems (vLLM 0.32's names).
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SYSTEMS = ["kvserve", "kvserve-ngram", "vllm", "vllm-ngram"]
# The bars the speculative engine is held to (kvserve-ngram against kvserve).
REPEAT_TPOT_SPEEDUP_BAR = 1.6
RANDOM_THROUGHPUT_RATIO_BAR = 0.97

FRUITS = [
    "apple", "apricot", "avocado", "banana", "blackberry", "blueberry", "cantaloupe", "cherry",
    "clementine", "coconut", "cranberry", "date", "dragonfruit", "elderberry", "fig", "gooseberry",
    "grape", "grapefruit", "guava", "honeydew", "jackfruit", "kiwi", "kumquat", "lemon", "lime",
    "lychee", "mandarin", "mango", "mulberry", "nectarine", "orange", "papaya", "passionfruit",
    "peach", "pear", "persimmon", "pineapple", "plum", "pomegranate", "quince", "raspberry",
    "starfruit", "strawberry", "tangerine", "watermelon",
]  # fmt: skip
CITIES = [
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Berlin", "Bogota", "Boston", "Brussels",
    "Budapest", "Cairo", "Chicago", "Copenhagen", "Dublin", "Edinburgh", "Helsinki", "Istanbul",
    "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon", "London", "Madrid", "Manila", "Melbourne",
    "Montreal", "Mumbai", "Munich", "Nairobi", "Oslo", "Paris", "Prague", "Santiago", "Seoul",
    "Singapore", "Stockholm", "Sydney", "Taipei", "Tokyo", "Toronto", "Vancouver", "Vienna",
    "Warsaw", "Zurich",
]  # fmt: skip

CODE_SNIPPETS = [
    """def moving_average(values, window):
    x = 0.0
    averages = []
    for i, value in enumerate(values):
        x += value
        if i >= window:
            x -= values[i - window]
        if i >= window - 1:
            averages.append(x / window)
    return averages""",
    """def parse_config(lines):
    x = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        x[key.strip()] = value.strip()
    if "name" not in x:
        raise ValueError("the config has no name")
    return x""",
]


def repeat_prompts(model: Path, count: int, seed: int) -> list[dict]:
    """`count` prompts: numbered lists of 100-300 tokens (fruits or cities, deterministic
    from `seed`) to repeat, and the code snippets to rewrite, the last two of them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    prompts = []
    for index in range(count - len(CODE_SNIPPETS)):
        words = FRUITS if index % 2 == 0 else CITIES
        target = rng.randint(100, 300)
        items: list[str] = []
        tokens, order = 0, []
        while tokens < target:
            # Every name once before any repeats: repeats would make "exactly" ambiguous.
            order = order or rng.sample(words, len(words))
            items.append(f"{len(items) + 1}. {order.pop().capitalize()}")
            tokens = len(tokenizer.encode("\n".join(items)).ids)
        text = "Repeat this list exactly, then add one item:\n" + "\n".join(items)
        prompts.append({"index": index, "kind": "list", "list_tokens": tokens, "items": items, "text": text})
    for snippet in CODE_SNIPPETS[: max(0, count - len(prompts))]:
        ask = "Here is a code snippet; rewrite it exactly with variable x renamed to y:"
        text = f"{ask}\n```python\n{snippet}\n```"
        prompts.append({"index": len(prompts), "kind": "code", "text": text})
    return prompts


def server_command(system: str, model: Path, dtype: str, preload: bool = False) -> tuple[list[str], dict]:
    """serving_peers's command for the base system, with --speculative-config for -ngram;
    with `preload`, vLLM gets the tcmalloc and Intel OpenMP preloads its CPU docs ask for
    (without libiomp5 it warns that speculation "will cause significant performance loss")."""
    base = system.removesuffix("-ngram")
    command, env = peers.server_command(base, model, dtype)
    if base == "vllm" and preload:
        libs = [p for p in (TCMALLOC, peers.VLLM_VENV / "lib" / "libiomp5.so") if p.exists()]
        env = {**env, "LD_PRELOAD": ":".join(str(p) for p in libs)}
    if system.endswith("-ngram"):
        command = command + ["--speculative-config", json.dumps(SPECULATIVE)]
    return command, env


def stream_chat(prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
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
    with httpx.stream(
        "POST", f"http://127.0.0.1:{PORT}/v1/chat/completions", json=body, timeout=600
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
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


def spec_counters() -> dict | None:
    """The server's vllm:spec_decode_num_* counters (summed over labels), or None if none."""
    try:
        text = httpx.get(f"http://127.0.0.1:{PORT}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    counters: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"vllm:spec_decode_(num_\w+?)_total(?:\{[^}]*\})?\s+(\S+)$", line)
        if match and "per_pos" not in match.group(1):
            counters[match.group(1)] = counters.get(match.group(1), 0.0) + float(match.group(2))
    return counters or None


def acceptance(before: dict | None, after: dict | None) -> dict | None:
    """Drafts, draft tokens and accepted tokens between two counter readings, and rates."""
    if not before or not after:
        return None
    return with_rates({k: after[k] - before.get(k, 0.0) for k in after})


def with_rates(delta: dict) -> dict:
    """Counter deltas with the acceptance rate and mean acceptance length added."""
    delta = {k: v for k, v in delta.items() if k.startswith("num_")}
    drafts, drafted = delta.get("num_drafts", 0.0), delta.get("num_draft_tokens", 0.0)
    accepted = delta.get("num_accepted_tokens", 0.0)
    delta["acceptance_rate"] = accepted / drafted if drafted else None
    # Tokens per verified step: the accepted drafts plus the token the step samples itself.
    delta["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return delta


def items_echoed(items: list[str], answer: str) -> float:
    """The share of a list's items the answer repeats, in order, before its first miss."""
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    matched = 0
    for item, line in zip(items, lines, strict=False):
        if item != line:
            break
        matched += 1
    return matched / len(items)


def run_repeat(prompts: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    stream_chat("Write one sentence about the sea.", 32, extra)  # warm-up
    before = spec_counters()
    requests = []
    start = time.perf_counter()
    for prompt in prompts:
        answer = stream_chat(prompt["text"], max_tokens, extra)
        requests.append({"prompt": prompt["index"], "kind": prompt["kind"], **answer})
    seconds = time.perf_counter() - start
    for prompt, request in zip(prompts, requests, strict=True):
        text = request.pop("text")
        if prompt["kind"] == "list":
            request["items_echoed"] = items_echoed(prompt["items"], text)
    return repeat_summary(requests, max_tokens, seconds, acceptance(before, spec_counters()))


def repeat_summary(requests: list[dict], max_tokens: int, seconds: float, spec: dict | None) -> dict:
    tpots = [r["tpot_ms"] for r in requests if r["tpot_ms"] is not None]
    echoed = [r["items_echoed"] for r in requests if "items_echoed" in r]
    output_tokens = sum(r["output_tokens"] for r in requests)
    return {
        "num_prompts": len(requests),
        "max_tokens": max_tokens,
        "duration_s": seconds,
        "median_tpot_ms": statistics.median(tpots),
        "mean_tpot_ms": statistics.fmean(tpots),
        "median_ttft_ms": statistics.median(r["ttft_s"] for r in requests) * 1000,
        "mean_output_tokens": output_tokens / len(requests),
        "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in requests),
        "output_throughput": output_tokens / seconds,
        "spec_decode": spec,
        # Does the model do the task? Empty answers (special tokens only) mean broken outputs.
        "empty_answers": sum(r["text_head"] == "" for r in requests),
        "mean_items_echoed": statistics.fmean(echoed) if echoed else None,
        "requests": requests,
    }


def random_prompts(args, concurrency: int) -> int:
    """The random workload's prompts at a concurrency, over all rounds."""
    return args.num_prompts or min(max(32, 4 * concurrency), 128)


def run_random(model: Path, args, runs: list[dict]) -> None:
    """vllm bench serve at each concurrency, with one round's share of the prompts; each
    run appended to `runs` as it ends."""
    for concurrency in args.concurrency:
        num_prompts = -(-random_prompts(args, concurrency) // args.rounds)
        before = spec_counters()
        run = peers.bench_serve(model, args, concurrency, num_prompts)
        run["spec_decode"] = acceptance(before, spec_counters())  # warm-ups included
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
    command, env = server_command(system, model, args.dtype, args.vllm_preload)
    log_path = Path(tempfile.gettempdir()) / f"spec_decode_{system}.log"
    print(f"{system}: {shlex.join(command)}", flush=True)
    proc, log = peers.start_server(command, env, log_path)
    out = {"command": shlex.join(command), "env": env, "log": str(log_path), "load_average": os.getloadavg()}
    try:
        out["ready_after_s"] = peers.wait_ready(proc, timeout=args.ready_timeout)
        out["repeat"] = run_repeat(prompts, args.max_tokens)
        print(f"  repeat: median TPOT {out['repeat']['median_tpot_ms']:.1f} ms, "
              f"{out['repeat']['output_throughput']:.1f} tok/s, "
              f"{out['repeat']['mean_output_tokens']:.0f} tokens/answer, "
              f"spec {out['repeat']['spec_decode']}", flush=True)  # fmt: skip
        if args.opt_out and system.endswith("-ngram"):
            # The same prompts with the per-request opt-out: should match the base system.
            out["repeat_opted_out"] = run_repeat(prompts, args.max_tokens, {"speculative": False})
        out["random"] = []
        run_random(model, args, out["random"])
    except Exception as error:  # noqa: BLE001 - recorded, and the next system runs
        log.flush()
        out["error"] = f"{type(error).__name__}: {error}"
        out["server_error"], out["log_tail"] = log_error(log_path)
        print(f"  FAILED: {out['error']}\n  server: {out['server_error']}", flush=True)
    finally:
        # Not `ray stop --force` (serving_peers's way): it would end other people's Rays too.
        out.update(peers.stop_server(proc, log, ray_stop=False))
        out["leftover_processes_killed"] = kill_session(proc.pid)
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


def kill_session(session: int) -> int:
    """SIGKILL what is left of the server's session (it was started in a session of its own,
    and Ray's processes stay in it): how many processes were left."""
    killed = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:  # field 6 of stat: the session id
                os.kill(int(stat.parent.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError, IndexError):
            pass
    return killed


def merge_rounds(rounds: list[dict]) -> dict:
    """A system's rounds as one result: the repeat requests in prompt order, and at each
    random concurrency the tokens over the seconds of all its runs (the medians are the
    rounds' means); each round's own figures kept under "rounds"."""
    out = {"command": rounds[0]["command"], "env": rounds[0]["env"], "rounds": rounds}
    failed = [r for r in rounds if "error" in r]
    if failed:
        return {**out, **{k: failed[0][k] for k in ("error", "server_error", "log_tail") if k in failed[0]}}
    for key in ("repeat", "repeat_opted_out"):
        if key in rounds[0]:
            out[key] = _merge_repeats([r[key] for r in rounds])
    out["random"] = []
    for runs in zip(*(r["random"] for r in rounds), strict=True):
        seconds = sum(run["duration"] for run in runs)
        tokens = sum(run["output_throughput"] * run["duration"] for run in runs)
        merged = {"concurrency": runs[0]["concurrency"], "duration": seconds}
        merged["output_throughput"] = tokens / seconds
        for key in ("num_prompts", "completed", "failed"):
            merged[key] = sum(run[key] for run in runs)
        for key in ("median_ttft_ms", "median_tpot_ms", "median_itl_ms"):
            merged[key] = statistics.fmean(run[key] for run in runs)
        merged["spec_decode"] = sum_counters([run["spec_decode"] for run in runs])
        out["random"].append(merged)
    return out


def _merge_repeats(repeats: list[dict]) -> dict:
    requests = sorted((q for rep in repeats for q in rep["requests"]), key=lambda q: q["prompt"])
    seconds = sum(rep["duration_s"] for rep in repeats)
    spec = sum_counters([rep["spec_decode"] for rep in repeats])
    return repeat_summary(requests, repeats[0]["max_tokens"], seconds, spec)


def sum_counters(deltas: list[dict | None]) -> dict | None:
    if any(d is None for d in deltas):
        return None
    keys = {k for d in deltas for k in d if k.startswith("num_")}
    return with_rates({k: sum(d.get(k, 0.0) for d in deltas) for k in keys})


def compare(base: dict, spec: dict) -> dict | None:
    """`spec` against `base`: repeat TPOT speedup, random throughput ratios, same answers."""
    if "error" in base or "error" in spec:
        return None
    out = {
        "repeat_median_tpot_speedup": base["repeat"]["median_tpot_ms"] / spec["repeat"]["median_tpot_ms"],
        "repeat_output_throughput_ratio": spec["repeat"]["output_throughput"]
        / base["repeat"]["output_throughput"],
        "repeat_same_answers": sum(
            a["text_sha1"] == b["text_sha1"]
            for a, b in zip(base["repeat"]["requests"], spec["repeat"]["requests"], strict=True)
        ),
        "repeat_num_prompts": len(base["repeat"]["requests"]),
    }
    if "repeat_opted_out" in spec:  # "speculative": false should cost nothing
        opted = spec["repeat_opted_out"]
        out["repeat_opted_out_median_tpot_over_base"] = (
            opted["median_tpot_ms"] / base["repeat"]["median_tpot_ms"]
        )
        out["repeat_opted_out_same_answers"] = sum(
            a["text_sha1"] == b["text_sha1"]
            for a, b in zip(base["repeat"]["requests"], opted["requests"], strict=True)
        )
    for a, b in zip(base["random"], spec["random"], strict=True):
        c = a["concurrency"]
        out[f"random_c{c}_output_throughput_ratio"] = b["output_throughput"] / a["output_throughput"]
        out[f"random_c{c}_median_tpot_ratio"] = b["median_tpot_ms"] / a["median_tpot_ms"]
    return out


def summarize(systems: dict) -> dict:
    summary = {}
    for name in ("kvserve", "vllm"):
        if name in systems and f"{name}-ngram" in systems:
            summary[f"{name}_ngram_over_{name}"] = compare(systems[name], systems[f"{name}-ngram"])
    kv = summary.get("kvserve_ngram_over_kvserve")
    if kv:
        summary["bars"] = {
            "repeat_median_tpot_speedup": {
                "bar": REPEAT_TPOT_SPEEDUP_BAR,
                "value": kv["repeat_median_tpot_speedup"],
                "pass": kv["repeat_median_tpot_speedup"] >= REPEAT_TPOT_SPEEDUP_BAR,
            },
            **{
                key: {
                    "bar": RANDOM_THROUGHPUT_RATIO_BAR,
                    "value": kv[key],
                    "pass": kv[key] >= RANDOM_THROUGHPUT_RATIO_BAR,
                }
                for key in kv
                if key.startswith("random_") and key.endswith("_output_throughput_ratio")
            },
        }
    # Absolute figures side by side: median TPOT (ms) and output tok/s per workload.
    table = {}
    for name, result in systems.items():
        if "error" in result:
            table[name] = {"error": result.get("server_error") or result["error"]}
            continue
        row = {"repeat_median_tpot_ms": result["repeat"]["median_tpot_ms"],
               "repeat_output_throughput": result["repeat"]["output_throughput"],
               "repeat_mean_output_tokens": result["repeat"]["mean_output_tokens"]}  # fmt: skip
        row["repeat_empty_answers"] = result["repeat"]["empty_answers"]
        row["repeat_mean_items_echoed"] = result["repeat"]["mean_items_echoed"]
        spec = result["repeat"]["spec_decode"]
        if spec:
            row["repeat_acceptance_rate"] = spec["acceptance_rate"]
            row["repeat_mean_acceptance_length"] = spec["mean_acceptance_length"]
        for run in result["random"]:
            row[f"random_c{run['concurrency']}_output_throughput"] = run["output_throughput"]
            row[f"random_c{run['concurrency']}_median_tpot_ms"] = run["median_tpot_ms"]
        table[name] = row
    summary["table"] = table
    # kvserve next to vLLM: the speedups from speculation, and the absolute repeat TPOTs.
    vl = summary.get("vllm_ngram_over_vllm")
    if kv and vl:
        tpot = {name: table[name]["repeat_median_tpot_ms"] for name in SYSTEMS}
        summary["kvserve_vs_vllm"] = {
            "repeat_median_tpot_ms": tpot,
            "repeat_median_tpot_speedup": {
                "kvserve": kv["repeat_median_tpot_speedup"],
                "vllm": vl["repeat_median_tpot_speedup"],
            },
            "kvserve_ngram_tpot_over_vllm_ngram_tpot": tpot["kvserve-ngram"] / tpot["vllm-ngram"],
        }
    return summary


def main() -> None:
    global PORT
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
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/spec_decode_cpu.json")
    parser.add_argument("--rounds", type=int, default=2, help="the systems in turns, ABBA")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeat_prompts, args.max_tokens = 3, 96
        args.num_prompts, args.output_len, args.rounds = 8, 16, 1
    if args.out is None:
        args.out = RESULTS / ("spec_decode_cpu_quick.json" if args.quick else "spec_decode_cpu.json")
    if any(s.startswith("vllm") for s in args.systems) and not (peers.VLLM_VENV / "bin/vllm").exists():
        sys.exit("the vLLM peer is missing: run bash bench/setup_vllm.sh first")
    # serving_peers's helpers (server_command, wait_ready, bench_serve) read its PORT.
    PORT = peers.PORT = args.port
    model = resolve_model(None)
    prompts = repeat_prompts(model, args.repeat_prompts, args.seed)
    result = {
        "benchmark": "spec_decode",
        # The load average before the run: the figures are only worth something on a quiet machine.
        "machine": machine(platform=platform.platform(), load_average=os.getloadavg()),
        "dtype": args.dtype,
        "model": BUNDLED_NAME,
        "speculative_config": SPECULATIVE,
        "quick": args.quick,
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
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))  # after each round, in case of a crash
    print(json.dumps({k: result[k] for k in result if k not in ("machine", "systems")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
