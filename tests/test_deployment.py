"""The replica deployment on a real local Ray and Serve, called through a DeploymentHandle."""

import asyncio
import os

import pytest
from ray import serve

from kvserve import SamplingParams
from replica.cpu.affinity import CorePlan
from replica.server.deployment import LLMServer
from wire.messages import GenerateRequest

# Pinned as `kvserve serve` pins its one replica (replica/cpu/affinity.py).
ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory_gb": 0.25, "cpu_cores": "auto"}


@pytest.fixture(scope="module")
def handle(ray_cluster, model_path):
    app = LLMServer.options(name="llm").bind({**ENGINE_ARGS, "model": str(model_path)})
    yield serve.run(app, name="deployment-test", route_prefix=None)
    serve.delete("deployment-test")


async def _collect(handle, prompt, params, limit=None, priority=0):
    """Read a stream; with `limit`, drop it after that many chunks the way a
    disconnecting client does (the caller cancels its response)."""
    chunks = []
    request = GenerateRequest(prompt, SamplingParams(**params), priority=priority)
    stream = handle.options(stream=True).generate.remote(request)
    async for chunk in stream:
        chunks.append(chunk)
        if limit is not None and len(chunks) >= limit:
            stream.cancel()
            break
    return chunks


def test_replica_runs_on_the_cores_it_was_given(handle):
    """The engine's own thread reports its affinity, after a decode step: one torch thread
    per core. Which cores "auto" gives a decode depends on the kernels the replica's own
    timings chose (it times with its own threads, so another engine's may differ where
    two kernels are close): every core where they share their work at one row, else all
    but the first."""
    asyncio.run(_collect(handle, "Hi", {"max_tokens": 3, "temperature": 0}))
    stats = handle.stats.remote().result()
    cores = sorted(os.sched_getaffinity(0))
    expected = cores if stats.shared_rows else cores[1:] or cores
    plan = CorePlan.resolve("auto", shared_rows=stats.shared_rows)
    assert stats.cpu_affinity == expected == plan.cores_for(1)
    assert stats.torch_threads == len(expected)


def test_cpu_cores_are_checked():
    from replica.config import EngineConfig
    from replica.cpu.affinity import resolve_cores

    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig(cpu_cores=[])
    with pytest.raises(ValueError, match="cpu_cores"):
        EngineConfig(cpu_cores="all")
    with pytest.raises(ValueError, match="not among"):
        resolve_cores([max(os.sched_getaffinity(0)) + 1])
    assert resolve_cores([0, 0]) == [0]


def test_stream_matches_offline_greedy(handle, llm_fp32):
    params = {"max_tokens": 16, "temperature": 0}
    chunks = asyncio.run(_collect(handle, "The capital of France is", params))
    (expected,) = llm_fp32.generate("The capital of France is", SamplingParams(**params), use_tqdm=False)
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert chunks[-1].finished and chunks[-1].finish_reason == expected.finish_reason
    assert all(not c.finished for c in chunks[:-1])


def test_concurrent_streams(handle):
    async def run_all():
        prompts = [f"Count to {n}:" for n in range(8)]
        return await asyncio.gather(
            *[_collect(handle, p, {"max_tokens": 8, "temperature": 0}) for p in prompts]
        )

    results = asyncio.run(run_all())
    assert all(sum(len(c.token_ids) for c in chunks) <= 8 and chunks[-1].finished for chunks in results)


def test_dropped_stream_frees_blocks(handle):
    total = handle.stats.remote().result().num_total_blocks
    params = {"max_tokens": 500, "temperature": 0, "ignore_eos": True}
    chunks = asyncio.run(_collect(handle, "Tell me a very long story.", params, limit=3))
    assert len(chunks) == 3 and not chunks[-1].finished
    for _ in range(100):  # the abort lands within a step of the drop
        stats = handle.stats.remote().result()
        if stats.num_free_blocks == total and stats.num_running == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert stats.num_free_blocks == total
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_bad_requests_raise_without_killing_the_replica(handle):
    """What only the replica can check (the prompt against its model, the priority
    against its scheduling policy) fails the call before anything streams."""
    with pytest.raises(Exception, match="empty"):
        asyncio.run(_collect(handle, "", {"max_tokens": 2}))
    with pytest.raises(Exception, match="prompt token ids"):
        asyncio.run(_collect(handle, [10**9], {"max_tokens": 2}))
    with pytest.raises(Exception, match="priority scheduling is not enabled"):
        asyncio.run(_collect(handle, "hi", {"max_tokens": 2}, priority=1))
    chunks = asyncio.run(_collect(handle, "hi", {"max_tokens": 2, "temperature": 0}))
    assert chunks[-1].finished


def test_a_replica_running_other_versions_than_the_app_was_built_with_refuses_to_start(
    ray_cluster, model_path
):
    import re

    from replica.versions import running_versions

    running = running_versions()["kvserve"]
    built_with = {**running_versions(), "kvserve": "0.0.1"}
    # One start: Serve would otherwise try a failing constructor three times.
    options = {"name": "llm-other-versions", "max_constructor_retry_count": 1}
    app = LLMServer.options(**options).bind({"model": str(model_path)}, None, built_with)
    message = (
        f"this replica on node .* runs kvserve {re.escape(running)} here but 0.0.1 where the application"
    )
    try:
        with pytest.raises(RuntimeError, match="Deploying application versions-test failed"):
            serve.run(app, name="versions-test", route_prefix=None)
        # What `serve status` shows the operator: the replica's own error.
        status = serve.status().applications["versions-test"].deployments["llm-other-versions"]
        assert re.search(message, status.message), status.message
    finally:
        serve.delete("versions-test")
