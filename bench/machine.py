"""What a benchmark result records of the machine it ran on."""

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model string, from /proc/cpuinfo where there is one."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
