"""The suite's time and memory, watched while it runs (a plugin conftest.py loads).

CI gives a stop 90 minutes on 2 cores, and the suite used to grow by minutes with each
feature until it neared that. The guards act while the run goes on:
- one test (its setup, call and teardown, a module fixture's start-up included) is
  stopped at pytest-timeout's --timeout, which `make test` passes, and named;
- past --max-suite-minutes no further test starts: the run ends there and says so;
- past --max-memory-gb of the machine in use (sampled every second) the run fails and
  names the test it peaked in: Ray's memory monitor kills actors past about 95% of the
  machine, so the suite keeps under half of it.
Every run prints the peak memory of the pytest process and of the machine.
--suite-profile PATH writes every test's seconds and memory as JSON, and each fixture's
set-up, the data behind tests/README.md's tables."""

import json
import threading
import time
from dataclasses import asdict, dataclass

import psutil
import pytest

GB = 1 << 30


@dataclass
class TestCost:
    nodeid: str
    seconds: float = 0.0  # setup + call + teardown
    setup_s: float = 0.0
    rss_gb: float = 0.0  # the pytest process after its teardown
    machine_used_gb: float = 0.0  # the whole machine's peak while it ran


@dataclass
class FixtureCost:
    """One fixture set-up (its own, not the fixtures it asks for, which pytest sets up
    first), in the test that first needed it."""

    name: str
    scope: str
    nodeid: str
    seconds: float


class Budget:
    def __init__(self, config: pytest.Config):
        self.max_suite_min: float | None = config.getoption("max_suite_minutes")
        self.max_memory_gb: float | None = config.getoption("max_memory_gb")
        self.profile_path: str | None = config.getoption("suite_profile")
        self.started = time.monotonic()
        self.costs: dict[str, TestCost] = {}
        self.fixtures: list[FixtureCost] = []
        self.current: TestCost | None = None
        self.process = psutil.Process()
        self.peak_rss_gb = 0.0
        self.peak_used_gb = 0.0
        self.peak_used_during = ""
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name="suite-budget").start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            used = machine_used_gb()
            self.peak_rss_gb = max(self.peak_rss_gb, self.process.memory_info().rss / GB)
            current = self.current
            if current is not None:
                current.machine_used_gb = max(current.machine_used_gb, used)
            if used > self.peak_used_gb:
                self.peak_used_gb, self.peak_used_during = (
                    used,
                    current.nodeid if current else "between tests",
                )

    def start(self, nodeid: str) -> None:
        self.current = self.costs.setdefault(nodeid, TestCost(nodeid))

    def record(self, report: pytest.TestReport) -> None:
        cost = self.costs.setdefault(report.nodeid, TestCost(report.nodeid))
        cost.seconds += report.duration
        if report.when == "setup":
            cost.setup_s = report.duration
        if report.when == "teardown":
            cost.rss_gb = self.process.memory_info().rss / GB
            self.current = None

    def problems(self) -> list[str]:
        found = []
        if self.out_of_time():
            found.append(
                f"the run took {self.elapsed_min():.1f} min, over --max-suite-minutes={self.max_suite_min:g}"
            )
        if self.max_memory_gb is not None and self.peak_used_gb > self.max_memory_gb:
            found.append(
                f"the machine had {self.peak_used_gb:.1f} GB in use during {self.peak_used_during}, "
                f"over --max-memory-gb={self.max_memory_gb:g}"
            )
        return found

    def elapsed_min(self) -> float:
        return (time.monotonic() - self.started) / 60

    def out_of_time(self) -> bool:
        return self.max_suite_min is not None and self.elapsed_min() > self.max_suite_min

    def summary(self) -> list[str]:
        total = psutil.virtual_memory().total / GB
        return [
            f"{len(self.costs)} tests in {self.elapsed_min():.1f} min",
            f"peak RSS of the pytest process: {self.peak_rss_gb:.1f} GB",
            f"peak memory in use on the machine: {self.peak_used_gb:.1f} of {total:.1f} GB "
            f"(during {self.peak_used_during})",
        ]

    def finish(self) -> None:
        self._stop.set()
        if self.profile_path:
            profile = {
                "tests": [asdict(c) for c in self.costs.values()],
                "fixtures": [asdict(f) for f in self.fixtures if f.seconds >= 0.05],
            }
            with open(self.profile_path, "w") as f:
                json.dump(profile, f, indent=0)


def machine_used_gb() -> float:
    memory = psutil.virtual_memory()
    return (memory.total - memory.available) / GB


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("suite budget")
    group.addoption(
        "--max-suite-minutes", type=float, default=None, help="start no test past this; the run fails"
    )
    group.addoption(
        "--max-memory-gb", type=float, default=None, help="fail the run if the machine's use passes this"
    )
    group.addoption("--suite-profile", default=None, help="write each test's seconds and memory here (JSON)")


_budget: Budget | None = None  # one per pytest run


def pytest_configure(config: pytest.Config) -> None:
    global _budget
    _budget = Budget(config)


def pytest_runtest_logstart(nodeid, location) -> None:
    _budget.start(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _budget.out_of_time():
        pytest.exit(
            f"over --max-suite-minutes={_budget.max_suite_min:g}: {item.nodeid} and the tests after it "
            "did not run",
            returncode=pytest.ExitCode.TESTS_FAILED,
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _budget.record(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    nodeid = _budget.current.nodeid if _budget.current else request.node.nodeid
    _budget.fixtures.append(FixtureCost(fixturedef.argname, fixturedef.scope, nodeid, seconds))


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    _budget.finish()
    if _budget.problems() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    terminalreporter.section("suite budget")
    for line in _budget.summary():
        terminalreporter.write_line(line)
    for problem in _budget.problems():
        terminalreporter.write_line(f"OVER BUDGET: {problem}", red=True)
