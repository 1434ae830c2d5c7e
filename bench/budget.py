"""The bookkeeping of a run on a short GPU lease (bench.gpu, bench.quantized_gemm): the
run's time budget, and the result that says of every part whether it ran, was cut short,
skipped or failed."""

import argparse
import time
import traceback
from pathlib import Path

from bench.machine import write_result

STARTED = time.perf_counter()
BUDGET_SPENT = "not started: the run's budget was spent"


class Budget:
    """The run's wall-clock budget: a part gets the lesser of its own limit and what is left."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, part_s: float) -> float:
        return min(part_s, self.left())


def say(message: str) -> None:
    """Progress, stamped with the seconds since start: the budgets are tuned from these."""
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {message}", flush=True)


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def failed(error: Exception) -> dict:
    traceback.print_exception(error)
    return {"status": "failed", "error": f"{type(error).__name__}: {error}"}


class Report:
    """The result being built, written again after every part so that a run killed from
    outside still leaves what it measured."""

    def __init__(self, path: Path, benchmark: str, args: argparse.Namespace, machine: dict):
        self.path, self.benchmark, self.args, self.machine = path, benchmark, args, machine
        self.result: dict = {}

    def write(self) -> None:
        write_result(self.benchmark, self.args, self.result, self.machine, self.path)

    def section(self, key: str, part) -> object | None:
        """Run one part; a failure is recorded as its section and the run goes on."""
        try:
            return part()
        except Exception as e:
            self.result[key] = failed(e)
            return None
        finally:
            self.write()

    def parts(self) -> list[tuple[str, dict]]:
        """Every section and every system's run on every cap, by name."""
        out = [
            (key, value)
            for key, value in self.result.items()
            if isinstance(value, dict) and "status" in value
        ]
        for system, caps in self.result.get("throughput", {}).items():
            out += [(f"{system} cap {cap}", run) for cap, run in caps.items()]
        return out

    def failures(self) -> list[str]:
        return [name for name, part in self.parts() if part["status"] == "failed"]

    def cut_short(self) -> list[str]:
        """Parts a limit cut, or that the budget kept from starting."""
        return [
            name
            for name, part in self.parts()
            if part["status"] == "partial" or part.get("reason", "").startswith(BUDGET_SPENT)
        ]


def budget_spent(budget_s: float) -> dict:
    return skipped(f"{BUDGET_SPENT} ({budget_s:.0f} s)")
