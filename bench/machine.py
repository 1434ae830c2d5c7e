"""What every benchmark result records of the machine it ran on, under "machine": the same
fingerprint the CPU kernel timings are keyed by (replica.cpu.machine: CPU model, ISA flags,
cores, threads, torch, oneDNN), so results from different machines can be told apart and
compared like with like, plus whatever a benchmark adds (a Ray version, the load average).
bench/gpu.py keeps its own GPU record and adds this one's fields for its host."""

import json
from pathlib import Path

from replica.cpu.machine import fingerprint


def machine(threads: int | None = None, **extra) -> dict:
    """The machine fingerprint at `threads` (torch's thread count if None), and `extra`."""
    return {**fingerprint(threads), **extra}


def write_result(path: Path, benchmark: str, args, **fields) -> None:
    """A CPU benchmark's JSON: its name, the machine at args.threads, its arguments, then
    `fields`."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"benchmark": benchmark, "machine": machine(threads=args.threads), "config": config, **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
