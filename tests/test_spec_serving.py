"""Speculative decoding served, vLLM's interface: `speculative_config` on a real Serve app
of the bundled model (fp32), greedy output equal to the offline engine's without
speculation, vLLM's vllm:spec_decode_* counters on /metrics, and the per-request opt-out
(`"speculative": false`), which every API (and a batch row) carries to SamplingParams."""

import httpx
import openai
import pytest
from conftest import SERVE_HTTP_PORT, undeploy, wait_for
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deployments.app import build_app
from deployments.batch import SAMPLING_FIELDS
from router.api.anthropic import MessagesRequest, chat_request
from router.api.grpc_api import sampling_fields
from router.api.protocol import ChatCompletionRequest, CompletionRequest
from router.api.protos import kvserve_pb2 as pb
from router.api.response_store import ResponseStore
from router.api.responses import ResponsesRequest, prepare
from wire.sampling_params import SamplingParams

APP = "spec-test"
MODEL = "SmolLM2-135M-Instruct"
K = 4
SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
# A prompt whose answer repeats it: n-gram lookup finds its continuations in the prompt.
FRUITS = "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine"
MESSAGES = [{"role": "user", "content": f"Repeat this list exactly: {FRUITS}."}]
PROMPT = f"Here is a list of fruits: {FRUITS}.\nThe same list again: apple,"
MAX_TOKENS = 48


def test_every_api_carries_the_opt_out_to_sampling_params():
    """HTTP (chat, completions, Messages, Responses) and gRPC: the field reaches the
    SamplingParams fields; absent, it is left to the default (speculate)."""
    chat = ChatCompletionRequest(messages=MESSAGES, speculative=False)
    assert chat.sampling_fields()["speculative"] is False
    assert "speculative" not in ChatCompletionRequest(messages=MESSAGES).sampling_fields()
    assert CompletionRequest(prompt="hi", speculative=False).sampling_fields()["speculative"] is False
    # Strictly a boolean: a lax one would read "no" or 0 as false.
    for model, fields in (
        (ChatCompletionRequest, {"messages": MESSAGES}),
        (CompletionRequest, {"prompt": "hi"}),
    ):
        for value in ("no", 0, "false"):
            with pytest.raises(ValueError, match="valid boolean"):
                model(**fields, speculative=value)
    messages = MessagesRequest(max_tokens=8, messages=MESSAGES, speculative=False)
    assert chat_request(messages).sampling_fields()["speculative"] is False
    turn = prepare(ResponsesRequest(input="hi", speculative=False), ResponseStore())
    assert turn.chat.sampling_fields()["speculative"] is False
    assert sampling_fields(pb.SamplingParams(speculative=False))["speculative"] is False
    assert "speculative" not in sampling_fields(pb.SamplingParams())
    assert "speculative" in SAMPLING_FIELDS  # what a batch row may set


@pytest.fixture(scope="module")
def base_url(ray_cluster, model_path):
    config = {
        "app_name": APP,
        "model": str(model_path),
        "served_model_name": MODEL,
        "engine_args": {
            "dtype": "float32",
            "kv_cache_memory_gb": 0.25,
            "speculative_config": SPECULATIVE_CONFIG,
        },
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"
    undeploy(APP)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def spec_metrics(base_url: str) -> dict:
    """/metrics' vllm:spec_decode_* totals (per_pos as a list by position), and the
    prefix-cache queries, which date the replica report they come from."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values: dict = {"per_pos": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                values["per_pos"][int(s.labels["position"])] = s.value
            elif s.name.startswith("vllm:spec_decode") or s.name == "vllm:prefix_cache_queries_total":
                values[s.name] = s.value
    values["per_pos"] = [values["per_pos"][p] for p in sorted(values["per_pos"])]
    return values


def settled_metrics(base_url: str):
    """The replica's report, asked for now (after the requests sent so far finished), and
    /metrics once the coordinator has a report at least as new."""
    llm = serve.get_deployment_handle("LLMServer", app_name=APP)
    fresh = llm.stats.remote().result()
    assert fresh.num_running == 0 and fresh.num_waiting == 0
    queries = "vllm:prefix_cache_queries_total"
    wait_for(lambda: spec_metrics(base_url).get(queries, 0) >= fresh.prefix_cache_queries, timeout_s=30)
    wait_for(
        lambda: (
            spec_metrics(base_url).get("vllm:spec_decode_num_drafts_total", -1)
            >= fresh.spec_decode.num_drafts
        ),
        timeout_s=30,
    )
    return fresh, spec_metrics(base_url)


def test_greedy_output_equals_the_offline_engine_without_speculation(client, llm_fp32):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    (want_chat,) = llm_fp32.chat(MESSAGES, greedy, use_tqdm=False)
    (want_completion,) = llm_fp32.generate(PROMPT, greedy, use_tqdm=False)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == want_chat.outputs[0].text
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == want_completion.outputs[0].text


def test_metrics_count_drafts_and_acceptances_by_position(client, base_url):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    fresh, metrics = settled_metrics(base_url)
    assert fresh.num_speculative_tokens == K
    drafts = metrics["vllm:spec_decode_num_drafts_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0, metrics
    assert drafts <= metrics["vllm:spec_decode_num_draft_tokens_total"] <= K * drafts
    per_pos = metrics["per_pos"]
    assert len(per_pos) == K and sum(per_pos) == accepted
    # An accepted token at position i means every earlier one was accepted too.
    assert all(a >= b for a, b in zip([drafts, *per_pos[:-1]], per_pos, strict=True)), per_pos


def test_a_request_that_opts_out_proposes_nothing(client, base_url):
    before_report, before = settled_metrics(base_url)
    assert before["vllm:spec_decode_num_drafts_total"] > 0  # this prompt does draft when allowed
    for stream in (False, True):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=stream,
            extra_body={"speculative": False},
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in answer)
            if stream
            else answer.choices[0].message.content
        )
        assert text
    after_report, after = settled_metrics(base_url)
    assert after_report.prefix_cache_queries > before_report.prefix_cache_queries  # both requests ran
    assert after_report.spec_decode == before_report.spec_decode
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert after[f"vllm:spec_decode_{name}_total"] == before[f"vllm:spec_decode_{name}_total"], name
    assert after["per_pos"] == before["per_pos"]


def test_a_non_boolean_opt_out_is_a_400(client, base_url):
    error = "speculative: Input should be a valid boolean"
    with pytest.raises(openai.BadRequestError, match=error):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"speculative": "no"}
        )
    with pytest.raises(openai.BadRequestError, match=error):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"speculative": 0})
    messages = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "speculative": "no"}
    r = httpx.post(f"{base_url}/v1/messages", json=messages, timeout=60)
    assert r.status_code == 400 and error in r.text, r.text
    r = httpx.post(
        f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi", "speculative": "no"}, timeout=60
    )
    assert r.status_code == 400 and error in r.text, r.text
