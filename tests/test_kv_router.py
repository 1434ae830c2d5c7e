"""KV-aware routing: the ranking rules on their own, then two real replicas behind the
router on a local Serve app."""

import asyncio
import random
import statistics
import time

import httpx
import openai
import pytest
import ray
from conftest import SERVE_HTTP_PORT, undeploy, wait_for
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from deployments.app import build_app
from kvcache import KVCacheManager, hash_full_blocks
from replica import SamplingParams
from router.coordinator import coordinator_address, follow_snapshots, get_coordinator
from router.kv_router import (
    KVAwareRouter,
    ReplicaView,
    RoutedRequest,
    blocks_needed,
    group_ranks,
    net_free_blocks,
    placement,
)

APP = "router-test"
MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS, BLOCK = 64, 16


def view(free: int, cached: list[bytes] = (), total: int = 64, accepting: bool = True) -> ReplicaView:
    return ReplicaView(
        block_size=16,
        max_model_len=1024,
        free_blocks=free,
        total_blocks=total,
        cached_hashes=frozenset(cached),
        reported_at=time.monotonic(),
        accepting=accepting,
    )


def keys(prompt: list[int], views: dict[str, ReplicaView], promised: dict[str, int] | None = None) -> dict:
    promised = promised or {}
    return {r: placement(RoutedRequest(prompt, 1), v, promised.get(r, 0)).key for r, v in views.items()}


def test_net_free_blocks_credits_the_cached_prefix_but_never_the_last_token():
    prompt = list(range(100, 164))  # 4 full blocks; one more token opens a fifth
    hashes = hash_full_blocks(prompt[:-1], 16)
    assert len(hashes) == 3
    assert net_free_blocks(RoutedRequest(prompt, 1), view(free=40), 0) == (35, 0)
    assert net_free_blocks(RoutedRequest(prompt, 1), view(free=40, cached=hashes), 0) == (38, 3)
    assert net_free_blocks(RoutedRequest(prompt, 1), view(free=40, cached=hashes), 5) == (33, 3)


def test_net_free_blocks_reserves_the_whole_answer():
    prompt = list(range(100, 164))
    assert net_free_blocks(RoutedRequest(prompt, 64), view(free=40), 0) == (32, 0)  # 128 tokens: 8 blocks
    # Unset max_tokens: the answer may run to max_model_len (1024 tokens, 64 blocks).
    assert net_free_blocks(RoutedRequest(prompt, None), view(free=40), 0) == (-24, 0)
    # n = 3: the first sample takes 8 blocks; the others share its 3 full prompt blocks
    # (the last prompt token is never cached) and need 5 more each.
    assert net_free_blocks(RoutedRequest(prompt, 64, 3), view(free=40), 0) == (22, 0)


def test_a_prefix_counts_up_to_the_deepest_reported_block():
    """Hashes are chained: a reported block vouches for every block before it, even
    ones the bounded report left out (it once stopped at the first missing block, so a
    shared prompt whose first blocks aged out of the report scored nothing)."""
    prompt = list(range(200, 280))
    hashes = hash_full_blocks(prompt[:-1], 16)
    assert len(hashes) == 4

    def hits(cached: list[bytes]) -> int:
        return net_free_blocks(RoutedRequest(prompt, 1), view(free=32, cached=cached), 0)[1]

    assert hits([hashes[0], hashes[2], hashes[3]]) == 4
    assert hits([hashes[0], hashes[2]]) == 3
    assert hits([hashes[1]]) == 2
    assert hits(hash_full_blocks(list(range(300, 380)), 16)) == 0  # another prompt's blocks


def test_much_more_room_beats_a_cached_prefix():
    prompt = list(range(100, 164))
    hashes = hash_full_blocks(prompt[:-1], 16)
    k = keys(prompt, {"roomy": view(free=60), "cached": view(free=40, cached=hashes)})
    assert k["roomy"] > k["cached"]


def test_a_cached_prefix_wins_while_it_saves_more_than_the_extra_load():
    prompt = list(range(100, 164))  # 4 prompt blocks (with the last token), 3 of them cacheable
    hashes = hash_full_blocks(prompt[:-1], 16)
    # 2 blocks more load, 3 blocks less prefill: the cached replica costs less.
    k = keys(prompt, {"near": view(free=42), "cached": view(free=40, cached=hashes)})
    assert k["cached"] > k["near"]
    # 5 blocks more load outweigh the 3 it saves: a shared prefix must not pile requests up.
    k = keys(prompt, {"near": view(free=45), "cached": view(free=40, cached=hashes)})
    assert k["near"] > k["cached"]
    # Same load, no prefix anywhere: a tie, which the router breaks at random.
    k = keys(prompt, {"a": view(free=45), "b": view(free=45)})
    assert k["a"] == k["b"]


def _route_burst(views: dict[str, ReplicaView], prompts: list[list[int]]) -> list[str]:
    """Route requests one after another, debiting each choice as the router does."""
    promised = dict.fromkeys(views, 0)
    chosen = []
    for prompt in prompts:
        request = RoutedRequest(prompt, 48)
        best = max(views, key=lambda r: placement(request, views[r], promised[r]).key)
        chosen.append(best)
        promised[best] += blocks_needed(request, views[best])[0]
    return chosen


def test_a_burst_of_equal_requests_splits_evenly_or_leans_only_as_far_as_a_prefix_saves():
    """The router's own debits are all that changes during a burst. Equal requests on
    equal replicas split evenly (free room compared in buckets once sent 13 of 16 to
    one replica), and a shared system prompt cached on one replica tilts the split
    only by the prefill it saves there."""
    rng = random.Random(1)
    equal = {"a": view(free=60), "b": view(free=60)}
    chosen = _route_burst(equal, [[rng.randrange(1000, 40000) for _ in range(40)] for _ in range(16)])
    assert chosen.count("a") == chosen.count("b") == 8, chosen

    system = [rng.randrange(1000, 40000) for _ in range(48)]  # 3 blocks
    prompts = [system + [rng.randrange(1000, 40000) for _ in range(8)] for _ in range(16)]
    views = {"with_prefix": view(free=60, cached=hash_full_blocks(system, 16)), "without": view(free=60)}
    chosen = _route_burst(views, prompts)
    assert chosen[0] == "with_prefix"  # the first request takes the prefix hit
    assert 8 <= chosen.count("with_prefix") <= 11, chosen


def test_promised_blocks_count_against_a_replica():
    prompt = list(range(300, 332))
    k = keys(prompt, {"a": view(free=40), "b": view(free=30)}, promised={"a": 24})
    assert k["b"] > k["a"]


def test_a_replica_with_a_full_waiting_queue_ranks_last():
    prompt = list(range(100, 164))
    hashes = hash_full_blocks(prompt[:-1], 16)
    k = keys(prompt, {"full": view(free=60, cached=hashes, accepting=False), "open": view(free=10)})
    assert k["open"] > k["full"]
    report = {"block_size": 16, "max_model_len": 1024, "num_free_blocks": 9, "num_pending_blocks": 0}
    report |= {"num_total_blocks": 64, "cached_block_hashes": [], "age_s": 0.0}
    assert not ReplicaView.from_report({**report, "num_waiting": 4, "max_waiting": 4}, 0.0).accepting
    assert ReplicaView.from_report({**report, "num_waiting": 3, "max_waiting": 4}, 0.0).accepting
    assert ReplicaView.from_report({**report, "num_waiting": 99, "max_waiting": None}, 0.0).accepting


def test_reports_are_dated_by_age_so_clock_skew_between_nodes_does_not_matter(ray_cluster):
    """Two replicas on nodes whose clocks are an hour ahead and an hour behind the
    router's. Each sends how old its report is; the coordinator adds how long it held
    it; the router dates it on its own clock. So a request routed before a report was
    built counts as in the report, and one routed after it as still promised. (With
    times of day, the replica ahead would have hidden every promise and the one behind
    would have counted them all twice: bursts piled up, or replicas looked full.)"""
    address = ("kvserve-test", "coordinator:skew")
    coordinator = get_coordinator(address)
    router = KVAwareRouter(DeploymentID(name="LLMServer", app_name="skew"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(coordinator=address, refresh_interval_s=0.02)
    replicas = {name: ReplicaID(name, DeploymentID(name="LLMServer", app_name="skew")) for name in "ab"}
    skew_s = {"a": 3600.0, "b": -3600.0}
    report = {"block_size": 16, "max_model_len": 1024, "num_free_blocks": 60, "num_pending_blocks": 0}
    report |= {"num_total_blocks": 64, "cached_block_hashes": [], "num_waiting": 0, "max_waiting": 8}

    def route(request_id: str, name: str, max_tokens: int) -> None:
        metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
        pending = PendingRequest(
            args=[list(range(8)), {"max_tokens": max_tokens}], kwargs={}, metadata=metadata
        )
        router.on_request_routed(pending, replicas[name], None)

    async def scenario() -> dict[str, int]:
        router._start_refresher()
        for name in "ab":  # a first report, so that the router has views to debit against
            ray.get(coordinator.report.remote(name, {**report, "age_s": 0.0}))
        await asyncio.sleep(0.2)
        for name in "ab":
            route(f"before-{name}", name, 40)  # 48 tokens: 3 blocks
        await asyncio.sleep(0.2)
        built_at = {name: time.monotonic() + skew_s[name] for name in "ab"}  # each node's clock
        await asyncio.sleep(0.2)
        for name in "ab":
            route(f"after-{name}", name, 72)  # 80 tokens: 5 blocks
        await asyncio.sleep(0.1)
        for name in "ab":
            age_s = time.monotonic() + skew_s[name] - built_at[name]
            ray.get(coordinator.report.remote(name, {**report, "age_s": age_s}))
        await asyncio.sleep(0.2)
        return {name: router._promised_blocks(name) for name in "ab"}

    try:
        assert asyncio.run(scenario()) == {"a": 5, "b": 5}
    finally:
        ray.kill(coordinator)


def test_following_snapshots_ends_whenever_it_is_cancelled(ray_cluster):
    """A router's snapshot loop, cancelled at random moments, some just as a snapshot
    arrives, ends every time. (Through asyncio.wait_for, Python 3.11 kept about one
    cancellation in eight: the loop went on polling, and asyncio.run, which cancels it on
    the way out, waited forever. A full test run hung that way.)"""
    address = ("kvserve-test", "coordinator:cancel")
    coordinator = get_coordinator(address)
    ray.get(coordinator.snapshot.remote())  # started, so that start-up is not in the timings

    async def time_to_first_snapshot() -> float:
        """How long a fresh loop takes to hand out its first snapshot (it looks the
        coordinator up, then asks it), so that cancellations can be aimed around it
        however fast or loaded this machine is."""
        arrived = asyncio.Event()
        start = time.monotonic()
        task = asyncio.create_task(follow_snapshots(address, 0.0, lambda *_: arrived.set(), "nothing"))
        await asyncio.wait_for(arrived.wait(), timeout=30.0)
        elapsed = time.monotonic() - start
        task.cancel()
        await asyncio.wait({task}, timeout=5.0)
        return elapsed

    async def cancel_at_random(times: int) -> tuple[int, int]:
        # asyncio.sleep overshoots a little, so the window reaches only a bit past the median.
        window_s = 1.5 * statistics.median([await time_to_first_snapshot() for _ in range(15)])
        with_snapshots = 0
        still_running = 0
        for _ in range(times):
            snapshots = 0

            def use(snapshot: dict, asked_at: float) -> None:
                nonlocal snapshots
                snapshots += 1

            task = asyncio.create_task(follow_snapshots(address, 0.0, use, "nothing"))
            await asyncio.sleep(random.uniform(0.0, window_s))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            still_running += not done
            with_snapshots += snapshots > 0
        return still_running, with_snapshots

    # Not asyncio.run: it would wait forever for a task that ignored its cancellation.
    loop = asyncio.new_event_loop()
    try:
        still_running, with_snapshots = loop.run_until_complete(cancel_at_random(150))
    finally:
        loop.close()
        ray.kill(coordinator)
    assert still_running == 0
    # The window spans the first snapshot's arrival, so cancellations land on both sides.
    assert 0 < with_snapshots < 150, f"{with_snapshots} of 150 loops got a snapshot"


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
    undeploy(APP)


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
    """One long request fills most of replica A's cache (and reserves nearly all of it
    for its answer). Every short request after it must go to B, even once B holds more
    ongoing requests than A (where power-of-two choices, which compares queue lengths,
    would pick A)."""
    rng = random.Random(0)
    params = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    big = router_app.options(stream=True).generate.remote(random_prompt(rng, 620), params)
    small_params = {**params, "max_tokens": 40}
    streams = [big]
    try:
        filled = next(big)["replica_id"]
        # 620 prompt tokens hold 39 of 64 blocks; wait until the coordinator has seen it.
        wait_for(lambda: snapshot().get(filled, {}).get("num_free_blocks", NUM_BLOCKS) <= NUM_BLOCKS - 39)
        time.sleep(0.3)  # the router's copy refreshes every 100 ms
        for _ in range(5):
            small = router_app.options(stream=True).generate.remote(random_prompt(rng, 20), small_params)
            streams.append(small)
            assert next(small)["replica_id"] != filled
    finally:
        for stream in streams:
            stream.cancel()
    wait_for(lambda: all(s["num_free_blocks"] == NUM_BLOCKS for s in snapshot().values()))


def test_bursts_of_equal_requests_split_evenly_over_http(router_app):
    """8 requests with one prompt, sent at once to 2 idle replicas: 4 each, every time
    (Serve ranks a burst before routing any of it; ties once sent 5 or 6 to one)."""
    body = {"model": MODEL, "prompt": random_prompt(random.Random(5), 40), "max_tokens": 4, "temperature": 0}

    async def burst() -> list[str]:
        url = f"http://127.0.0.1:{SERVE_HTTP_PORT}/router-test/v1/completions"
        async with httpx.AsyncClient(timeout=120) as client:
            responses = await asyncio.gather(*(client.post(url, json=body) for _ in range(8)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return [r.headers["x-kvserve-replica"] for r in responses]

    def idle() -> bool:
        replicas = snapshot().values()
        return len(replicas) == 2 and all(
            s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == NUM_BLOCKS for s in replicas
        )

    for _ in range(3):
        # Idle as the ingress's router sees it: its copy of the reports refreshes every
        # 100 ms (right after the test before, it could still show that test's long
        # request, and sent the whole burst to the other replica), and the last burst's
        # reservations expire after 0.5 s.
        wait_for(idle)
        time.sleep(0.6)
        served = asyncio.run(burst())
        assert sorted(served.count(r) for r in set(served)) == [4, 4], served


def test_32_concurrent_mixed_requests_across_two_replicas(router_app, llm_fp32, tokenizer):
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{SERVE_HTTP_PORT}/router-test/v1", api_key="unused", max_retries=0
    )
    # Longer than one KV block, so that every request, not only the chats (whose template
    # adds a system prompt), shows up in its replica's prefix-cache queries.
    questions = [
        f"Write one short sentence about the number {i}, and say why people like it." for i in range(8)
    ]
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

    assert all(len(tokenizer(q).input_ids) > BLOCK for q in questions)

    def served() -> list[str]:
        after = snapshot()
        return [r for r in after if after[r]["prefix_cache_queries"] > before[r]["prefix_cache_queries"]]

    # Replicas report every ~100 ms, so the last requests may not be in the snapshot yet.
    try:
        wait_for(lambda: len(served()) == 2, timeout_s=5)
    except AssertionError:
        raise AssertionError(f"both replicas should have taken requests, served: {served()}") from None


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
