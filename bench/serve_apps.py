"""kvserve apps on a local Ray Serve, for the benchmarks that deploy in-process (bench.serving,
bench.priority, bench.soak, bench.chaos): Ray and Serve started and stopped around a run,
an app deployed and undeployed, and its replicas' reports read from its coordinator."""

import contextlib
import time

import ray
from ray import serve

from deployments.app import GRPC_SERVICER, build_app
from router.placement.coordinator import coordinator_address
from wire.messages import ReplicaReport


@contextlib.contextmanager
def local_serve(http_port: int, grpc_port: int | None = None, log_to_driver: bool = False):
    """Ray on this machine's 2 cores and Serve on loopback, stopped on the way out."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=log_to_driver)
    grpc = (
        {"grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]}} if grpc_port else {}
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, **grpc)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(config: dict, route_prefix: str) -> None:
    """deployments.app's app for `config` (app_name, replicas, engine_args, ...)."""
    serve.run(build_app(config), name=config["app_name"], route_prefix=route_prefix)


def coordinator(app: str):
    namespace, name = coordinator_address(app)
    return ray.get_actor(name, namespace=namespace)


def snapshot(app: str, timeout_s: float | None = None) -> dict[str, ReplicaReport]:
    """Each replica's last report, by replica."""
    return ray.get(coordinator(app).snapshot.remote(), timeout=timeout_s)


def wait_for_replicas(app: str, replicas: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while len(snapshot(app)) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app} has fewer than {replicas} replicas reporting after {timeout_s:.0f} s")
        time.sleep(0.1)


def undeploy(app: str) -> None:
    """The app and its coordinator (a detached actor, which outlives the app)."""
    serve.delete(app)
    with contextlib.suppress(ValueError):  # already gone
        ray.kill(coordinator(app))
