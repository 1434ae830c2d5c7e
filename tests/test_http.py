"""The OpenAI-compatible endpoint on a real local Serve app (conftest.py's agent_app),
called with the official client."""

import time

import httpx
import openai
import pytest
from conftest import AGENT_APP, coordinator_snapshot, wait_for
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from kvserve import SamplingParams
from wire.messages import ReplicaReport

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_url(agent_app):
    """The session's Serve app on the bundled model (fp32, 0.25 GB of KV), as `make run`
    serves it."""
    return agent_app


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list()] == [MODEL]
    # 503 while the ingress's start-up request warms the path, then 200.
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{base_url}/health")).status_code == 503 and time.monotonic() < deadline:
        assert health.json() == {"status": "warming up"}
        time.sleep(0.2)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    # The card says what the weights and the KV cache hold, once a replica has reported.
    wait_for(lambda: "weights" in httpx.get(f"{base_url}/v1/models").json()["data"][0])
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert card["weights"]["dtype"] == "float32" and card["weights"]["bytes"] > 135e6 * 4
    assert card["kv_cache"]["dtype"] == "float32" and card["kv_cache"]["tokens"] > 1000


def test_completion_matches_offline_greedy(client, llm_fp32):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    (expected,) = llm_fp32.generate(
        "The capital of France is", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_and_streaming_agree(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for event in stream:
        if event.usage:
            usage = event.usage
        for choice in event.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_max_tokens_seed_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    greedy = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0)
    stop = greedy.choices[0].text[6:9]
    stopped = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy.choices[0].text[: greedy.choices[0].text.index(stop)]
    seeded = [
        client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=10,
            temperature=1.0,
            seed=3,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 1}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "(", "max_tokens": 2}, 400),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]},
            400,
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, 400),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
            400,
        ),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * 9000}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ],
)
def test_bad_requests_get_openai_errors(base_url, path, body, status):
    if isinstance(body, bytes):
        r = httpx.post(
            base_url + path, content=body, headers={"content-type": "application/json"}, timeout=60
        )
    else:
        r = httpx.post(base_url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]


def test_dropped_http_stream_frees_blocks(base_url):
    llm = serve.get_deployment_handle("LLMServer", app_name=AGENT_APP)
    total = llm.stats.remote().result().num_total_blocks
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events >= 3:
                break  # leaving the block closes the connection mid-stream
    stats = None
    for _ in range(100):
        stats = llm.stats.remote().result()
        if stats.num_running == 0 and stats.num_free_blocks == total:
            break
        time.sleep(0.1)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == total


def test_replicas_report_to_the_coordinator(base_url):
    snapshot = {}
    for _ in range(50):
        snapshot = coordinator_snapshot(AGENT_APP)
        if snapshot:
            break
        time.sleep(0.1)
    assert len(snapshot) == 1
    (report,) = snapshot.values()
    assert isinstance(report, ReplicaReport)
    assert 0 < report.num_free_blocks <= report.num_total_blocks


def test_metrics_parse_with_vllm_names(client, base_url):
    client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{base_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:num_preemptions",
    ):
        assert name in families, name
    generated = sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    assert generated >= 4
    ttft_count = [
        s.value for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")
    ]
    assert ttft_count and ttft_count[0] >= 1


def test_tokenize_detokenize_and_model_card_as_vllm_shapes_them(base_url, llm_fp32):
    """What `vllm bench serve`, GuideLLM and vLLM clients call besides generation."""
    tokenizer = llm_fp32.engine.tokenizer
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert card["root"] and card["parent"] is None
    # The replica's own window, clipped to its 0.25 GB KV cache, not the model's 8192.
    snapshot = coordinator_snapshot(AGENT_APP)
    assert card["max_model_len"] == min(report.max_model_len for report in snapshot.values()) < 8192

    text = "The capital of France is"
    answer = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert answer["tokens"] == tokenizer(text).input_ids
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == card["max_model_len"]

    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    # The prompt tokens a chat completion reports are exactly these.
    reply = httpx.post(
        f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    ).json()
    assert reply["usage"]["prompt_tokens"] == chat["count"]

    back = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": answer["tokens"]})
    assert back.json() == {"prompt": tokenizer.decode(answer["tokens"])}

    for path, body, status in [
        ("/tokenize", {"prompt": text, "messages": messages}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"model": "other", "prompt": text}, 404),
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
    ]:
        response = httpx.post(f"{base_url}{path}", json=body)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["message"]


def test_responses_name_the_replica_that_served_them(base_url):
    (replica_id,) = coordinator_snapshot(AGENT_APP)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
    assert response.headers["x-kvserve-replica"] == replica_id
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.headers["x-kvserve-replica"] == replica_id
        assert "data: [DONE]" in list(response.iter_lines())


def test_request_id_header_is_echoed_on_streams_too(base_url):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    headers = {"x-request-id": "client-chosen-42"}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "client-chosen-42"
        assert "data: [DONE]" in list(response.iter_lines())
