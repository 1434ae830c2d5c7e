"""Hypothesis's settings for the suite (a plugin conftest.py loads): derandomized in CI,
random locally.

CI (.ci/run exports CI=true) runs hypothesis's own "ci" profile: derandomize=True, so
each test's examples come from a seed of the test's own and every run of a commit tries
the same ones; database=None; print_blob=True, so a failure prints the blob that replays
it; deadline=None and the too_slow health check off. Hypothesis registers that profile
itself (6.170 here; it came with HypothesisWorks/hypothesis#4152, late 2024) and loads
it whenever CI is set to anything, "false" and "0" included. This module names the
choice instead of leaning on that detection: CI=0/false/no (or empty) loads the default
profile, any other value "ci", and with no CI at all hypothesis's own detection stands
(the default profile, unless another CI's variable is set). So there is no profile of
ours to register.

Locally the default profile draws new examples every run and keeps failing ones in
.hypothesis/, which replays them until they pass. A test's own @settings (max_examples,
deadline, or derandomize=True as tests/test_bad_input.py's schemathesis run has) wins
over either profile for what it names."""

import os

from hypothesis import settings

NOT_CI = ("", "0", "false", "no")

if "CI" in os.environ:
    settings.load_profile("default" if os.environ["CI"].strip().lower() in NOT_CI else "ci")
