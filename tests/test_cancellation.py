"""Cancelled requests leave nothing behind, as vLLM's test_abort_metrics_reset checks:
streaming and non-streaming requests, cancelled by the openai client while waiting for
a slot, during a (chunked) prefill and during decode. Afterwards every replica reports
nothing running, nothing waiting and every KV block free, and so does /metrics."""

import asyncio

import httpx
import openai
import pytest
from conftest import SERVE_HTTP_PORT, coordinator_snapshot, undeploy, wait_for
from ray import serve
from test_metrics import metric_values

from deployments.app import build_app
from wire.messages import ReplicaReport

APP = "cancel-test"
MODEL = "SmolLM2-135M-Instruct"
BASE_URL = f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"
# A prompt whose prefill takes many steps at 16 tokens a step.
LONG_PROMPT = " ".join(f"item {i}," for i in range(600))


def all_idle_and_free() -> bool:
    replicas = coordinator_snapshot(APP)
    return len(replicas) == 2 and all(
        s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks
        for s in replicas.values()
    )


@pytest.fixture(scope="module")
def app(ray_cluster, model_path):
    # One running request per replica, so that the others wait; chunked prefill of 16
    # tokens a step, so that a long prompt is in prefill for many steps.
    engine = {"max_num_seqs": 1, "max_num_batched_tokens": 16, "num_kv_blocks": 256}
    config = {"app_name": APP, "model": str(model_path), "served_model_name": MODEL, "replicas": 2}
    serve.run(build_app({**config, "engine_args": engine}), name=APP, route_prefix=f"/{APP}")
    wait_for(all_idle_and_free, timeout_s=30)
    yield
    undeploy(APP)


async def cancel_when(tasks: list[asyncio.Task], condition) -> None:
    """Cancel every task once `condition(snapshot)` holds (checked every 50 ms)."""
    loop = asyncio.get_running_loop()
    for _ in range(1200):
        if condition(await loop.run_in_executor(None, coordinator_snapshot, APP)):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"never reached the state to cancel in: {coordinator_snapshot(APP)}")
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results


def totals(replicas: dict[str, ReplicaReport], field: str) -> int:
    return sum(getattr(s, field) for s in replicas.values())


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_cancelled_requests_leave_every_replica_idle_with_all_blocks_free(app, stream, phase):
    """Six requests on two replicas that run one each: two run (decoding, or still in
    their long prefill) and four wait. All six are cancelled by the client."""
    prompt = LONG_PROMPT if phase == "prefill" else "Tell me a very long story."

    async def scenario() -> None:
        client = openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="-", max_retries=0)
        streamed = []

        async def request() -> None:
            kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 1000}
            kwargs["extra_body"] = {"ignore_eos": True}
            if not stream:
                await client.completions.create(**kwargs)
                return
            async for _ in await client.completions.create(stream=True, **kwargs):
                streamed.append(1)

        tasks = [asyncio.create_task(request()) for _ in range(6)]

        def ready(replicas: dict[str, ReplicaReport]) -> bool:
            busy = totals(replicas, "num_running") == 2 and totals(replicas, "num_waiting") == 4
            # Decode: tokens are flowing (for a stream, the client has some). Prefill:
            # cancel at once, long before a 600-token prompt is through at 16 a step.
            decoding = not stream or len(streamed) >= 4 if phase == "decode" else not streamed
            return busy and decoding

        try:
            await cancel_when(tasks, ready)
        finally:
            await client.close()

    asyncio.run(scenario())
    wait_for(all_idle_and_free, timeout_s=30)
    metrics = httpx.get(f"{BASE_URL}/metrics").text
    samples = [line for line in metrics.splitlines() if "{" in line and not line.startswith("#")]
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in samples}
    assert gauges["vllm:num_requests_running"] == 0
    assert gauges["vllm:num_requests_waiting"] == 0
    assert gauges["vllm:kv_cache_usage_perc"] == 0
    assert metric_values(metrics).get("vllm:generation_tokens_total", 0) == 0  # nothing finished
