"""The boundaries between kvserve's processes, checked on imports: the ingress, the KV
router and the coordinator talk to replicas through wire/messages.py only, so they load
without torch or the engine."""

import json
import subprocess
import sys

INGRESS_MODULES = [
    "router.api.http",
    "router.api.grpc_api",
    "router.placement.kv_router",
    "router.placement.replica_groups",
    "router.placement.coordinator",
    "deployments.autoscaling",
    "wire.messages",
]


def test_the_ingress_modules_import_without_torch():
    """In a fresh interpreter: this one has loaded torch for other tests."""
    imports = "; ".join(f"import {module}" for module in INGRESS_MODULES)
    check = f"import sys; {imports}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "an ingress module imports torch"


LOAD_TOKENIZER = """
import json, sys
from pathlib import Path
from replica.model_files import load_tokenizer, model_limits
path = Path(sys.argv[1])
ids = load_tokenizer(path).apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
print(json.dumps({"torch": "torch" in sys.modules, "vocab_size": model_limits(path).vocab_size, "ids": ids}))
"""
CHAT = [{"role": "user", "content": "hi"}]


def test_the_ingress_loads_its_tokenizer_without_torch(model_path):
    """What the ingress loads at start-up (replica/model_files.py) keeps torch out too,
    and gives what transformers' auto classes give."""
    script = f"CHAT = {CHAT!r}\n{LOAD_TOKENIZER}"
    result = subprocess.run(
        [sys.executable, "-c", script, str(model_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["torch"] is False, "loading the ingress's tokenizer imports torch"
    from transformers import AutoConfig, AutoTokenizer

    expected = AutoTokenizer.from_pretrained(model_path).apply_chat_template(CHAT, add_generation_prompt=True)
    assert loaded["ids"] == list(expected["input_ids"])
    assert loaded["vocab_size"] == AutoConfig.from_pretrained(model_path).vocab_size
