"""Serve application builder: one pydantic config in, one Serve application out."""

import json
import os
import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve import Application
from ray.serve.config import (
    AutoscalingConfig,
    AutoscalingPolicy,
    BackpressureConfig,
    RequestRouterConfig,
)

from deployments.autoscaling import KVPressurePolicy
from replica.chat_template import default_chat_template, load_chat_template
from replica.config import EngineConfig
from replica.lora.adapter_files import LoRAAdapterError, read_adapter
from replica.model_loader import BUNDLED_NAME, is_hub_id, resolve_model
from replica.parallel.workers import replica_bundles
from replica.server.deployment import LLMServer
from replica.versions import running_versions
from router.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from router.api.http import OpenAIIngress
from router.generation import DEFAULT_MAX_MIGRATIONS
from router.lora_adapters import LoRASettings
from router.placement.coordinator import coordinator_address
from router.placement.kv_router import KVAwareRouter

SERVE_METRICS_INTERVAL_S = AutoscalingConfig.model_fields["metrics_interval_s"].default  # 10 s

# A stopping replica sleeps this long before each count of its requests in flight (Serve's
# default is 2 s): the first sleep lets routers learn that it is stopping, which Serve's
# long poll tells them within milliseconds; a request that still reaches it is served
# before it stops, or once it has drained, rejected and routed again. Every app teardown,
# `kvserve serve` exit and scale-down waits it out.
SHUTDOWN_WAIT_LOOP_S = 0.5

# For Serve's gRPC proxy (`grpc_options.grpc_servicer_functions`).
GRPC_SERVICER = "router.api.protos.kvserve_pb2_grpc.add_LLMServicer_to_server"


class Autoscaling(BaseModel):
    """Replicas follow KV pressure (deployments/autoscaling.py) between these bounds."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    target_kv_usage: float = Field(default=0.7, gt=0, le=1)
    max_waiting_per_replica: float = Field(default=1.0, ge=0)
    upscale_delay_s: float = Field(default=10.0, ge=0)
    downscale_delay_s: float = Field(default=120.0, ge=0)
    look_back_period_s: float = Field(default=10.0, gt=0)


def _tensor_parallel_size(engine_args: dict) -> int:
    return int(engine_args.get("tensor_parallel_size", 1))


class ReplicaGroup(BaseModel):
    """Replicas of another shape beside the app's own, for the same model: say
    tensor-parallel ones on bigger nodes (router/placement/replica_groups.py). A fixed count."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")  # its deployment is LLMServer-<name>
    replicas: int = Field(default=1, ge=1)
    engine_args: dict = Field(default_factory=dict)  # over the app's engine_args
    num_cpus_per_replica: float | None = Field(default=None, ge=0)  # default: the app's
    num_gpus_per_replica: float | None = Field(default=None, ge=0)


def check_lora_modules(
    modules: dict[str, str], model: str | None, revision: str | None, max_lora_rank: int
) -> None:
    """Start-up adapters, each checked against the model's config (files, not weights):
    a bad one stops the start-up with a ValueError that names it."""
    if not modules:
        return
    base_config = json.loads((resolve_model(model, revision, weights=False) / "config.json").read_text())
    for name, path in modules.items():
        try:
            read_adapter(path, base_config, max_lora_rank)
        except LoRAAdapterError as e:
            raise ValueError(f"lora_modules: adapter {name!r}: {e}") from None


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    app_name: str = "kvserve"  # the Serve application name (names its coordinator)
    # None: the bundled SmolLM2-135M-Instruct; else a local directory, a .gguf file, or a
    # hub id (`org/name`), which every node fetches into its HF cache.
    model: str | None = None
    revision: str | None = None  # of a hub id: branch, tag or commit
    # The `model` clients send; default: the hub id, or the directory's name.
    served_model_name: str | None = None
    replicas: int = Field(default=1, ge=1)  # ignored when autoscaling is set
    autoscaling: Autoscaling | None = None
    # "kv": rank replicas by free KV blocks and cached prefix; "pow2": Serve's default router.
    router: Literal["kv", "pow2"] = "kv"
    engine_args: dict = Field(default_factory=dict)  # EngineConfig fields, e.g. block_size
    num_cpus_per_replica: float = Field(default=0, ge=0)
    num_gpus_per_replica: float = Field(default=0, ge=0)
    # Where `kvserve serve` starts Serve's HTTP proxy. Under `serve run/deploy` a config
    # file's `http_options` decide instead: the proxy belongs to the cluster, not the app.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    grpc_port: int = Field(default=9000, ge=1, le=65535)
    # Requests one replica works on at once, and requests queued in each caller (the
    # HTTP/gRPC proxy for the ingress, the ingress for the replicas) beyond that (-1:
    # unbounded); past the queue, HTTP 429 with Retry-After / RESOURCE_EXHAUSTED.
    max_ongoing_requests: int = Field(default=256, ge=1)
    max_queued_requests: int = Field(default=1024, ge=-1)
    # Requests one replica's engine lets wait for a KV slot; past it the request is
    # tried on another replica, then answered 429. Overrides engine_args["max_waiting"].
    max_waiting: int = Field(default=64, ge=0)
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1024)  # larger bodies: 413
    # How often one stream may move to another replica when its replica dies mid-stream.
    max_migrations: int = Field(default=DEFAULT_MAX_MIGRATIONS, ge=0)
    # How often Serve asks each LLM replica whether its engine thread and its tensor-parallel
    # workers are alive (Serve's default); after three failed checks in a row it replaces
    # the replica, so a replica whose worker died is replaced within about 3x this.
    health_check_period_s: float = Field(default=10.0, gt=0)
    # Clients must send one of these (HTTP `Authorization: Bearer`, gRPC metadata
    # `authorization`); empty: no keys. Prefer the KVSERVE_API_KEYS variable of `kvserve serve`.
    api_keys: list[str] = Field(default_factory=list, repr=False)
    # Instead of the model's chat template: a Jinja template, a file holding one, or
    # the name of one that ships with kvserve ("chatml_tools": ChatML with Hermes tools).
    chat_template: str | None = None
    # "auto": a request's unset sampling fields (temperature, top_p, top_k, min_p,
    # repetition_penalty) take the values of the model's generation_config.json, as vLLM's
    # --generation-config auto does; "none": SamplingParams' own (temperature 1, top_p 1).
    generation_config: Literal["auto", "none"] = "auto"
    # Replicas of other shapes beside these, behind the same ingress and coordinator.
    replica_groups: list[ReplicaGroup] = Field(default_factory=list)
    # LoRA adapters served from the start (`--lora-modules`): name -> local PEFT folder, or
    # a list of "name=path". Any implies engine_args["enable_lora"]; each is checked
    # against the model here, so a bad one stops the start-up with its name.
    lora_modules: dict[str, str] = Field(default_factory=dict)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _name_equals_path(cls, modules):
        if not isinstance(modules, list | tuple):
            return modules
        pairs = {}
        for module in modules:
            name, equals, path = str(module).partition("=")
            if not (equals and name.strip() and path.strip()):
                raise ValueError(f"lora_modules takes name=path, got {module!r}")
            pairs[name.strip()] = path.strip()
        return pairs

    @model_validator(mode="after")
    def _lora(self) -> "AppConfig":
        """Start-up adapters turn LoRA on, and must fit the model and max_lora_rank."""
        if not self.lora_modules:
            return self
        self.engine_args = {**self.engine_args, "enable_lora": True}
        self.lora_modules = {
            name: os.path.abspath(os.path.expanduser(path)) for name, path in self.lora_modules.items()
        }
        if self.model_name in self.lora_modules:
            raise ValueError(f"lora_modules: {self.model_name!r} is the base model's name")
        check_lora_modules(self.lora_modules, self.model, self.revision, self.max_lora_rank)
        return self

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> "AppConfig":
        for group in [None, *self.replica_groups]:
            engine_args, _, num_gpus = self.shape(group)
            if _tensor_parallel_size(engine_args) > 1 and num_gpus not in (0, 1):
                raise ValueError(
                    "with tensor_parallel_size > 1, num_gpus_per_replica is per rank: 1 (one GPU each) "
                    f"or 0 (CPU), got {num_gpus}"
                )
        if len({g.name for g in self.replica_groups}) < len(self.replica_groups):
            raise ValueError("replica_groups need distinct names")
        for group in self.replica_groups:
            own = group.engine_args.get("enable_lora")
            if own is not None and bool(own) != self.enable_lora:
                raise ValueError(f"replica group {group.name!r}: enable_lora must be the application's")
        return self

    @model_validator(mode="after")
    def _speculative_config(self) -> "AppConfig":
        """A bad speculative_config (unknown keys, bad JSON text, with tensor parallelism)
        stops the start-up here, with its reason, rather than failing every replica."""
        for group in [None, *self.replica_groups]:
            engine_args = self.shape(group)[0]
            EngineConfig(
                speculative_config=engine_args.get("speculative_config"),
                tensor_parallel_size=_tensor_parallel_size(engine_args),
            )
        return self

    def shape(self, group: ReplicaGroup | None = None) -> tuple[dict, float, float]:
        """(engine_args, num_cpus, num_gpus) of the app's replicas, or of a group's."""
        if group is None:
            return self.engine_args, self.num_cpus_per_replica, self.num_gpus_per_replica
        cpus, gpus = group.num_cpus_per_replica, group.num_gpus_per_replica
        return (
            {**self.engine_args, **group.engine_args},
            self.num_cpus_per_replica if cpus is None else cpus,
            self.num_gpus_per_replica if gpus is None else gpus,
        )

    @property
    def tensor_parallel_size(self) -> int:
        return _tensor_parallel_size(self.engine_args)

    @property
    def enable_lora(self) -> bool:
        return bool(self.engine_args.get("enable_lora"))

    @property
    def max_lora_rank(self) -> int:
        """The lowest of the replica groups': an adapter must fit wherever it may land."""
        shapes = [self.shape(group)[0] for group in [None, *self.replica_groups]]
        return min(int(args.get("max_lora_rank", EngineConfig.max_lora_rank)) for args in shapes)

    def lora_settings(self) -> LoRASettings | None:
        """What the ingress needs to check and register adapters; None with LoRA off."""
        if not self.enable_lora:
            return None
        return LoRASettings(self.max_lora_rank, dict(self.lora_modules))

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return BUNDLED_NAME
        return self.model if is_hub_id(self.model) else self.model.rstrip("/").rsplit("/", 1)[-1]


def build_app(config: AppConfig | dict) -> Application:
    config = AppConfig.model_validate(config)
    coordinator = coordinator_address(config.app_name)
    versions = running_versions()  # every replica and the ingress must run these
    scaling = (
        {"num_replicas": config.replicas}
        if config.autoscaling is None
        else {"autoscaling_config": autoscaling_config(config.autoscaling)}
    )
    llm = _replicas(config, None, scaling, coordinator, versions)
    more = [
        _replicas(config, group, {"num_replicas": group.replicas}, coordinator, versions)
        for group in config.replica_groups
    ]
    ingress = OpenAIIngress.options(
        max_queued_requests=config.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    )
    can_scale_to_zero = config.autoscaling is not None and config.autoscaling.min_replicas == 0
    return ingress.bind(
        llm,
        config.model_name,
        config.model,
        config.revision,
        coordinator,
        config.api_keys,
        config.max_request_bytes,
        warm_up=not can_scale_to_zero,
        # Read here: replicas may be elsewhere.
        chat_template=load_chat_template(default_chat_template(config.model, config.chat_template)),
        versions=versions,
        max_migrations=config.max_migrations,
        more_llms=more,
        lora=config.lora_settings(),
        generation_config=config.generation_config,
    )


def _replicas(
    config: AppConfig,
    group: ReplicaGroup | None,
    scaling: dict,
    coordinator: tuple[str, str],
    versions: dict,
) -> Application:
    """One LLMServer deployment: the app's replicas, or a replica group's."""
    engine_args, num_cpus, num_gpus = config.shape(group)
    options = dict(scaling)
    if config.router == "kv":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=KVAwareRouter, request_router_kwargs={"coordinator": coordinator}
        )
    tensor_parallel_size = _tensor_parallel_size(engine_args)
    if tensor_parallel_size > 1:
        # One bundle per rank, on one node: the replica (rank 0) runs in the first and
        # starts its workers in the others (replica/parallel/workers.py). Serve reserves
        # them with the replica, so autoscaling and routing count one replica.
        options["placement_group_bundles"] = replica_bundles(tensor_parallel_size, num_gpus > 0, num_cpus)
        options["placement_group_strategy"] = "STRICT_PACK"
    return LLMServer.options(
        name="LLMServer" if group is None else f"LLMServer-{group.name}",
        max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        health_check_period_s=config.health_check_period_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        **options,
    ).bind(
        {
            **engine_args,
            "model": config.model,
            "revision": config.revision,
            "max_waiting": config.max_waiting,
        },
        coordinator,
        versions,
    )


def autoscaling_config(settings: Autoscaling) -> AutoscalingConfig:
    policy = AutoscalingPolicy(
        policy_function=KVPressurePolicy,
        policy_kwargs={
            "target_kv_usage": settings.target_kv_usage,
            "max_waiting_per_replica": settings.max_waiting_per_replica,
        },
    )
    with warnings.catch_warnings():
        # Serve marks the field for replacement by environment variables; until then it
        # is what sets how often replicas send the policy their KV figures.
        warnings.filterwarnings("ignore", "The `metrics_interval_s` field", DeprecationWarning)
        return AutoscalingConfig(
            min_replicas=settings.min_replicas,
            initial_replicas=max(settings.min_replicas, 1),
            max_replicas=settings.max_replicas,
            upscale_delay_s=settings.upscale_delay_s,
            downscale_delay_s=settings.downscale_delay_s,
            # Replicas send their figures twice per look-back period (Serve's default is
            # every 10 s whatever the period), so the policy sees pressure within half
            # a period rather than up to 10 s later.
            metrics_interval_s=min(SERVE_METRICS_INTERVAL_S, settings.look_back_period_s / 2),
            look_back_period_s=settings.look_back_period_s,
            policy=policy,
        )
