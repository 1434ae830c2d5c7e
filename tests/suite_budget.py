"""The suite's time and memory, watched while it runs (a plugin conftest.py loads).

CI gives a stop 90 minutes on 2 cores, and the suite used to grow by minutes with each
feature until it neared that. So `make test` passes --max-test-seconds and
--max-suite-minutes: a run fails when one test (its setup, call and teardown, a module
fixture's start-up included) or the whole run takes longer, and says which. It also
prints the peak memory of the pytest process and of the machine (sampled every second):
Ray's memory monitor kills actors past about 95% of the machine, so the suite keeps
under half of it. --suite-profile PATH writes every test's seconds and memory as JSON,
and each fixture's set-up, the data behind tests/README.md's tables."""

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
        self.max_test_s: float | None = config.getoption("max_test_seconds")
        self.max_suite_min: float | None = config.getoption("max_suite_minutes")
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
        if self.max_test_s is not None:
            found += [
                f"{c.nodeid} took {c.seconds:.0f} s (setup {c.setup_s:.0f} s), "
                f"over --max-test-seconds={self.max_test_s:g}"
                for c in sorted(self.costs.values(), key=lambda c: -c.seconds)
                if c.seconds > self.max_test_s
            ]
        elapsed_min = (time.monotonic() - self.started) / 60
        if self.max_suite_min is not None and elapsed_min > self.max_suite_min:
            found.append(
                f"the run took {elapsed_min:.1f} min, over --max-suite-minutes={self.max_suite_min:g}"
            )
        return found

    def summary(self) -> list[str]:
        total = psutil.virtual_memory().total / GB
        return [
            f"{len(self.costs)} tests in {(time.monotonic() - self.started) / 60:.1f} min",
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
    group.addoption("--max-test-seconds", type=float, default=None, help="fail the run past this per test")
    group.addoption("--max-suite-minutes", type=float, default=None, help="fail the run past this in all")
    group.addoption("--suite-profile", default=None, help="write each test's seconds and memory here (JSON)")


_budget: Budget | None = None  # one per pytest run


def pytest_configure(config: pytest.Config) -> None:
    global _budget
    _budget = Budget(config)


def pytest_runtest_logstart(nodeid, location) -> None:
    _budget.start(nodeid)


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
