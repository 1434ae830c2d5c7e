"""kvserve on a simulated multi-node cluster.

Ray's fake multi-node provider (`provider: type: fake_multinode`, what Ray's own
autoscaler tests and `ray.cluster_utils.AutoscalingCluster` use) starts each node the
autoscaler launches as its own raylet on this machine, advertising its node type's
resources. The head advertises CPUs only; the worker type advertises one (fake) GPU and
scales from 0. So replicas that ask for a GPU land only on workers the autoscaler
starts for them, each in its own process, as on a real cluster; with no real GPU there,
the engine runs on CPU.

`AutoscalingCluster` itself reads an example config that Ray's wheel does not ship, so
the cluster is started here the way it does: `ray start --head --autoscaling-config`
with RAY_FAKE_CLUSTER=1. A driver joins one cluster at a time, so this module stops the
session's local Ray; conftest.py runs it last.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
import ray
from conftest import HUB_ID, coordinator_snapshot, wait_for
from ray import serve

from deployments.app import build_app

GCS_PORT, HTTP_PORT = 29390, 18491  # the GCS port outside Ray's worker ports (10002-19999)
APP = "kvserve"
RAY = str(Path(sys.executable).parent / "ray")


def cluster_config(gcs_address: str) -> dict:
    return {
        "cluster_name": "kvserve-fake",
        "max_workers": 2,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "gpu_worker": {
                "resources": {"CPU": 1, "GPU": 1, "object_store_memory": 100 * 2**20},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,  # 6 s
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory, hf_hub_cache):
    """The fake cluster, with this process connected to it as a driver.
    Every node reads models from the test's HF cache, offline."""
    if ray.is_initialized():  # the session's
        serve.shutdown()
        ray.shutdown()
    gcs_address = f"{ray.util.get_node_ip_address()}:{GCS_PORT}"
    config = tmp_path_factory.mktemp("fake-cluster") / "cluster.json"
    config.write_text(json.dumps(cluster_config(gcs_address)))
    env = dict(
        os.environ,
        RAY_FAKE_CLUSTER="1",
        AUTOSCALER_UPDATE_INTERVAL_S="1",
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(hf_hub_cache),
    )
    start = [RAY, "start", "--head", f"--port={GCS_PORT}", f"--autoscaling-config={config}"]
    start += ["--num-cpus=2", "--num-gpus=0", f"--object-store-memory={200 * 2**20}"]
    start += ["--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(start, env=env, check=True, capture_output=True)
    try:
        # "auto": the cluster `ray start` recorded, and the auth token it made. An explicit
        # address would need RAY_AUTH_MODE=token as well.
        ray.init(address="auto", log_to_driver=False)
        yield gcs_address
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True)


def worker_nodes() -> dict[str, dict]:
    """Alive nodes that advertise a GPU, by node id."""
    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}


def head_node_id() -> str:
    (head,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    return head


def test_replicas_land_on_gpu_workers_scale_up_under_kv_pressure_and_back_down(fake_cluster):
    assert worker_nodes() == {}  # workers scale from 0
    # One proxy, on the head: the fake nodes share this machine's address and ports.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    app = build_app(
        {
            "app_name": APP,
            "model": HUB_ID,
            "num_gpus_per_replica": 1,
            # A small KV cache, so that a few requests fill it.
            "engine_args": {"num_kv_blocks": 24, "max_num_seqs": 8},
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_kv_usage": 0.5,
                "upscale_delay_s": 1,
                "downscale_delay_s": 2,
                "look_back_period_s": 2,
            },
        }
    )
    serve.run(app, name=APP, route_prefix="/")  # waits for a worker node and its replica

    head = head_node_id()
    wait_for(lambda: len(coordinator_snapshot(APP)) == 1, timeout_s=30)
    [first] = coordinator_snapshot(APP).values()
    assert first.node_id in worker_nodes() and first.node_id != head
    assert first.device == "cpu"  # a fake GPU: torch sees none and the engine uses the CPU

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(
        model=HUB_ID, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content

    # Load: 6 streams that each hold 9 of the 24 blocks until done, over and over,
    # until a second replica reports from a second worker node.
    stop = threading.Event()
    errors: list[Exception] = []
    completion_tokens: list[int] = []

    def load() -> None:
        while not stop.is_set():
            try:
                out = client.completions.create(
                    model=HUB_ID,
                    prompt="Count from one to one hundred: one, two, three,",
                    max_tokens=120,
                    extra_body={"ignore_eos": True},
                )
                completion_tokens.append(out.usage.completion_tokens)
            except openai.APIError as e:
                errors.append(e)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(coordinator_snapshot(APP)) == 2, timeout_s=240, interval_s=0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert errors == []
    assert completion_tokens and set(completion_tokens) == {120}  # none cut short by the scale-up
    nodes = {report.node_id for report in coordinator_snapshot(APP).values()}
    assert len(nodes) == 2 and nodes <= set(worker_nodes()) and head not in nodes

    # Idle: back to one replica, and the autoscaler removes the node it left.
    wait_for(lambda: len(coordinator_snapshot(APP)) == 1, timeout_s=120, interval_s=0.5)
    wait_for(lambda: len(worker_nodes()) == 1, timeout_s=120, interval_s=0.5)
    again = client.completions.create(model=HUB_ID, prompt="Hello", max_tokens=4)
    assert again.choices[0].text is not None
    serve.delete(APP)


def test_kvserve_batch_runs_its_engines_on_gpu_workers(fake_cluster, hf_hub_cache, tmp_path):
    """Each engine actor asks for a GPU, which only worker nodes have: the job can only
    finish once the autoscaler has started one for it."""
    rows = [{"id": f"r{i}", "prompt": f"Say the number {i}.", "max_tokens": 6} for i in range(8)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, RAY_ADDRESS="auto", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hf_hub_cache))
    command = [sys.executable, "-m", "deployments.cli", "batch", str(tmp_path / "in.jsonl"), str(out)]
    command += ["--model", HUB_ID, "--num-gpus-per-replica", "1", "--num-cpus-per-replica", "0"]
    command += ["--max-replicas", "1", "--kv-cache-memory-gb", "0.1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in written) == [row["id"] for row in rows]
    assert all(r["error"] is None and r["completion_tokens"] > 0 for r in written)
