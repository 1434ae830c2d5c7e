import os
import signal
import subprocess
import sys
import time

import grpc
import openai
import pytest
from conftest import HUB_ID

from router.protos import kvserve_pb2 as pb
from router.protos import kvserve_pb2_grpc as pb_grpc


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


def test_serve_answers_then_shuts_down_cleanly(tmp_path, hf_hub_cache):
    """A model named by hub id, from an HF cache with no network (HF_HUB_OFFLINE)."""
    port, grpc_port = 18477, 18478
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_ADDRESS="local", KVSERVE_API_KEYS="secret-1")
    env["HF_HUB_CACHE"] = str(hf_hub_cache)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deployments.cli",
            "serve",
            "--model",
            HUB_ID,
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--dtype",
            "float32",
            "--kv-cache-memory-gb",
            "0.25",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        banner = ""
        deadline = time.time() + 240
        while "serving" not in banner and time.time() < deadline and proc.poll() is None:
            banner = proc.stdout.readline()
        assert f"serving {HUB_ID}" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="secret-1", max_retries=0)
        out = client.chat.completions.create(
            model=HUB_ID, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert out.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="wrong").models.list()
        stub = pb_grpc.LLMStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        metadata = [("application", "kvserve"), ("authorization", "Bearer secret-1")]
        models = stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
        assert [m.id for m in models.models] == [HUB_ID]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
