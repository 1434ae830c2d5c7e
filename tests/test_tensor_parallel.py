"""Tensor parallelism on CPU: the same code path as NCCL on GPUs, with gloo. Rank 0 runs
in this process, rank 1 in a Ray actor of the engine's placement group; greedy output
must equal HF generate token for token in fp32."""

import asyncio
import contextlib
import time

import openai
import psutil
import pytest
import ray
import torch
from conftest import SERVE_HTTP_PORT, coordinator_snapshot, hf_greedy, release_memory, undeploy, wait_for
from hypothesis import given
from hypothesis import strategies as st
from ray import serve
from transformers import AutoModelForCausalLM, LlamaConfig

from deployments.app import build_app
from kvserve import LLM, SamplingParams
from replica.parallel import workers
from replica.parallel.sharding import ShardingError, split_heads

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "The quick brown fox jumps over the lazy dog. " * 6 + "What did the fox do?",
    "In the beginning of the twentieth century, physics changed forever when Albert Einstein "
    "published his papers on special relativity, the photoelectric effect and Brownian motion. "
    "Summarise their importance in one sentence:",
]
MAX_NEW = 24


@given(
    num_kv_heads=st.integers(1, 8),
    group=st.integers(1, 8),
    world_size=st.integers(1, 16),
)
def test_every_query_head_lands_once_beside_its_kv_head(num_kv_heads, group, world_size):
    num_heads = num_kv_heads * group
    try:
        shards = split_heads(num_heads, num_kv_heads, world_size)
    except ShardingError as e:
        assert world_size > num_kv_heads and str(num_heads) in str(e)
        return
    assert len(shards) == world_size
    covered = [q for s in shards for q in range(s.q_start, s.q_start + s.num_q)]
    if world_size <= num_kv_heads:
        assert covered == list(range(num_heads))  # each query head on one rank
    else:
        assert sorted(set(covered)) == list(range(num_heads)) and len(covered) == num_heads
    for s in shards:
        assert s.num_q > 0 and s.num_kv > 0 and s.num_q % s.num_kv == 0
        local_group = s.num_q // s.num_kv  # the plain GQA layout within the rank
        for i in range(s.num_q):
            assert (s.q_start + i) // group == s.kv_start + i // local_group


def test_head_splits_of_real_shapes():
    # SmolLM2-135M: 9 heads in 3 KV groups, 2 + 1 over two ranks.
    assert [(s.num_q, s.num_kv) for s in split_heads(9, 3, 2)] == [(6, 2), (3, 1)]
    # Llama-3-70B: 64 heads, 8 KV heads, one KV head per rank at 8.
    assert {(s.num_q, s.num_kv) for s in split_heads(64, 8, 8)} == {(8, 1)}
    # 16 ranks share each of 8 KV heads by twos.
    assert [s.kv_start for s in split_heads(64, 8, 16)][:4] == [0, 0, 1, 1]
    with pytest.raises(ShardingError, match="9 attention heads with 3 KV heads"):
        split_heads(9, 3, 4)


@pytest.fixture(autouse=True)
def workers_go_with_their_test():
    """Each test's engine, and with it its rank-1 worker actor (a process holding its own
    half of the model), goes when the test ends, not at the next collection: engines sit
    in reference cycles; and its heap goes back to the machine, before the next test
    starts workers and apps of its own."""
    yield
    release_memory()


@pytest.fixture(scope="module")
def expected(hf_model, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    eos = {tokenizer.eos_token_id}
    return prompts, [hf_greedy(hf_model, ids, MAX_NEW, eos) for ids in prompts]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_tp2_matches_hf_with_chunked_prefill_preemption_and_prefix_hits_then_fails_without_its_worker(
    ray_cluster, model_path, expected
):
    """Then, on the same engine, a dead worker fails the next step and the health check
    (one worker start fewer than a test of its own)."""
    prompts, want = expected
    # 10 blocks of 16 tokens hold the longest request alone but not all at once; 16
    # tokens a step chunk every prompt but the shortest.
    llm = LLM(
        str(model_path),
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=10,
        block_size=16,
        max_num_batched_tokens=16,
    )
    runner = llm.engine.runner
    assert runner.rank0.group.world_size == 2 and len(runner.workers.actors) == 1
    assert runner.rank0.num_kv_heads == 2  # rank 0's 2 of the model's 3 KV heads
    assert _greedy(llm, prompts) == want
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks

    # The prompt of the longest request again, now from the prefix cache.
    (again,) = llm.generate([prompts[-1]], SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    assert again.num_cached_tokens >= 32
    assert again.token_ids == want[-1]

    engine = llm.engine
    engine.add_request("Once upon a time", SamplingParams(max_tokens=200, temperature=0))
    for _ in range(3):
        engine.step()
    ray.kill(engine.runner.workers.actors[0])
    with pytest.raises(Exception, match="Connection closed by peer|worker"):
        for _ in range(50):  # gloo notices the closed connection in the next collective
            engine.step()
    with pytest.raises(workers.WorkerError, match="gone or stuck"):
        asyncio.run(engine.runner.workers.check_alive(timeout_s=10))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tp2_async_scheduling_matches_hf(ray_cluster, model_path, expected, backend):
    """Async scheduling keeps sampled tokens on rank 0's device: they reach rank 1 by
    broadcast. The torch backend runs transformers' own decoder over the shards."""
    prompts, want = expected
    llm = LLM(
        str(model_path),
        dtype="float32",
        tensor_parallel_size=2,
        async_scheduling=True,
        attention_backend=backend,
    )
    assert llm.engine.async_scheduling
    assert _greedy(llm, prompts) == want


def test_tp2_random_model_with_replicated_kv_head_biases_and_odd_sizes(ray_cluster, tmp_path, tokenizer):
    """One KV head for two ranks (replicated); biases on every projection, so the
    row-split ones must add theirs once; an intermediate size and a vocabulary that do
    not split evenly (the last lm_head slice is padded)."""
    config = LlamaConfig(
        vocab_size=49153,
        hidden_size=64,
        intermediate_size=129,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers initialises biases to zero, which would hide a double add
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [tokenizer(p).input_ids for p in ["Hello there", "A longer prompt with more tokens in it", "x"]]
    want = [hf_greedy(model, p, 12, set()) for p in prompts]
    llm = LLM(str(tmp_path), dtype="float32", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=8)
    assert llm.engine.runner.rank0.num_kv_heads == 1
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def test_sizes_that_cannot_split_are_refused_before_any_worker_starts(ray_cluster, model_path):
    with pytest.raises(ShardingError, match="9 attention heads with 3 KV heads over tensor_parallel_size=4"):
        LLM(str(model_path), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(model_path), tensor_parallel_size=0)


def test_fewer_gpus_than_asked_is_a_clear_error(ray_cluster, model_path, monkeypatch):
    """This Ray has no GPUs: the workers' bundles cannot be placed."""
    monkeypatch.setattr(workers, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(
        workers.WorkerError, match=r"tensor_parallel_size=2 needs 1 more bundles of \{'GPU': 1"
    ):
        LLM(str(model_path), tensor_parallel_size=2, device="cuda")
    assert not [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "PENDING"]


MIX = "tp-mix"


@pytest.fixture(scope="module")
def mixed_app(ray_cluster, model_path):
    """One app of a TP=1 replica and, as a replica group, a TP=2 one (Serve gives a
    deployment's replicas one shape, so each shape is a deployment), deployed once for
    the tests below. Health checks every second, so that three failed ones replace a
    replica in 3 s, not 30; no migrations, so that a request on a replica whose worker
    dies fails there rather than moving to the other shape."""
    config = {
        "app_name": MIX,
        "model": str(model_path),
        "served_model_name": "mix",
        "engine_args": {"dtype": "float32", "kv_cache_memory_gb": 0.05},
        "replica_groups": [
            {"name": "tp2", "engine_args": {"tensor_parallel_size": 2, "kv_cache_memory_gb": 0.1}}
        ],
        "health_check_period_s": 1,
        "max_migrations": 0,
    }
    serve.run(build_app(config), name=MIX, route_prefix="/mix")
    wait_for(lambda: len(coordinator_snapshot(MIX)) == 2, timeout_s=60, interval_s=0.5)
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{SERVE_HTTP_PORT}/mix/v1", api_key="x", max_retries=0, timeout=120
    )
    undeploy(MIX)


def two_block_prompts(tokenizer, n: int) -> list[str]:
    """Distinct prompts of 2 full blocks each: every request queries 2 blocks of the
    prefix cache wherever it lands, so a replica's count says how many it took."""
    prompts = [f"{i} " + "a quick brown fox jumps over the lazy dog " * 4 for i in range(n)]
    assert all(32 < len(tokenizer(p).input_ids) < 48 for p in prompts)
    return prompts


def burst(client: openai.OpenAI, prompts: list[str]) -> list[str]:
    """The greedy texts of `prompts`, all sent at once."""

    async def send() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="x", max_retries=0, timeout=120)
        asks = [
            aclient.completions.create(model="mix", prompt=p, max_tokens=12, temperature=0) for p in prompts
        ]
        return [o.choices[0].text for o in await asyncio.gather(*asks)]

    return asyncio.run(send())


def test_a_tp2_replica_beside_a_tp1_replica_shares_the_load(mixed_app, llm_fp32, tokenizer):
    """Both shapes take part of each burst, ranked by the KV router's placement over the
    coordinator's snapshot, and both answer with the offline engine's greedy text."""
    by_shape = {r.deployment: (rid, r.tensor_parallel_size) for rid, r in coordinator_snapshot(MIX).items()}
    assert {shape for _, shape in by_shape.values()} == {1, 2}, by_shape

    prompts = two_block_prompts(tokenizer, 16)
    want = llm_fp32.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    before = {rid: r.prefix_cache_queries for rid, r in coordinator_snapshot(MIX).items()}

    texts = burst(mixed_app, prompts[:8]) + burst(mixed_app, prompts[8:])
    assert texts == [o.text for o in want]
    taken = {}

    def all_reported() -> bool:
        """The replicas report about every 100 ms: until their reports hold all 16."""
        after = coordinator_snapshot(MIX)
        taken.update({rid: (after[rid].prefix_cache_queries - before[rid]) // 2 for rid in before})
        return sum(taken.values()) >= 16

    wait_for(all_reported, timeout_s=30)
    assert sum(taken.values()) == 16, taken
    assert min(taken.values()) >= 4, taken  # neither group sat out, nor took nearly all


def test_a_tp2_replica_fails_its_requests_and_is_replaced_when_a_worker_dies(mixed_app, llm_fp32, tokenizer):
    """The TP=2 replica runs over a placement group of 2 bundles, its rank 1 in a worker
    actor. When that worker dies, the replica fails the request it runs at its next step,
    its health check fails, and Serve starts a new replica with new workers, which serves
    the offline engine's greedy text."""
    (tp2_id,) = [rid for rid, r in coordinator_snapshot(MIX).items() if r.tensor_parallel_size == 2]
    tables = ray.util.placement_group_table().values()
    assert any(
        len(pg["bundles"]) == 2 and pg["strategy"] == "STRICT_PACK" and pg["state"] == "CREATED"
        for pg in tables
    )
    # process_iter keeps its Process objects between calls, whoever made them, and
    # yields a kept one for a reused PID: its kill() then refuses. Fresh ones only.
    psutil.process_iter.cache_clear()
    (worker,) = [
        p for p in psutil.process_iter(["cmdline"]) if "ray::TPWorker" in " ".join(p.info["cmdline"] or [])
    ]

    # Streams until one runs on the TP=2 replica: idle, it has the more free blocks, so
    # the router sends it the first; each stream holds its replica's blocks.
    prompt = "The capital of France is"
    streams = []
    while not coordinator_snapshot(MIX)[tp2_id].num_running:
        assert len(streams) < 4, "no stream reached the TP=2 replica"
        stream = mixed_app.completions.create(
            model="mix", prompt=prompt, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # running on its replica
        streams.append(stream)
        with contextlib.suppress(AssertionError):  # its report may take a push to show it
            wait_for(lambda: coordinator_snapshot(MIX)[tp2_id].num_running > 0, timeout_s=2)
    worker.kill()  # a crash, as an OOM kill or a lost GPU would be
    # The TP=2 replica fails its stream at its next step (no move: max_migrations 0); a
    # stream that still brings tokens 10 s later runs on the TP=1 replica, undisturbed.
    settled = time.monotonic() + 10
    failed = 0
    for stream in streams:
        try:
            for _ in stream:
                if time.monotonic() > settled:
                    stream.close()
                    break
        except openai.APIError as e:
            assert "EngineStepError" in str(e)
            failed += 1
    assert failed == 1

    def replaced() -> bool:
        shapes = {rid: r.tensor_parallel_size for rid, r in coordinator_snapshot(MIX).items()}
        return tp2_id not in shapes and sorted(shapes.values()) == [1, 2]

    wait_for(replaced, timeout_s=120, interval_s=0.5)
    (new_id,) = [rid for rid, r in coordinator_snapshot(MIX).items() if r.tensor_parallel_size == 2]
    # Bursts of fresh prompts until the new replica has taken one: the ingress's handle
    # and router learn of it a moment after the coordinator does.
    prompts = two_block_prompts(tokenizer, 36)[16:]
    want = llm_fp32.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    before = {rid: r.prefix_cache_queries for rid, r in coordinator_snapshot(MIX).items()}
    taken = {}
    for start in range(0, len(prompts), 4):
        assert burst(mixed_app, prompts[start : start + 4]) == [o.text for o in want[start : start + 4]]

        def reported(sent: int) -> bool:
            after = coordinator_snapshot(MIX)
            taken.update({rid: (after[rid].prefix_cache_queries - before[rid]) // 2 for rid in before})
            return sum(taken.values()) == sent

        wait_for(lambda sent=start + 4: reported(sent), timeout_s=30)
        if taken[new_id]:
            break
    assert taken[new_id] > 0, taken
