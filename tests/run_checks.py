"""What a run needs before it starts, and what it could not test on this machine.

Tests skip where a CPU lacks an instruction (AVX512-BF16, AMX) or there is no GPU: those
skips belong to the machine, and the summary at the end of every run lists them by
reason, with the machine named, so a reader sees what this run did not cover. A missing
C compiler or a missing dependency of pyproject.toml's (the project's own and the dev
extra's) is not a property of a machine but a broken install: the run stops at once and
says what is missing, rather than passing with the tests that needed it skipped.

The GPU device kit (scripts/device_check.sh) runs a few test files in an image without
Ray or gguf, and sets KVSERVE_DEVICE_KIT=1: there the check is off."""

import importlib.metadata
import os
import tomllib
from collections import Counter
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
REQUIRED_EXTRAS = ("dev",)  # the test dependencies; "triton" and "flash" are optional


def required_distributions(pyproject: Path = PYPROJECT) -> list[str]:
    """The distributions pyproject.toml makes hard dependencies of a test run."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in REQUIRED_EXTRAS:
        lines += project["optional-dependencies"][extra]
    requirements = [Requirement(line) for line in lines]
    return [r.name for r in requirements if r.marker is None or r.marker.evaluate()]


def missing_distributions(names: list[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def missing_requirements() -> list[str]:
    """What a full test run needs and this environment lacks, each said in words."""
    from replica.cpu import build

    found = [f"the package {name}" for name in missing_distributions(required_distributions())]
    if build.compiler() is None:
        found.append("a C compiler (gcc or cc, or $CC): the CPU kernels are compiled on the machine")
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("KVSERVE_DEVICE_KIT") == "1":
        return
    missing = missing_requirements()
    if missing:
        pytest.exit(
            "the test run needs " + "; ".join(missing) + " (make setup installs the packages)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def skip_reasons(reports) -> Counter:
    """Skipped tests counted by their reason."""
    reasons = Counter()
    for report in reports:
        _, _, reason = (
            report.longrepr if isinstance(report.longrepr, tuple) else ("", 0, str(report.longrepr))
        )
        reasons[reason.removeprefix("Skipped: ")] += 1
    return reasons


def machine_line() -> str:
    import torch

    from replica.cpu.machine import cpu_model, isa_flags

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu_model()} ({', '.join(isa_flags()) or 'none of the ISA flags kvserve looks for'}), {gpu}"


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    terminalreporter.section("skipped on this machine")
    terminalreporter.write_line(machine_line())
    if not skipped:
        terminalreporter.write_line("nothing skipped")
    for reason, count in sorted(skip_reasons(skipped).items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.write_line(f"{count:4d}  {reason}")
