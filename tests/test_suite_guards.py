"""The guards `make test` runs the suite under act while it runs (tests/suite_budget.py):
a hung test is stopped at its time limit and named, and the run goes on; past the suite's
limit no further test starts; a machine over the memory ceiling fails the run and names
the test. Each is shown on a planted test file, run by pytest in a subprocess with the
options the Makefile's test command passes, its limits shrunk to fit a unit test."""

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run_checks

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HANG = """
def test_hangs():
    time.sleep(600)
"""
STEADY = """
def test_steady():
    time.sleep(1.5)
"""


def make_test_options() -> dict[str, str]:
    """The --name=value options of the Makefile's pytest command (`make test`)."""
    (line,) = [line for line in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in line]
    return dict(
        re.fullmatch(r"--([\w-]+)=(\S+)", word).groups()
        for word in shlex.split(line)
        if word.startswith("--") and "=" in word
    )


def run_planted(tmp_path: Path, *tests: str, **limits: str) -> tuple[subprocess.CompletedProcess, float]:
    """pytest on a file of `tests` with `make test`'s options, `limits` replacing some."""
    (tmp_path / "test_planted.py").write_text("import time\n" + "".join(tests))
    options = {**make_test_options(), **limits}
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "pytest_timeout",
            "-p",
            "suite_budget",
            "-p",
            "no:cacheprovider",
        ]
        + [f"--{name}={value}" for name, value in options.items()]
        + [str(tmp_path / "test_planted.py")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        # The installed plugins (hypothesis, schemathesis, ...) stay out: seconds to import.
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        timeout=120,
    )
    return result, time.monotonic() - started


def test_make_test_sets_every_limit():
    options = make_test_options()
    assert {"timeout", "max-suite-minutes", "max-memory-gb"} <= options.keys(), options
    assert float(options["timeout"]) <= 120 and float(options["max-suite-minutes"]) <= 35


def test_a_hung_test_is_stopped_and_named_and_the_run_goes_on(tmp_path):
    result, seconds = run_planted(tmp_path, HANG, STEADY, timeout="3")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert re.search(r"FAILED .*test_planted.py::test_hangs - Failed: Timeout", output), output
    assert "1 failed, 1 passed" in output, output
    assert seconds < 60, f"the planted hang ran {seconds:.0f} s"


def test_past_the_suite_limit_no_test_starts(tmp_path):
    result, _ = run_planted(tmp_path, HANG, STEADY, timeout="2", **{"max-suite-minutes": "0.01"})
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "test_planted.py::test_steady and the tests after it did not run" in output, output
    assert "= 1 failed in" in output, output


def test_a_machine_over_the_memory_ceiling_fails_the_run(tmp_path):
    """A ceiling below what any machine uses: the sampler, once a second, catches the
    1.5 s test, which passes; the run does not."""
    result, _ = run_planted(tmp_path, STEADY, **{"max-memory-gb": "0.001"})
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED and "1 passed" in output, output
    assert re.search(r"OVER BUDGET: the machine had [\d.]+ GB in use during .*test_planted.py::", output), (
        output
    )


SKIPS = """
import pytest
import run_checks

@pytest.mark.parametrize("i", range(3))
def test_needs_a_gpu(i):
    pytest.skip("needs a CUDA GPU")

def test_runs():
    pass
"""


def run_with_checks(tmp_path: Path, source: str, path: str) -> subprocess.CompletedProcess:
    """pytest with tests/run_checks.py on `source`, under PATH=`path`."""
    (tmp_path / "test_planted.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "run_checks", "-p", "no:cacheprovider", "test_planted.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{TESTS}:{ROOT}", "PATH": path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        timeout=120,
    )


def test_skips_are_listed_by_reason_with_the_machine(tmp_path):
    result = run_with_checks(tmp_path, SKIPS, "/usr/bin:/bin")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.OK, output
    summary = output.split("skipped on this machine")[1]
    assert re.search(r"^\s+3  needs a CUDA GPU$", summary, re.M), summary
    assert run_checks.machine_line() in summary, summary


def test_a_run_without_a_c_compiler_stops_before_any_test(tmp_path):
    result = run_with_checks(tmp_path, SKIPS, "/nonexistent")
    output = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, output
    assert "the test run needs a C compiler" in output and "passed" not in output, output


def test_every_hard_dependency_is_checked():
    names = run_checks.required_distributions()
    assert {"torch", "ray", "gguf", "transformers", "openai", "pytest-timeout", "triton"} <= set(names), names
    assert "flash-attn" not in names  # an optional extra: its backend runs where installed
    assert run_checks.missing_distributions([*names, "kvserve-no-such-package"]) == [
        "kvserve-no-such-package"
    ]
