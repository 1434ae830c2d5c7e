"""Hostile and malformed input against a real Serve app with API keys: every bad request
gets a 4xx with OpenAI's error body, schemathesis finds no 5xx and no schema violation,
and the keys never reach Ray's logs."""

import json
import pathlib
import uuid

import anthropic
import grpc
import httpx
import pytest
import ray
import schemathesis
from conftest import SERVE_GRPC_PORT, SERVE_HTTP_PORT, undeploy
from hypothesis import HealthCheck, given, settings
from ray import serve
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from deployments.app import build_app
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc

APP = "input-test"
MODEL = "SmolLM2-135M-Instruct"
KEY = f"sk-test-{uuid.uuid4().hex}"
SECOND_KEY = f"sk-second-{uuid.uuid4().hex}"
WRONG_KEY = f"sk-wrong-{uuid.uuid4().hex}"
BASE = f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def app(ray_cluster, model_path):
    config = {
        "app_name": APP,
        "model": str(model_path),
        "served_model_name": MODEL,
        "api_keys": [KEY, SECOND_KEY],
        "max_request_bytes": MAX_BODY,
        # A short context keeps every generated answer short, whatever max_tokens says.
        "engine_args": {"num_kv_blocks": 64, "max_model_len": 48},
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield
    undeploy(APP)


def post(path: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **headers}
    return httpx.post(BASE + path, content=content, headers=headers, timeout=60)


def assert_openai_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status


COMPLETION = {"model": MODEL, "prompt": "Hello"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"model": "\xff\xfe", "prompt": "hi"}'),  # invalid UTF-8
        ("/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": "\xc3\x28"}'),
        ("/v1/completions", b"\x00\x01\x02"),
        ("/v1/completions", b"[]"),
        ("/v1/completions", {**COMPLETION, "prompt": 5}),
        ("/v1/completions", {**COMPLETION, "prompt": []}),
        ("/v1/completions", {**COMPLETION, "prompt": [-1]}),
        ("/v1/completions", {**COMPLETION, "prompt": [10**12]}),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 10**30]}),  # beyond 64 bits
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}),
        ("/v1/completions", {**COMPLETION, "max_tokens": -5}),
        ("/v1/completions", {**COMPLETION, "max_tokens": 1e30}),
        ("/v1/completions", {**COMPLETION, "n": 0}),
        ("/v1/completions", {**COMPLETION, "n": 1000}),
        ("/v1/completions", {**COMPLETION, "logprobs": 21}),
        ("/v1/completions", {**COMPLETION, "logprobs": -1}),
        ("/v1/completions", {**COMPLETION, "seed": 2**80}),
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}),
        # JSON booleans are not numbers (pydantic's lax mode would read them as 1 and 0)
        ("/v1/completions", {**COMPLETION, "repetition_penalty": True}),
        ("/v1/completions", {**COMPLETION, "max_tokens": True}),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"5": False}}),
        ("/v1/completions", {**COMPLETION, "prompt": [1, True]}),
        ("/v1/chat/completions", {**CHAT, "temperature": False}),
        ("/v1/completions", {**COMPLETION, "stop_token_ids": [-3]}),
        ("/v1/completions", {**COMPLETION, "stop": [""]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 7}]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 100, "logprobs": True}),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}),
        # This app serves the model's directory, whose own chat template renders no tools.
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ],
)
def test_bad_input_gets_400(app, path, body):
    assert_openai_error(post(path, body), 400)


def test_absurd_max_tokens_is_clipped_to_the_context(app):
    r = post("/v1/completions", {**COMPLETION, "max_tokens": 10**12, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["total_tokens"] == 48


def test_oversized_bodies_get_413_declared_or_streamed(app):
    body = json.dumps({**COMPLETION, "prompt": "x" * MAX_BODY}).encode()
    assert_openai_error(post("/v1/completions", body), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    r = httpx.post(BASE + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413)
    assert post("/v1/completions", {**COMPLETION, "max_tokens": 2}).status_code == 200


def test_cors_is_off(app):
    """No CORS headers, so a browser page from another origin cannot read answers."""
    origin = {"Origin": "http://elsewhere.example"}
    r = httpx.get(BASE + "/v1/models", headers={**AUTH, **origin})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    preflight = {**origin, "Access-Control-Request-Method": "POST"}
    r = httpx.options(BASE + "/v1/completions", headers=preflight)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers


def test_keys_are_required_and_never_logged(app):
    assert_openai_error(post("/v1/completions", COMPLETION, Authorization=f"Bearer {WRONG_KEY}"), 401)
    assert_openai_error(httpx.get(BASE + "/v1/models", headers={"Authorization": WRONG_KEY}), 401)
    assert httpx.get(BASE + "/v1/models", headers=AUTH).status_code == 200
    stub = pb_grpc.LLMStub(grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}"))
    for key in (KEY, WRONG_KEY):
        metadata = (("application", APP), ("authorization", f"Bearer {key}"))
        request = pb.GenerateRequest(model=MODEL, prompt="Hi", params=pb.SamplingParams(max_tokens=2))
        try:
            stub.Generate(request, metadata=metadata)
        except grpc.RpcError as e:
            assert key == WRONG_KEY and e.code() == grpc.StatusCode.UNAUTHENTICATED
    logs = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert any(p.name.startswith("replica_") for p in files)  # the replicas' logs are there
    for path in files:
        text = path.read_bytes()
        assert all(key.encode() not in text for key in (KEY, SECOND_KEY, WRONG_KEY)), path


def test_any_of_the_keys_opens_grpc_http_and_the_messages_routes(app):
    """With two keys, either one works, over gRPC, HTTP, and the Messages routes with the
    x-api-key header Anthropic's SDK sends; no key or a wrong one is refused."""
    stub = pb_grpc.LLMStub(grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}"))
    request = pb.GenerateRequest(
        model=MODEL,
        prompt="The three primary colours are",
        params=pb.SamplingParams(max_tokens=4, temperature=0),
    )
    for key in (None, WRONG_KEY):
        metadata = [("application", APP)] + ([("authorization", f"Bearer {key}")] if key else [])
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()
    assert stub.Generate(
        request, metadata=[("application", APP), ("authorization", f"Bearer {SECOND_KEY}")]
    ).text
    assert httpx.get(BASE + "/v1/models").status_code == 401
    assert httpx.get(BASE + "/v1/models", headers=AUTH).status_code == 200
    question = [{"role": "user", "content": "Hi"}]
    keyed = anthropic.Anthropic(base_url=BASE, api_key=SECOND_KEY, max_retries=0)
    assert keyed.messages.count_tokens(model=MODEL, messages=question).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as info:
        keyed.with_options(api_key=WRONG_KEY).messages.count_tokens(model=MODEL, messages=question)
    assert info.value.body["error"]["type"] == "authentication_error"


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error_and_no_schema_violation(app, mode):
    """Bounded: 25 examples per operation and mode, served within a 48-token context."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{BASE}/openapi.json", timeout=30).json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break: no parameters, no body

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=25,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def call(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = MODEL  # still schema-valid; reaches generation, not 404
            case.call_and_validate(base_url=BASE, headers=AUTH, timeout=30, checks=CHECKS)

        call()
