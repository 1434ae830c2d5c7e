import os
import subprocess
import sys


def _kvserve(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_generate_streams_text():
    result = _kvserve(
        "generate", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "finish_reason=" in result.stderr


def test_bad_model_is_a_clear_error(tmp_path):
    result = _kvserve("generate", "hi", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "not found" in result.stderr
