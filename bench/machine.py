"""What every benchmark result records, and the one place results are written.

A result is bench/results/<benchmark>_<machine>.json. Inside it: the benchmark's name,
the machine (the fingerprint CPU kernel timings are keyed by, replica.cpu.machine: CPU
model, ISA flags, cores, threads, torch and oneDNN; plus the GPU where one ran), the
commit, and the script's arguments, so that results from different machines and commits
are told apart and compared like with like."""

import argparse
import json
import platform
import re
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from replica.cpu.machine import fingerprint

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def machine(threads: int | None = None, device: str = "cpu", **extra) -> dict:
    """This machine at `threads` torch threads (torch's own count if None); with
    device="cuda", the GPU too; then `extra` (a Ray version, the load average)."""
    record = fingerprint(threads)
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        record.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
    return {**record, **extra}


def software_versions() -> dict:
    """The libraries a GPU run depends on, None where one is missing (the GPU image lacks
    some of kvserve's optional ones)."""
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    out["transformers"] = transformers.__version__
    for name in ("triton", "flash_attn", "llguidance"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def machine_name(record: dict) -> str:
    """A short name for the machine a record describes, for file names: the GPU's model
    (nvidia_h200), or cpu_ and the CPU's family as far as the kernels care. AMD's EPYCs
    gain AVX-512 with Zen 4; Intel's Xeons differ by AMX. Older records name the host's
    fields host_cpu and host_isa_flags, or the flags `flags`."""
    if record.get("gpu"):
        return slug(record["gpu"])
    cpu = record.get("cpu") or record.get("host_cpu") or "unknown"
    flags = set(record.get("isa_flags") or record.get("host_isa_flags") or record.get("flags") or ())
    if "EPYC" in cpu:
        family = "epyc_zen4" if "avx512f" in flags else "epyc_zen3"
    elif "Xeon" in cpu:
        family = "xeon_amx" if "amx_tile" in flags else "xeon_no_amx"
    else:
        family = slug(cpu)
    return f"cpu_{family}"


@cache
def commit() -> dict | None:
    """HEAD and whether tracked files differ from it; None outside a git checkout (a GPU
    machine gets the working tree without its history)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {
            "sha": git("rev-parse", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "-uno")),
        }
    except (OSError, subprocess.CalledProcessError):
        return None


def result_path(
    benchmark: str, machine_record: dict, smoke: bool = False, directory: Path | None = None
) -> Path:
    """<directory>/<benchmark>_<machine>.json. A smoke run's is named so and goes to the
    temporary directory unless a directory is given, so that it never replaces a result."""
    name = f"{benchmark}_{'smoke_' if smoke else ''}{machine_name(machine_record)}.json"
    return (directory or (Path(tempfile.gettempdir()) if smoke else RESULTS)) / name


def write_result(
    benchmark: str,
    args: argparse.Namespace,
    fields: dict,
    machine_record: dict | None = None,
    path: Path | None = None,
    smoke: bool = False,
) -> Path:
    """Writes the benchmark's result: its name, the machine (this one at torch's thread
    count unless given), the commit and the arguments, then `fields`. `path` defaults to
    result_path's. Returns the path written."""
    record = {
        "benchmark": benchmark,
        "machine": machine_record if machine_record is not None else machine(),
        "commit": commit(),
        "args": vars(args),
        **fields,
    }
    path = path or result_path(benchmark, record["machine"], smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path
