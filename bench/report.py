"""docs/benchmarks.md from the results: every JSON under bench/results/, one table per
benchmark, each row naming the machine it ran on, and the machines described once. The
page is written from the results alone, so it says what they hold and nothing else;
tests/test_bench_results.py checks that it is up to date.

    python -m bench.report            # writes docs/benchmarks.md
"""

import argparse
import ast
import json
from pathlib import Path

from bench.machine import RESULTS, ROOT, machine_name
from bench.report_figures import figures

PAGE = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmark results

<!-- Written by `python -m bench.report` from bench/results/*.json: edit those, not this page. -->

Every result committed under [`bench/results/`](../bench/results/), one table per
benchmark, each row naming the machine it ran on ([machines](#machines)) and, where the
result records it, the commit. [development.md](development.md#benchmarks) says how to run
them. Absolute numbers drift from run to run and machine to machine: compare systems
within one result.
"""


def benchmark_names() -> list[str]:
    """The benchmark scripts' names, longest first, so that a file is matched to the
    longest name it starts with (spec_decode before spec)."""
    names = [p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_")]
    return sorted(names, key=len, reverse=True)


def benchmark_of(path: Path, names: list[str]) -> str:
    return next((name for name in names if path.stem.startswith(f"{name}_")), path.stem)


def summary(name: str) -> str:
    """The first paragraph of a benchmark's docstring, on one line."""
    source = ROOT / "bench" / f"{name}.py"
    if not source.exists():
        return ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def describe(machine: dict) -> dict[str, str]:
    """A machine's row: older results name the host's fields host_*."""

    def field(key: str):
        return machine.get(key, machine.get(f"host_{key}"))

    flags = field("isa_flags") or machine.get("flags") or []
    return {
        "CPU": field("cpu") or "—",
        "ISA flags": ", ".join(flags),
        "cores": str(field("cores") or machine.get("cpus") or "—"),
        "GPU": machine.get("gpu") or "—",
    }


def commit_of(record: dict) -> str:
    commit = record.get("commit")
    if not commit:
        return "—"
    return commit["sha"][:7] + (" (with changes)" if commit.get("uncommitted_changes") else "")


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def render(results: Path = RESULTS) -> str:
    names = benchmark_names()
    by_benchmark: dict[str, list[tuple[Path, dict]]] = {}
    machines: dict[str, tuple[bool, dict[str, str]]] = {}  # name -> (from ISA flags?, its row)
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        by_benchmark.setdefault(benchmark_of(path, names), []).append((path, record))
        # Described by a result that records the ISA flags the kernels check, where one does.
        name, machine = machine_name(record["machine"]), record["machine"]
        flagged = bool(machine.get("isa_flags") or machine.get("host_isa_flags"))
        if name not in machines or (flagged and not machines[name][0]):
            machines[name] = (flagged, describe(machine))
    out = [HEADER, "## Machines", ""]
    columns = ["machine", "CPU", "ISA flags", "cores", "GPU"]
    out += table(columns, [[name, *row.values()] for name, (_, row) in sorted(machines.items())])
    for benchmark, entries in sorted(by_benchmark.items()):
        out += ["", f"## {benchmark}", "", f"`python -m bench.{benchmark}`: {summary(benchmark)}", ""]
        rows = [(path, record, figures(benchmark, record)) for path, record in entries]
        extra = list(dict.fromkeys(key for *_, cells in rows for key in cells))
        body = []
        for path, record, cells in rows:
            link = f"[{path.name}](../bench/results/{path.name})"
            if path.with_suffix(".png").exists():
                link += f" ([figure](../bench/results/{path.with_suffix('.png').name}))"
            threads = record["machine"].get("threads")
            machine = machine_name(record["machine"]) + (
                f", {threads} thread{'s' * (threads != 1)}" if threads else ""
            )
            body.append([link, machine, commit_of(record), *(cells.get(key, "") for key in extra)])
        out += table(["result", "machine", "commit", *extra], body)
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args()
    args.out.write_text(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
