"""vLLM's own load generator, `vllm bench serve` from vLLM's venv, against any
OpenAI-compatible server: the client bench.serving_peers and bench.spec_decode measure
`kvserve serve` and `vllm serve` with, so that both are measured by the same client. The
client shares the machine's cores with the server, so its own CPU time is reported with
each run."""

import json
import os
import resource
import subprocess
import tempfile
from pathlib import Path

from bench.peers import VLLM_VENV
from replica.model_loader import BUNDLED_NAME

KEYS = (
    "duration", "completed", "failed", "output_throughput", "request_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip


def bench_serve(
    url: str, tokenizer: Path, input_len: int, output_len: int, concurrency: int, num_prompts: int
) -> dict:
    """One run on random prompts (EOS ignored, 4 warm-ups): vLLM's figures, and the
    client's CPU seconds in its main run with their share of the machine's cores."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(VLLM_VENV / "bin/vllm"), "bench", "serve", "--backend", "openai",
            "--base-url", url, "--model", BUNDLED_NAME, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
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
    result = {"concurrency": concurrency, "num_prompts": num_prompts, **{k: raw.get(k) for k in KEYS}}
    if raw.get("failed"):  # what the failed requests returned, for the record
        result["errors"] = sorted({error for error in raw.get("errors", []) if error})[:3]
    result["client_cpu_s"] = client_cpu
    result["client_share_of_machine"] = client_cpu / (raw["duration"] * os.cpu_count())
    return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process and of its children it has waited on."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
