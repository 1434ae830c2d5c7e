"""The gRPC API through Ray Serve's own gRPC proxy, called with real generated stubs."""

import concurrent.futures
import json
import time

import grpc
import httpx
import pytest
import ray
from conftest import (
    AGENT_APP,
    SERVE_GRPC_PORT,
    SERVE_HTTP_PORT,
    in_ingress,
    replica_actor,
    undeploy,
    wait_for,
)
from ray import serve

from deployments.app import build_app
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc
from wire.messages import ReplicaReport

APP = AGENT_APP
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"


def deploy(name: str, **config) -> None:
    engine = {"dtype": "float32", "kv_cache_memory_gb": 0.25, **config.pop("engine_args", {})}
    app = build_app({"app_name": name, "served_model_name": MODEL, "engine_args": engine, **config})
    serve.run(app, name=name, route_prefix=f"/{name}")


@pytest.fixture(scope="module")
def stub(agent_app):
    """On the session's app (conftest.py's agent_app: the bundled model in fp32, its chat
    template rendering tools)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}")
    yield pb_grpc.LLMStub(channel)
    channel.close()


def meta(app: str = APP, key: str | None = None) -> list[tuple[str, str]]:
    pairs = [("application", app)]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    return pairs


def greedy(max_tokens: int = 12, **extra) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, **extra)


def test_list_models(stub):
    assert [m.id for m in stub.ListModels(pb.ListModelsRequest(), metadata=meta()).models] == [MODEL]


def test_unary_and_stream_agree_and_match_http(stub):
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=greedy(logprobs=2))
    unary = stub.Generate(request, metadata=meta())
    pieces = list(stub.GenerateStream(request, metadata=meta()))
    assert unary.text and unary.finish_reason == "length"
    assert "".join(p.text for p in pieces) == unary.text
    assert [t for p in pieces for t in p.token_ids] == list(unary.token_ids)
    assert pieces[-1].finish_reason == "length" and pieces[-1].usage.completion_tokens == 12
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + 12
    assert len(unary.logprobs) == 12 and all(len(lp.top_logprobs) >= 1 for lp in unary.logprobs)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    http = httpx.post(
        f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}/v1/completions", json=body, timeout=60
    ).json()
    assert http["choices"][0]["text"] == unary.text


def test_chat_unary_and_stream(stub):
    request = pb.ChatRequest(
        model=MODEL,
        messages=[pb.ChatMessage(role="user", content="Name a fruit.")],
        params=pb.SamplingParams(max_tokens=16, temperature=0.7, seed=3, stop=["\n"]),
    )
    unary = stub.Chat(request, metadata=meta())
    streamed = "".join(p.text for p in stub.ChatStream(request, metadata=meta()))
    assert unary.text and streamed == unary.text  # same seed, same text
    assert "\n" not in unary.text


def test_n_samples_response_format_and_tools(stub):
    request = pb.GenerateRequest(
        model=MODEL, prompt=PROMPT, params=pb.SamplingParams(max_tokens=5, n=3, seed=1, ignore_eos=True)
    )
    unary = stub.Generate(request, metadata=meta())
    assert [c.index for c in unary.choices] == [0, 1, 2] and unary.text == unary.choices[0].text
    assert unary.usage.completion_tokens == 15
    pieces = list(stub.GenerateStream(request, metadata=meta()))
    assert {p.index for p in pieces} == {0, 1, 2}
    assert sum(1 for p in pieces if p.finish_reason) == 3 and pieces[-1].usage.completion_tokens == 15

    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "maxLength": 15}, "ripe": {"type": "boolean"}},
        "required": ["fruit", "ripe"],
        "additionalProperties": False,
    }
    constrained = pb.SamplingParams(
        max_tokens=60, seed=2, response_format=pb.ResponseFormat(json_schema=json.dumps(schema))
    )
    chat = pb.ChatRequest(
        model=MODEL, messages=[pb.ChatMessage(role="user", content="A fruit as JSON.")], params=constrained
    )
    answer = json.loads(stub.Chat(chat, metadata=meta()).text)
    assert set(answer) == {"fruit", "ripe"} and isinstance(answer["ripe"], bool)
    choice = pb.SamplingParams(
        max_tokens=5, response_format=pb.ResponseFormat(choice=pb.ChoiceList(choices=["a", "b"]))
    )
    assert (
        stub.Generate(pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=choice), metadata=meta()).text
        in "ab"
    )

    tool = pb.Tool(
        name="add",
        description="Add two integers",
        parameters=json.dumps(
            {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
        ),
    )
    ask = pb.ChatRequest(
        model=MODEL,
        messages=[pb.ChatMessage(role="user", content="What is 2 + 3?")],
        params=pb.SamplingParams(max_tokens=60, temperature=0),
        tools=[tool],
        tool_choice="add",
    )
    called = stub.Chat(ask, metadata=meta())
    assert called.finish_reason == "tool_calls" and [c.name for c in called.tool_calls] == ["add"]
    assert set(json.loads(called.tool_calls[0].arguments)) <= {"a", "b"}
    streamed = [c for p in stub.ChatStream(ask, metadata=meta()) for c in p.tool_calls]
    assert [c.name for c in streamed] == ["add"]

    bad = pb.SamplingParams(response_format=pb.ResponseFormat(json_schema="{not json"))
    expect_status(
        lambda: stub.Generate(pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=bad), metadata=meta()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "json_schema",
    )
    unknown_tool = pb.ChatRequest(model=MODEL, messages=ask.messages, tools=[tool], tool_choice="mul")
    expect_status(lambda: stub.Chat(unknown_tool, metadata=meta()), grpc.StatusCode.INVALID_ARGUMENT, "mul")


def test_server_reflection_describes_the_service(stub):
    """Serve's gRPC proxy answers reflection, so grpcurl needs no .proto file."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "kvserve.LLM" in database.get_services()
        service = DescriptorPool(database).FindServiceByName("kvserve.LLM")
        assert {m.name for m in service.methods} >= {
            "Generate",
            "GenerateStream",
            "Chat",
            "ChatStream",
            "ListModels",
        }
        request = service.methods_by_name["Chat"].input_type
        assert {"messages", "params", "tools", "tool_choice"} <= set(request.fields_by_name)


def expect_status(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not hasattr(result, "text"):  # a stream: errors surface while iterating
            list(result)
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details()


def test_invalid_argument_and_not_found(stub):
    bad = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=pb.SamplingParams(temperature=5))
    expect_status(
        lambda: stub.Generate(bad, metadata=meta()), grpc.StatusCode.INVALID_ARGUMENT, "temperature"
    )
    expect_status(
        lambda: stub.GenerateStream(bad, metadata=meta()), grpc.StatusCode.INVALID_ARGUMENT, "temperature"
    )
    too_long = pb.GenerateRequest(model=MODEL, prompt="word " * 20000, params=greedy())
    expect_status(lambda: stub.Generate(too_long, metadata=meta()), grpc.StatusCode.INVALID_ARGUMENT, "")
    empty_chat = pb.ChatRequest(model=MODEL)
    expect_status(
        lambda: stub.Chat(empty_chat, metadata=meta()), grpc.StatusCode.INVALID_ARGUMENT, "messages"
    )
    unknown = pb.GenerateRequest(model="gpt-5", prompt=PROMPT)
    expect_status(lambda: stub.Generate(unknown, metadata=meta()), grpc.StatusCode.NOT_FOUND, "gpt-5")


def llm_stats(app: str) -> ReplicaReport:
    return serve.get_deployment_handle("LLMServer", app_name=app).stats.remote().result()


def test_cancel_mid_stream_frees_blocks(stub):
    total = llm_stats(APP).num_total_blocks
    request = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=greedy(max_tokens=2000, ignore_eos=True))
    stream = stub.GenerateStream(request, metadata=meta())
    next(stream)
    assert llm_stats(APP).num_free_blocks < total
    stream.cancel()
    deadline = time.monotonic() + 30
    while llm_stats(APP).num_free_blocks != total:
        assert time.monotonic() < deadline, "blocks were not freed after the cancel"
        time.sleep(0.1)
    assert llm_stats(APP).num_running == 0


def test_16_concurrent_streams(stub):
    def run(i: int) -> str:
        request = pb.GenerateRequest(model=MODEL, prompt=f"Count to {i}:", params=greedy(max_tokens=8))
        return "".join(p.text for p in stub.GenerateStream(request, metadata=meta()))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, range(16)))
    singles = [
        stub.Generate(
            pb.GenerateRequest(model=MODEL, prompt=f"Count to {i}:", params=greedy(8)), metadata=meta()
        )
        for i in (0, 15)
    ]
    assert texts[0] == singles[0].text and texts[15] == singles[1].text
    assert all(texts)


def test_resource_exhausted_and_unavailable(ray_cluster, model_path):
    """One replica that takes one request at a time and queues one more: a third
    concurrent request is refused. Then the replica is killed mid-stream, with migration
    off (tests/test_migration.py has the stream move on instead)."""
    settings = {"max_ongoing_requests": 1, "max_queued_requests": 1, "max_migrations": 0}
    deploy("grpc-busy", model=str(model_path), **settings)
    try:
        stub = pb_grpc.LLMStub(grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}"))
        long = pb.GenerateRequest(model=MODEL, prompt=PROMPT, params=greedy(max_tokens=2000, ignore_eos=True))
        first = stub.GenerateStream(long, metadata=meta("grpc-busy"))
        next(first)
        second = stub.GenerateStream(long, metadata=meta("grpc-busy"))

        def queued_for_the_replica(ingress) -> int:
            """What the ingress's handle holds until the replica takes it (Ray 2.60's
            private attributes). Nested, so that in_ingress can send it by value."""
            return ingress.llms[0]._router._asyncio_router._metrics_manager.num_queued_requests

        # Until the second waits in the ingress's queue for the replica: its only slot.
        wait_for(lambda: in_ingress("grpc-busy", queued_for_the_replica) == 1)
        expect_status(
            lambda: stub.Generate(long, metadata=meta("grpc-busy")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "overloaded",
        )
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        http = httpx.post(
            f"http://127.0.0.1:{SERVE_HTTP_PORT}/grpc-busy/v1/completions", json=body, timeout=60
        )
        assert http.status_code == 429 and http.headers["retry-after"] == "1"
        assert http.json()["error"]["type"] == "rate_limit_error"
        second.cancel()
        ray.kill(replica_actor("grpc-busy"), no_restart=True)
        with pytest.raises(grpc.RpcError) as info:
            list(first)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    finally:
        undeploy("grpc-busy")
