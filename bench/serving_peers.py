"""`kvserve serve` against `vllm serve`, both measured by vLLM's own load generator
(`vllm bench serve`), one after the other in one run on the same machine: the same
model (the bundled SmolLM2, bf16 unless --dtype says otherwise), the same random
prompts, at several concurrencies.

Each server is started as a user starts it, waited for (/health), probed with one
request and then ten (first-request latency against the tenth), loaded at every
concurrency, and stopped with SIGTERM (time to exit). vLLM's CPU build lives in its own
venv (bench/setup_vllm.sh), which also provides the `vllm bench serve` client; the
servers and the client share this machine's cores, so the client's own CPU time is
reported next to each figure. Every figure comes from a single run.

    python bench/serving_peers.py            # bench/results/serving_peers_cpu.{json,png}
    python bench/serving_peers.py --quick    # smoke run: concurrency 2, 8 prompts
"""

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.machine import machine  # noqa: E402
from bench.peers import vllm_model  # noqa: E402
from replica.model_loader import BUNDLED_NAME, resolve_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VLLM_VENV = ROOT / ".venv-vllm"
PORT = 18600
# vLLM's CPU backend reserves 92% of the machine's memory for its KV cache by default and
# refuses to start when less is free (it was, here, with 16 GiB reported for the node);
# 2 GiB is far more than this load needs. kvserve's default is 1 GiB.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def server_command(system: str, model: Path, dtype: str) -> tuple[list[str], dict]:
    if system == "kvserve":
        command = [str(ROOT / ".venv/bin/kvserve"), "serve", "--dtype", dtype, "--port", str(PORT)]
        return command + ["--grpc-port", str(PORT + 1)], {}
    # vLLM gets its loadable copy of the model (bench/peers.py's vllm_model).
    command = [str(VLLM_VENV / "bin/vllm"), "serve", str(vllm_model(model))]
    command += ["--served-model-name", BUNDLED_NAME]
    return command + ["--dtype", dtype, "--port", str(PORT)], VLLM_ENV


def wait_ready(proc: subprocess.Popen, timeout: float = 600) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def first_and_tenth(requests: int = 10) -> dict:
    """Seconds for the first request after start-up, and for the tenth, sent one by one."""
    body = {"model": BUNDLED_NAME, "prompt": "Hello there, my friend", "max_tokens": 16, "temperature": 0}
    seconds = []
    for _ in range(requests):
        start = time.perf_counter()
        httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=120).raise_for_status()
        seconds.append(time.perf_counter() - start)
    return {"first_s": seconds[0], "tenth_s": seconds[-1], "first_over_tenth": seconds[0] / seconds[-1]}


def bench_serve(model: Path, args, concurrency: int, num_prompts: int) -> dict:
    """One `vllm bench serve` run: its JSON result plus the client's own CPU seconds."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(VLLM_VENV / "bin/vllm"), "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{PORT}", "--model", BUNDLED_NAME, "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--num-warmups", "4",
            "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", out,
            "--result-filename", "result.json",
        ]  # fmt: skip
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        client = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        # The client's CPU before its main run (imports, tokenizer, warm-ups) is not load.
        cpu_before_main = None
        for line in client.stdout:
            if cpu_before_main is None and line.startswith("Starting main benchmark run"):
                cpu_before_main = process_cpu_s(client.pid)
        if client.wait() != 0:
            raise RuntimeError(f"vllm bench serve failed with exit code {client.returncode}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        raw = json.loads((Path(out) / "result.json").read_text())
    total = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    client_cpu = total - (cpu_before_main or 0.0)
    keys = (
        "duration", "completed", "failed", "output_throughput", "request_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
    )  # fmt: skip
    result = {"concurrency": concurrency, "num_prompts": num_prompts, **{k: raw.get(k) for k in keys}}
    # The client's CPU seconds in its main run, and their share of the machine's cores.
    result["client_cpu_s"] = client_cpu
    result["client_share_of_machine"] = client_cpu / (raw["duration"] * os.cpu_count())
    return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process and of its children it has waited on."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def start_server(command: list[str], env: dict, log_path: Path):
    """The server started as a user starts it, its output to log_path: (process, log file)."""
    log = open(log_path, "w")  # noqa: SIM115
    # A session of its own, so that stopping it reaches every process it started.
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
    )
    return proc, log


def stop_server(proc: subprocess.Popen, log, ray_stop: bool = True) -> dict:
    """SIGTERM, then SIGKILL to its session after 120 s: its exit code and seconds to exit.
    ray_stop: then `ray stop --force`, which ends every Ray on the machine, not only this one's."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
        out = {"exit_code": proc.returncode, "shutdown_s": time.monotonic() - start}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = {"exit_code": None, "shutdown_s": None}
    if ray_stop:
        subprocess.run([str(ROOT / ".venv/bin/ray"), "stop", "--force"], capture_output=True)
    log.close()
    return out


def run_system(system: str, model: Path, args) -> dict:
    command, env = server_command(system, model, args.dtype)
    proc, log = start_server(command, env, Path(tempfile.gettempdir()) / f"serving_peers_{system}.log")
    out = {"command": " ".join(command), "env": env}
    try:
        out["ready_after_s"] = wait_ready(proc)
        out["first_request"] = first_and_tenth()
        out["runs"] = []
        for concurrency in args.concurrency:
            num_prompts = args.num_prompts or min(max(16, 4 * concurrency), 128)
            out["runs"].append(bench_serve(model, args, concurrency, num_prompts))
            print(system, json.dumps(out["runs"][-1]), flush=True)
    finally:
        out.update(stop_server(proc, log))
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, color in (("kvserve", "tab:green"), ("vllm", "tab:gray")):
        runs = result["systems"][system]["runs"]
        x = [r["concurrency"] for r in runs]
        left.plot(x, [r["output_throughput"] for r in runs], marker="o", color=color, label=system)
        right.plot(x, [r["median_tpot_ms"] for r in runs], marker="o", color=color, label=system)
    left.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Throughput (vllm bench serve)")
    right.set(xscale="log", xlabel="concurrency", ylabel="ms", title="Median time per output token")
    for axis in (left, right):
        axis.legend()
    fig.suptitle(f"{result['workload']}; {result['machine']['cores']} cores, one run each", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency, 16 to 128")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=["kvserve", "vllm"], choices=["kvserve", "vllm"])
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_peers_cpu.json")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="both servers'; float32 on CPUs without AVX512-BF16 or AMX, which emulate bf16",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.num_prompts, args.output_len = [2], 8, 16
    if not (VLLM_VENV / "bin/vllm").exists():
        sys.exit("the vLLM peer is missing: run bash bench/setup_vllm.sh first")
    model = resolve_model(None)
    result = {
        "benchmark": "serving_peers",
        "machine": machine(platform=platform.platform()),
        "dtype": args.dtype,
        "workload": f"random {args.input_len} in / {args.output_len} out, --ignore-eos, 4 warm-ups",
        "note": "each figure is from a single run; servers and client share the machine",
        "systems": {system: run_system(system, model, args) for system in args.systems},
    }
    if set(args.systems) == {"kvserve", "vllm"}:
        kv, vl = (result["systems"][s]["runs"] for s in ("kvserve", "vllm"))
        result["kvserve_over_vllm"] = [
            {
                "concurrency": a["concurrency"],
                "output_throughput": a["output_throughput"] / b["output_throughput"],
                "median_tpot": a["median_tpot_ms"] / b["median_tpot_ms"],
                "p99_ttft": a["p99_ttft_ms"] / b["p99_ttft_ms"],
            }
            for a, b in zip(kv, vl, strict=True)
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if not args.quick and "kvserve_over_vllm" in result:
        plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
