"""Hypothesis runs derandomized in CI and randomly locally (tests/hypothesis_profile.py):
this session's profile is the one its environment asks for, and a fresh pytest with
CI=true or CI=false takes the one each names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis._settings import is_in_ci

# Values of CI that mean a local run, as tests/hypothesis_profile.py reads them (spelled
# out: importing that module would load its profile here, whatever conftest.py does).
NOT_CI = ("", "0", "false", "no")

PROBE = """
from hypothesis import settings

def test_probe():
    print("derandomize", settings.default.derandomize, "database", settings.default.database)
"""


def test_this_session_runs_the_profile_its_environment_asks_for():
    if "CI" in os.environ:
        expected = "default" if os.environ["CI"].strip().lower() in NOT_CI else "ci"
    else:  # hypothesis's own detection of other CI services
        expected = "ci" if is_in_ci() else "default"
    assert settings._current_profile == expected
    assert settings.default.derandomize == (expected == "ci")


@pytest.mark.parametrize("ci, derandomized", [("true", True), ("false", False)])
def test_a_fresh_pytest_takes_the_profile_ci_names(tmp_path, ci, derandomized):
    """CI=false too: hypothesis alone would read any value of CI as a CI run."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(Path(__file__).parent)}
    # Without the installed plugins (schemathesis, anyio, ...), which take seconds to import.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "hypothesis_profile", "test_probe.py"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"derandomize {derandomized}" in run.stdout, run.stdout
    assert ("database None" in run.stdout) == derandomized, run.stdout
