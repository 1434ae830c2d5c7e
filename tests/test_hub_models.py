"""Models named by hub id, loaded from a real HF cache laid out by the test (blobs,
snapshots, refs), with HF_HUB_OFFLINE=1: no test reaches a hub."""

import os
import subprocess
import sys

import huggingface_hub
import pytest
from conftest import HUB_ID, add_hub_repo

from kvserve import LLM, SamplingParams
from replica.model_loader import ModelNotFoundError, is_hub_id, resolve_model


@pytest.fixture
def hub_cache(monkeypatch, hf_hub_cache):
    """This process reads the test's cache (huggingface_hub reads HF_HUB_CACHE at import)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_hub_cache))
    return hf_hub_cache


def test_a_hub_id_loads_from_the_cache_and_generates_as_the_local_copy(hub_cache, llm_fp32):
    llm = LLM(HUB_ID, dtype="float32")
    assert llm.engine.model_path.is_relative_to(hub_cache)
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = "The capital of France is"
    [ours] = llm.generate(prompt, params, use_tqdm=False)
    [local] = llm_fp32.generate(prompt, params, use_tqdm=False)
    assert ours.outputs[0].token_ids == local.outputs[0].token_ids


def test_revisions_and_the_ingress_needing_no_weights(hub_cache, model_path):
    assert resolve_model(HUB_ID, "v1") == resolve_model(HUB_ID)
    config_only = "example/config-only"
    add_hub_repo(hub_cache, config_only, [f for f in model_path.iterdir() if f.suffix != ".safetensors"])
    assert (resolve_model(config_only, weights=False) / "tokenizer.json").is_file()
    with pytest.raises(ModelNotFoundError, match="example/config-only.*no safetensors weights"):
        resolve_model(config_only)


def test_a_model_missing_from_the_cache_is_a_clear_error(hub_cache):
    with pytest.raises(ModelNotFoundError, match=r"'nobody/missing' is not in the HF cache.*HF_HUB_OFFLINE"):
        resolve_model("nobody/missing")
    with pytest.raises(ModelNotFoundError, match=f"'{HUB_ID}@v2' is not in the HF cache"):
        resolve_model(HUB_ID, "v2")


def test_local_paths_win_over_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")
    assert not is_hub_id("/abs/path") and not is_hub_id("model.gguf") and not is_hub_id(None)


def _kvserve(hf_hub_cache, *args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_hub_cache))
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_kvserve_generate_with_a_hub_id_offline(hf_hub_cache):
    result = _kvserve(hf_hub_cache, "generate", "Hi", "--model", HUB_ID, "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "finish_reason=" in result.stderr


def test_kvserve_serve_refuses_a_missing_hub_model_before_starting(hf_hub_cache):
    result = _kvserve(hf_hub_cache, "serve", "--model", "nobody/missing")
    assert result.returncode == 2
    assert "model 'nobody/missing' is not in the HF cache" in result.stderr
