"""Every committed benchmark result names the machine it ran on, and its file is named by
that machine (bench/machine.py's machine_name), so that results from different machines
are never read as one another's."""

import json
from pathlib import Path

import pytest

from bench.machine import machine_name

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PATHS = sorted(RESULTS.glob("*.json"))


def test_results_hold_only_results_and_their_figures():
    assert PATHS
    others = sorted(p.name for p in RESULTS.iterdir() if p.suffix not in (".json", ".png"))
    assert not others, f"logs and test reports stay out of bench/results: {others}"
    orphans = sorted(p.name for p in RESULTS.glob("*.png") if not p.with_suffix(".json").exists())
    assert not orphans, f"figures without their result: {orphans}"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_result_names_its_machine(path):
    record = json.loads(path.read_text())
    machine = record.get("machine") or {}
    assert machine.get("gpu") or machine.get("cpu") or machine.get("host_cpu"), (
        f"{path.name} records no CPU model or GPU"
    )
    assert f"_{machine_name(machine)}" in path.stem, (path.name, machine_name(machine))


def test_benchmarks_page_is_written_from_the_results():
    """docs/benchmarks.md is `python -m bench.report`'s page of these results."""
    from bench.report import PAGE, render

    assert PAGE.read_text() == render(), "docs/benchmarks.md is stale: run `python -m bench.report`"
