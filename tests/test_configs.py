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


def test_70b_config_reserves_eight_gpus_on_one_node_per_replica():
    from transformers import LlamaConfig

    from replica.parallel.sharding import check_shardable

    path = GPU_CONFIG.with_name("gpu_70b.yaml")
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text())).applications
    config = AppConfig.model_validate(app.args)
    assert config.tensor_parallel_size == 8
    replica = build_app(config)._bound_deployment.init_args[0]._bound_deployment
    assert replica._replica_config.placement_group_strategy == "STRICT_PACK"
    bundles = replica._replica_config.placement_group_bundles
    assert len(bundles) == 8 and all(b["GPU"] == 1 for b in bundles)
    # Llama-3.1-70B's shape: 64 heads, 8 KV heads, one KV head per rank.
    check_shardable(LlamaConfig(num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672), 8)


def test_tensor_parallel_replicas_take_one_gpu_per_rank():
    with pytest.raises(ValueError, match="num_gpus_per_replica is per rank"):
        AppConfig(engine_args={"tensor_parallel_size": 2}, num_gpus_per_replica=2)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def test_speculative_config_reaches_the_replicas_as_given():
    for given in (NGRAM, '{"method": "ngram", "num_speculative_tokens": 4}'):
        app = build_app(AppConfig(engine_args={"speculative_config": given}))
        engine_args = app._bound_deployment.init_args[0]._bound_deployment.init_args[0]
        assert engine_args["speculative_config"] == given
        assert EngineConfig.from_kwargs(**engine_args).speculative_config.num_speculative_tokens == 4


@pytest.mark.parametrize(
    ("engine_args", "groups", "message"),
    [
        ({"speculative_config": "{bad"}, [], "speculative_config is not valid JSON"),
        ({"speculative_config": {**NGRAM, "n": 2}}, [], r"unknown keys \['n'\]"),
        ({"speculative_config": {"method": "ngram"}}, [], "needs"),
        ({"speculative_config": NGRAM, "tensor_parallel_size": 2}, [], "tensor_parallel_size > 1"),
        # A group's engine_args go over the app's: a tensor-parallel group can't speculate.
        (
            {"speculative_config": NGRAM},
            [{"name": "tp", "engine_args": {"tensor_parallel_size": 2}}],
            "tensor_parallel_size > 1",
        ),
    ],
)
def test_bad_speculative_config_stops_the_app_config(engine_args, groups, message):
    with pytest.raises(ValueError, match=message):
        AppConfig(engine_args=engine_args, replica_groups=groups)
