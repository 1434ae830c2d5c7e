"""What identifies a CPU machine for kernel timings and benchmark results: the CPU model,
the ISA flags that decide which kernels can run and how fast, the threads used, and the
torch and oneDNN versions that supply the library kernels."""

import os
import platform
import re
from functools import cache
from pathlib import Path

import torch

# The flags that change which GEMM and attention kernels win: AMX tiles, AVX512's BF16
# and VNNI dot products, plain AVX512 and AVX2, and F16C (an fp8 KV cache's widening).
ISA_FLAGS = (
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx512f",
    "avx2",
    "f16c",
)


@cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags (every core lists the same)."""
    cpuinfo = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, frozenset(fields.get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model string, from /proc/cpuinfo where there is one."""
    return _cpuinfo()[0]


def isa_flags() -> list[str]:
    """Which of ISA_FLAGS this CPU has."""
    flags = _cpuinfo()[1]
    return [f for f in ISA_FLAGS if f in flags]


def onednn_version() -> str | None:
    found = re.search(r"(?:oneDNN|MKL-DNN) v([\w.]+)", torch.__config__.show())
    return found.group(1) if found else None


def fingerprint(threads: int | None = None) -> dict:
    """The machine as kernel timings and benchmark results record it."""
    return {
        "cpu": cpu_model(),
        "isa_flags": isa_flags(),
        "cores": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "onednn": onednn_version(),
    }
