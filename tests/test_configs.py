"""The Serve config YAMLs are valid for `serve run` / `serve deploy` and build our app."""

from pathlib import Path

import pytest
import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from deployments.app import GRPC_SERVICER, AppConfig, build_app
from replica.config import EngineConfig

CONFIGS = sorted((Path(__file__).parent.parent / "deployments" / "configs").glob("*.yaml"))
GPU_CONFIG = Path(__file__).parent.parent / "deployments" / "configs" / "gpu.yaml"


def test_both_configs_exist():
    assert {p.name for p in CONFIGS} >= {"local.yaml", "gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_a_valid_serve_config_that_builds_the_app(path):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER]
    config = AppConfig.model_validate(app.args)
    EngineConfig.from_kwargs(**config.engine_args)  # every engine argument is a real field
    assert isinstance(build_app(config), Application)


def test_gpu_config_names_its_model_by_hub_id_and_no_local_path():
    """`serve deploy` builds the app on the cluster: nothing in it may point at this
    machine. The model is fetched by each node; building it fetches nothing."""
    from replica.model_loader import is_hub_id

    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(GPU_CONFIG.read_text())).applications
    config = AppConfig.model_validate(app.args)
    assert is_hub_id(config.model) and config.model_name == config.model
    assert config.chat_template is None or "/" not in config.chat_template
    assert isinstance(build_app(config), Application)  # offline, with the model in no cache
