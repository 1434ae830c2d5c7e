"""KV-aware routing: the ranking rules on their own, then two real replicas behind the
router on a local Serve app."""

import asyncio
import random
import time

import openai
import pytest
import ray
from conftest import SERVE_HTTP_PORT
from ray import serve

from deployments.app import build_app
from kvcache import KVCacheManager, hash_full_blocks
from replica import SamplingParams
from router.coordinator import coordinator_address, get_coordinator
from router.kv_router import ReplicaView, group_ranks, placement_key

APP = "router-test"
MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS, BLOCK = 64, 16


def view(free: int, cached: list[bytes] = (), total: int = 64, block_size: int = 16) -> ReplicaView:
    return ReplicaView(block_size, free, total, frozenset(cached), reported_at=time.time())


def test_more_free_blocks_outranks_a_cached_prefix_within_the_same_bucket_only():
    prompt = list(range(100, 164))  # 4 blocks of 16
    hashes = hash_full_blocks(prompt[:-1], 16)
    roomy, cached = view(free=60), view(free=40, cached=hashes)
    assert placement_key(prompt, roomy, 0, 0.125) > placement_key(prompt, cached, 0, 0.125)
    # Same bucket of free room (8 blocks per bucket): the cached prefix decides.
    near, cached_near = view(free=41), view(free=40, cached=hashes)
    assert placement_key(prompt, cached_near, 0, 0.125) > placement_key(prompt, near, 0, 0.125)
    assert placement_key(prompt, cached_near, 0, 0.125)[1] == 3  # the last token is never cached


def test_a_prefix_counts_only_up_to_the_first_missing_block():
    prompt = list(range(200, 280))
    hashes = hash_full_blocks(prompt[:-1], 16)
    holes = view(free=32, cached=[hashes[0], hashes[2], hashes[3]])
    assert placement_key(prompt, holes, 0, 0.125)[1] == 1


def test_promised_blocks_count_against_a_replica():
    prompt = list(range(300, 332))
    assert placement_key(prompt, view(free=40), 24, 0.125) < placement_key(prompt, view(free=30), 0, 0.125)


def test_group_ranks_best_first_and_ties_share_a_rank():
    assert group_ranks({"a": (1, 0), "b": (3, 2), "c": (1, 0), "d": (3, 5)}) == [["d"], ["b"], ["a", "c"]]


def test_cached_prefix_summary_is_bounded_and_newest_first():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    tokens = list(range(40))
    kv.allocate("r", len(tokens))
    kv.cache_full_blocks("r", tokens, len(tokens))
    hashes = hash_full_blocks(tokens, 4)
    assert kv.cached_prefix_summary(1000) == hashes[::-1]
    assert kv.cached_prefix_summary(3) == hashes[::-1][:3]


@pytest.fixture(scope="module")
def router_app(ray_cluster, model_path):
    app = build_app(
        {
            "app_name": APP,
            "model": str(model_path),
            "served_model_name": MODEL,
            "replicas": 2,
            "engine_args": {"dtype": "float32", "num_kv_blocks": NUM_BLOCKS, "block_size": BLOCK},
        }
    )
    serve.run(app, name=APP, route_prefix="/router-test")
    wait_for(lambda: len(snapshot()) == 2)
    yield serve.get_deployment_handle("LLMServer", app_name=APP)
    serve.delete(APP)
    ray.kill(get_coordinator(coordinator_address(APP)))


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def snapshot() -> dict[str, dict]:
    """The coordinator's snapshot; empty while it does not exist (this never creates it)."""
    namespace, name = coordinator_address(APP)
    try:
        return ray.get(ray.get_actor(name, namespace=namespace).snapshot.remote())
    except (ValueError, ray.exceptions.RayActorError):
        return {}


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_new_requests_go_to_the_replica_with_more_free_blocks(router_app):
    """One long request fills most of replica A's cache. Every short request after it
    must go to B, even once B holds more ongoing requests than A (where power-of-two
    choices, which compares queue lengths, would pick A)."""
    rng = random.Random(0)
    params = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    big = router_app.options(stream=True).generate.remote(random_prompt(rng, 620), params)
    streams = [big]
    try:
        filled = next(big)["replica_id"]
        # 620 prompt tokens hold 39 of 64 blocks; wait until the coordinator has seen it.
        wait_for(lambda: snapshot().get(filled, {}).get("num_free_blocks", NUM_BLOCKS) <= NUM_BLOCKS - 39)
        time.sleep(0.3)  # the router's copy refreshes every 100 ms
        for _ in range(5):
            small = router_app.options(stream=True).generate.remote(random_prompt(rng, 20), params)
            streams.append(small)
            assert next(small)["replica_id"] != filled
    finally:
        for stream in streams:
            stream.cancel()
    wait_for(lambda: all(s["num_free_blocks"] == NUM_BLOCKS for s in snapshot().values()))


def test_32_concurrent_mixed_requests_across_two_replicas(router_app, llm_fp32, tokenizer):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{SERVE_HTTP_PORT}/router-test/v1", api_key="unused", max_retries=0
    )
    questions = [f"Write one sentence about the number {i}." for i in range(8)]
    before = snapshot()

    async def greedy_completion(i: int) -> str:
        out = await client.completions.create(model=MODEL, prompt=questions[i], max_tokens=16, temperature=0)
        return out.choices[0].text

    async def streamed_completion(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=questions[i], max_tokens=16, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def chat(i: int, stream: bool) -> str:
        kwargs = {"max_tokens": 16, "temperature": 0.8, "seed": 1000 + i, "stop": ["\n\n"]}
        messages = [{"role": "user", "content": questions[i]}]
        if not stream:
            out = await client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
            return out.choices[0].message.content
        chunks = await client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def run_all():
        jobs = [greedy_completion(i) for i in range(8)] + [streamed_completion(i) for i in range(8)]
        jobs += [chat(i, stream=False) for i in range(8)] + [chat(i, stream=True) for i in range(8)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run_all())
    greedy, streamed, chat_json, chat_streamed = (results[k : k + 8] for k in range(0, 32, 8))
    expected = llm_fp32.generate(questions, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert greedy == [e.text for e in expected]
    assert streamed == greedy
    # Same seed, same text, whichever replica and batch each copy landed in.
    assert chat_streamed == chat_json
    assert all(text for text in chat_json)
    after = snapshot()
    served = [r for r in after if after[r]["prefix_cache_queries"] > before[r]["prefix_cache_queries"]]
    assert len(served) == 2, "both replicas should have taken requests"


def test_routing_survives_the_coordinator_dying(router_app):
    namespace, name = coordinator_address(APP)
    ray.kill(ray.get_actor(name, namespace=namespace))
    rng = random.Random(1)
    for _ in range(4):  # routed by power of two while the coordinator is gone
        chunks = list(
            router_app.options(stream=True).generate.remote(random_prompt(rng, 30), {"max_tokens": 4})
        )
        assert chunks[-1]["finish_reason"] == "length"
    # The router recreates it; the replicas find it again and report.
    wait_for(lambda: len(snapshot()) == 2)
