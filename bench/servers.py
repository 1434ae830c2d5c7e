"""Servers started as a user starts them, for the benchmarks that load a server from
outside: `kvserve serve`, `vllm serve` (vLLM's CPU build in its own venv) and llama.cpp's
`llama-server`. Each runs in a session of its own, so that stopping it reaches every
process it started (Ray's too), and nothing else on the machine."""

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from bench.machine import ROOT
from bench.peers import VLLM_VENV, vllm_model
from replica.model_loader import BUNDLED_NAME

# vLLM's CPU backend reserves 92% of the machine's memory for its KV cache by default and
# refuses to start when less is free; 2 GiB is far more than these loads need (kvserve's
# default is 1 GiB).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvserve_command(port: int, dtype: str, grpc_port: int | None = None) -> list[str]:
    """`kvserve serve` on the bundled model, HTTP on `port` and gRPC on the next one."""
    command = [str(ROOT / ".venv/bin/kvserve"), "serve", "--dtype", dtype, "--port", str(port)]
    return command + ["--grpc-port", str(grpc_port or port + 1)]


def llama_server_command(binary: Path, gguf: Path, port: int, slots: int, context: int) -> list[str]:
    """llama.cpp's `llama-server` on a GGUF file as it is, under the bundled model's name:
    `slots` sequences at once sharing `context` tokens, a thread per core. On CPUs with AMX
    its weight repacking hangs at start-up for quantized files, so it is off there."""
    command = [str(binary), "-m", str(gguf), "--port", str(port), "--alias", BUNDLED_NAME]
    command += ["--parallel", str(slots), "--ctx-size", str(context), "--threads", str(os.cpu_count())]
    if "amx_tile" in Path("/proc/cpuinfo").read_text():
        command.append("--no-repack")
    return command


def vllm_command(model: Path, port: int, dtype: str) -> list[str]:
    """`vllm serve` on its loadable copy of the bundled model (bench/peers.py's vllm_model),
    under the bundled model's name."""
    command = [str(VLLM_VENV / "bin/vllm"), "serve", str(vllm_model(model))]
    return command + ["--served-model-name", BUNDLED_NAME, "--dtype", dtype, "--port", str(port)]


@dataclass
class Server:
    """A server process, its port and its log."""

    command: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    process: subprocess.Popen | None = None
    log: IO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(
            self.command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Seconds until /health answered 200; raises if the server exits or times out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} before it was ready")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not become ready in {timeout_s:.0f} s")

    def stop(self, how: signal.Signals = signal.SIGTERM, timeout_s: float = 120) -> dict:
        """`how` (SIGINT is Ctrl-C), then SIGKILL to what is left of its session: its exit
        code (None if it had to be killed), seconds to exit, and the processes left over."""
        start = time.monotonic()
        out = {"exit_code": None, "shutdown_s": None}
        if self.process.poll() is None:
            self.process.send_signal(how)
        try:
            self.process.wait(timeout=timeout_s)
            out = {"exit_code": self.process.returncode, "shutdown_s": time.monotonic() - start}
        except subprocess.TimeoutExpired:
            pass
        out["leftover_processes_killed"] = kill_session(self.process.pid)
        self.log.close()
        return out


def kill_session(session: int) -> int:
    """SIGKILL every process of a session: how many there were."""
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
