"""Faults on a real local Serve app: a replica killed in the middle of a stream."""

import json
import time

import httpx
import ray
from conftest import SERVE_HTTP_PORT, replica_actor, undeploy
from ray import serve

from deployments.app import build_app

APP = "fault-test"
MODEL = "SmolLM2-135M-Instruct"


def test_a_replica_killed_mid_stream_ends_the_sse_stream_with_an_error_event(ray_cluster, model_path):
    config = {"app_name": APP, "model": str(model_path), "served_model_name": MODEL}
    config["engine_args"] = {"kv_cache_memory_gb": 0.25}
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    try:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        url = f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: ") :])["choices"][0]["finish_reason"] is None
            ray.kill(replica_actor(APP))
            started = time.monotonic()
            events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert time.monotonic() - started < 60
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "replica unavailable" in error["message"]
    finally:
        undeploy(APP)
