"""Autoscaling on KV pressure: the policy's arithmetic, then a real app that scales from
1 to 2 replicas under load and back to 1 when idle, failing no request."""

import threading
import time

import openai
import pytest
from conftest import SERVE_HTTP_PORT, undeploy, wait_for
from ray import serve

from deployments.app import build_app
from deployments.autoscaling import desired_replicas

APP = "autoscale-test"
MODEL = "SmolLM2-135M-Instruct"
# Six clients of 101 prompt tokens and this many more hold about 60 blocks of 16 tokens,
# against one replica's 32: pressure from the first requests on.
MAX_TOKENS = 48


def test_policy_sizes_by_kv_usage_and_queueing():
    assert desired_replicas(1, [0.9], [0], target_kv_usage=0.7, max_waiting_per_replica=1) == 2
    assert desired_replicas(2, [0.3, 0.3], [0, 0], target_kv_usage=0.7, max_waiting_per_replica=1) == 1
    assert desired_replicas(2, [0.7, 0.7], [0, 0], target_kv_usage=0.7, max_waiting_per_replica=1) == 2
    # Queues longer than allowed add a replica even when the KV figure looks fine.
    assert desired_replicas(1, [0.2], [3], target_kv_usage=0.7, max_waiting_per_replica=1) == 2
    assert (
        desired_replicas(3, [0.0, 0.0, 0.0], [0, 0, 0], target_kv_usage=0.7, max_waiting_per_replica=1) == 0
    )


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def autoscaled_app(ray_cluster, model_path):
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_kv_usage": 0.5,
        "upscale_delay_s": 1,
        "downscale_delay_s": 3,
        "look_back_period_s": 2,
    }
    config = {
        "app_name": APP,
        "model": str(model_path),
        "served_model_name": MODEL,
        "autoscaling": autoscaling,
        "engine_args": {"num_kv_blocks": 32},
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}/v1", api_key="x", max_retries=0)
    undeploy(APP)


def test_scales_up_under_kv_pressure_and_back_down_when_idle(autoscaled_app):
    assert running_replicas() == 1
    stop = threading.Event()
    results, errors = [], []

    def client_loop(i: int) -> None:
        while not stop.is_set():
            try:
                out = autoscaled_app.completions.create(
                    model=MODEL, prompt=f"{i} " * 100, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
                )
                results.append(out.usage.completion_tokens)
            except Exception as e:  # recorded, then asserted on: none may fail
                errors.append(repr(e))

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: running_replicas() == 2, timeout_s=120, interval_s=0.5)
        time.sleep(3)  # requests keep flowing while the new replica joins
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert results and all(n == MAX_TOKENS for n in results)
    wait_for(lambda: running_replicas() == 1, timeout_s=120, interval_s=0.5)
