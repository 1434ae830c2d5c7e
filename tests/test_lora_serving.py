"""LoRA adapters served beside the base model, vLLM's interface, on one real Serve app:
start-up adapters (lora_modules), /v1/load_lora_adapter and /v1/unload_lora_adapter,
adapters in /v1/models and gRPC ListModels, requests that name an adapter as their model
(openai client, gRPC stubs), bad adapters refused with a 400, and vLLM's LoRA gauge."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import grpc
import httpx
import openai
import pytest
import ray
import torch
from conftest import SERVE_GRPC_PORT, SERVE_HTTP_PORT, hf_greedy, save_lora_adapter, undeploy, wait_for
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from test_coordinator import report

from deployments.app import AppConfig, build_app
from deployments.cli import _lora_modules, main
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc
from router.generation import APIError
from router.lora_adapters import Adapters, LoRASettings
from router.placement.coordinator import Coordinator, LoRANameTaken, LoRARegistry

APP = "lora-test"
MODEL = "SmolLM2-135M-Instruct"
KEY = "lora-key"
MAX_LORA_RANK = 8
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_path) -> dict:
    """name -> folder: two good adapters of the bundled model, one over MAX_LORA_RANK,
    and one of a smaller Llama (another hidden size)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    paths = {name: root / name for name in ("startup", "runtime", "high_rank", "other_base")}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for name, rank, seed in (("startup", 8, 0), ("runtime", 4, 1), ("high_rank", 16, 2)):
        model = save_lora_adapter(model, paths[name], rank, seed, b_scale=0.1)
    tiny = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
    )
    torch.manual_seed(3)
    save_lora_adapter(LlamaForCausalLM(tiny), paths["other_base"], 8, 3, b_scale=0.1)
    return paths


@pytest.fixture(scope="module")
def base_url(ray_cluster, model_path, adapters):
    config = {
        "app_name": APP,
        "model": str(model_path),
        "served_model_name": MODEL,
        "api_keys": [KEY],
        "lora_modules": [f"startup={adapters['startup']}"],
        "engine_args": {
            "dtype": "float32",
            "kv_cache_memory_gb": 0.25,
            "max_loras": 2,
            "max_lora_rank": MAX_LORA_RANK,
        },
    }
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{SERVE_HTTP_PORT}/{APP}"
    undeploy(APP)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def stub(base_url):
    channel = grpc.insecure_channel(f"127.0.0.1:{SERVE_GRPC_PORT}")
    yield pb_grpc.LLMStub(channel)
    channel.close()


GRPC_META = [("application", APP), ("authorization", f"Bearer {KEY}")]


def load(base_url: str, name: str, path, headers=HEADERS) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=headers, timeout=30)


def unload(base_url: str, name: str, headers=HEADERS) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=30
    )


def cards(base_url: str) -> dict[str, dict]:
    response = httpx.get(f"{base_url}/v1/models", headers=HEADERS, timeout=30)
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def chat(client, model: str, max_tokens: int = 8, **extra):
    messages = [{"role": "user", "content": "Name a colour."}]
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


# Without the engine: the registry, the ingress's checks, the configuration.


def test_registry_ids_names_and_start_up_adapters():
    registry = LoRARegistry()
    first = registry.register_lora("a", "/x")
    with pytest.raises(LoRANameTaken):
        registry.register_lora("a", "/y")
    assert registry.unregister_lora("a") and not registry.unregister_lora("a")
    again = registry.register_lora("a", "/x")
    assert again.lora_int_id > first.lora_int_id > 0  # a new registration, a new id
    registry.seed_loras({"s": "/s"})
    assert registry.lora("s").lora_path == "/s"
    registry.unregister_lora("s")
    registry.seed_loras({"s": "/s"})  # once: a client's unload holds
    assert registry.lora("s") is None
    registry.seed_loras({"s": "/t"})  # redeployed from elsewhere
    assert registry.lora("s").lora_path == "/t"
    assert [lora.lora_name for lora in registry.loras()] == ["a", "s"]


def test_ingress_checks_adapters_without_a_coordinator(adapters, model_path):
    asyncio.run(check_ingress_adapters(adapters, model_path))


async def check_ingress_adapters(adapters, model_path):
    base_config = json.loads((model_path / "config.json").read_text())
    off = Adapters(None, MODEL, base_config, None)
    with pytest.raises(APIError, match="--enable-lora") as e:
        await off.load("a", str(adapters["runtime"]))
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        await off.resolve("a")
    assert e.value.status == 404
    assert await off.resolve(MODEL) is None and await off.resolve("") is None

    on = Adapters(
        LoRASettings(MAX_LORA_RANK, {"startup": str(adapters["startup"])}), MODEL, base_config, None
    )
    await on.start()
    assert (await on.resolve("startup")).lora_path == str(adapters["startup"])
    lora = await on.load("runtime", str(adapters["runtime"]))
    assert await on.resolve("runtime") == lora
    for name, path, status in [
        ("runtime", adapters["runtime"], 400),  # taken
        (MODEL, adapters["runtime"], 400),
        ("x", adapters["high_rank"], 400),
        ("x", adapters["other_base"], 400),
        ("x", "/no/such/adapter", 400),
    ]:
        with pytest.raises(APIError) as e:
            await on.load(name, str(path))
        assert e.value.status == status
    await on.unload("runtime")
    with pytest.raises(APIError) as e:
        await on.unload("runtime")
    assert e.value.status == 404
    with pytest.raises(APIError) as e:
        await on.resolve("runtime")
    assert e.value.status == 404


def test_config_checks_start_up_adapters(adapters, model_path):
    config = AppConfig(model=str(model_path), lora_modules=[f"good={adapters['runtime']}"])
    assert config.engine_args["enable_lora"] is True  # adapters imply it
    assert config.lora_settings() == LoRASettings(16, {"good": str(adapters["runtime"])})
    assert AppConfig(model=str(model_path)).lora_settings() is None
    with pytest.raises(ValueError, match="'big'.*max_lora_rank=8"):
        AppConfig(
            model=str(model_path),
            lora_modules={"big": str(adapters["high_rank"])},
            engine_args={"max_lora_rank": 8},
        )
    with pytest.raises(ValueError, match="'other'.*does not fit the base model"):
        AppConfig(model=str(model_path), lora_modules={"other": str(adapters["other_base"])})
    with pytest.raises(ValueError, match="name=path"):
        AppConfig(model=str(model_path), lora_modules=["no-path"])
    assert _lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="name=path"):
        _lora_modules(["a"])


# On the Serve app.


def test_start_up_adapter_is_listed_with_its_parent(base_url, adapters, stub):
    listed = cards(base_url)
    assert list(listed) == [MODEL, "startup"]
    assert listed["startup"]["parent"] == MODEL and listed[MODEL]["parent"] is None
    assert listed["startup"]["root"] == str(adapters["startup"])
    assert listed["startup"]["object"] == "model"
    models = stub.ListModels(pb.ListModelsRequest(), metadata=GRPC_META).models
    assert [m.id for m in models] == [MODEL, "startup"]


def test_load_and_unload_need_the_api_key(base_url, adapters):
    assert load(base_url, "nokey", adapters["runtime"], headers={}).status_code == 401
    assert unload(base_url, "startup", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert "nokey" not in cards(base_url) and "startup" in cards(base_url)


def test_bad_adapters_are_refused_and_the_server_keeps_serving(base_url, client, adapters):
    cases = {
        "high_rank": ("rank 16, over max_lora_rank=8", adapters["high_rank"]),
        "other_base": ("does not fit the base model", adapters["other_base"]),
        "missing": ("not found", adapters["startup"].parent / "missing"),
    }
    for name, (message, path) in cases.items():
        response = load(base_url, name, path)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    taken = load(base_url, "startup", adapters["runtime"])
    assert taken.status_code == 400 and "already been loaded" in taken.json()["error"]["message"]
    gone = unload(base_url, "never-loaded")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert list(cards(base_url)) == [MODEL, "startup"]
    assert chat(client, MODEL, max_tokens=2).choices[0].message.content


def test_unknown_model_is_404_in_openai_format(client, stub):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-adapter")
    error = e.value.body
    assert "no-such-adapter" in error["message"] and error["type"] == "not_found_error"
    assert error["param"] == "model"
    request = pb.GenerateRequest(model="no-such-adapter", prompt="Hi", params=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(request, metadata=GRPC_META)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# Generation with adapters (the replicas load them on demand).


def test_runtime_adapter_serves_chat_and_completions_until_unloaded(base_url, client, adapters):
    response = load(base_url, "runtime", adapters["runtime"])
    assert response.status_code == 200, response.text
    assert "runtime" in response.text
    listed = cards(base_url)
    assert listed["runtime"]["parent"] == MODEL and listed["runtime"]["root"] == str(adapters["runtime"])

    base, tuned = chat(client, MODEL, logprobs=True), chat(client, "runtime", logprobs=True)
    assert tuned.model == "runtime" and base.model == MODEL
    # Any adapter moves the logits, if not always the greedy tokens.
    assert logprobs(tuned.choices[0].logprobs.content) != logprobs(base.choices[0].logprobs.content)
    stream = chat(client, "runtime", stream=True)
    events = list(stream)
    assert {event.model for event in events} == {"runtime"}
    streamed = "".join(choice.delta.content or "" for event in events for choice in event.choices)
    assert streamed == tuned.choices[0].message.content

    prompt = "The capital of France is"
    whole = client.completions.create(model="runtime", prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    assert whole.model == "runtime"
    pieces = client.completions.create(
        model="runtime", prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(event.choices[0].text for event in pieces) == whole.choices[0].text
    base_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    assert base_text.choices[0].logprobs.token_logprobs != whole.choices[0].logprobs.token_logprobs

    # The Messages API goes through the same model check.
    messages = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)
    message = messages.messages.create(
        model="runtime",
        max_tokens=8,
        messages=[{"role": "user", "content": "Name a colour."}],
        extra_body={"temperature": 0},  # the SDK's create() no longer takes it; the API does
    )
    assert message.model == "runtime"
    assert message.content[0].text == tuned.choices[0].message.content

    response = unload(base_url, "runtime")
    assert response.status_code == 200, response.text
    assert "runtime" not in cards(base_url)
    with pytest.raises(openai.NotFoundError):
        chat(client, "runtime")
    assert chat(client, MODEL).choices[0].message.content == base.choices[0].message.content
    # Loaded again (a new registration), it serves as before.
    assert load(base_url, "runtime", adapters["runtime"]).status_code == 200
    assert chat(client, "runtime").choices[0].message.content == tuned.choices[0].message.content
    assert unload(base_url, "runtime").status_code == 200


def test_load_and_unload_under_load_lose_nothing(base_url, client, adapters):
    """Adapters loaded and unloaded while requests of the base model and of adapters (the
    unloaded one's too) run: every request finishes whole, every block comes back, and
    the replica drops the unloaded adapter once its last request is done."""
    assert load(base_url, "busy", adapters["runtime"]).status_code == 200
    llm = serve.get_deployment_handle("LLMServer", app_name=APP)
    total = llm.stats.remote().result().num_total_blocks

    def complete(model: str):
        return client.completions.create(
            model=model,
            prompt="Count to fifty:",
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    models = ["busy", "busy", "startup", MODEL]
    with ThreadPoolExecutor(len(models)) as pool:
        futures = [pool.submit(complete, model) for model in models]
        # Until they all run: the unload must find its adapter's requests running.
        wait_for(lambda: llm.stats.remote().result().num_running == len(models), timeout_s=30)
        assert unload(base_url, "busy").status_code == 200
        assert load(base_url, "extra", adapters["runtime"]).status_code == 200
        results = [future.result(timeout=120) for future in futures]
    assert [r.choices[0].finish_reason for r in results] == ["length"] * len(models)
    assert [r.usage.completion_tokens for r in results] == [40] * len(models)
    assert [r.model for r in results] == models

    stats = None
    for _ in range(100):
        stats = llm.stats.remote().result()
        if stats.num_running == 0 and stats.num_free_blocks == total and "busy" not in stats.loras:
            break
        time.sleep(0.1)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == total
    assert "busy" not in stats.loras, "the unloaded adapter is dropped once no request uses it"
    assert chat(client, "extra").model == "extra"
    assert unload(base_url, "extra").status_code == 200


def logprobs(content) -> list[float]:
    return [entry.logprob for entry in content]


def test_adapter_output_matches_hf_peft(client, adapters, model_path, tokenizer):
    """The served adapter against the oracle: HF generate on the PEFT model, greedy, fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    out = client.completions.create(
        model="startup", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters["startup"]).eval()
    expected = hf_greedy(model, tokenizer(prompt).input_ids, 8, eos_ids=set())
    assert out.choices[0].text == tokenizer.decode(expected)


def test_grpc_generate_with_an_adapter(client, stub):
    params = pb.SamplingParams(max_tokens=8, temperature=0)
    request = pb.GenerateRequest(model="startup", prompt="The capital of France is", params=params)
    unary = stub.Generate(request, metadata=GRPC_META)
    assert unary.model == "startup"
    http = client.completions.create(
        model="startup", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert unary.text == http.choices[0].text
    pieces = list(stub.GenerateStream(request, metadata=GRPC_META))
    assert "".join(p.text for p in pieces) == unary.text and {p.model for p in pieces} == {"startup"}
    chat_request = pb.ChatRequest(
        model="startup", messages=[pb.ChatMessage(role="user", content="Name a colour.")], params=params
    )
    assert (
        stub.Chat(chat_request, metadata=GRPC_META).text == chat(client, "startup").choices[0].message.content
    )


def test_metrics_report_lora_requests_info(base_url, client):
    """vLLM's gauge: its labels name the adapters of running and waiting requests, its
    value is when that was last reported (seconds since the epoch)."""
    with client.chat.completions.create(
        model="startup",
        messages=[{"role": "user", "content": "Count to fifty."}],
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        running = None
        for _ in stream:  # while it generates, the replica reports it running
            samples = lora_samples(base_url)
            running = next((s for s in samples if s.labels["running_lora_adapters"] == "startup"), running)
            if running is not None:
                break
    assert running is not None, "the adapter's request never showed as running"
    assert running.labels["max_lora"] == "2" and running.labels["waiting_lora_adapters"] == ""
    assert abs(running.value - time.time()) < 30


def lora_samples(base_url: str) -> list:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("vllm:lora_requests_info")
    return list(family.samples) if family else []


def test_coordinator_answers_reports_with_the_registered_ids(ray_cluster):
    """What a replica learns from each report: which adapters are still registered."""
    coordinator = Coordinator.remote()
    try:
        first = ray.get(coordinator.register_lora.remote("a", "/a"))
        second = ray.get(coordinator.register_lora.remote("b", "/b"))
        with pytest.raises(LoRANameTaken):
            ray.get(coordinator.register_lora.remote("a", "/c"))
        assert ray.get(coordinator.report.remote("r", report(1, 0.0))) == [
            first.lora_int_id,
            second.lora_int_id,
        ]
        assert ray.get(coordinator.unregister_lora.remote("a"))
        assert ray.get(coordinator.report.remote("r", report(1, 0.0))) == [second.lora_int_id]
        assert ray.get(coordinator.lora.remote("b")) == second
    finally:
        ray.kill(coordinator)


def test_cli_stops_at_a_bad_start_up_adapter(adapters, tmp_path, capsys):
    """Before Ray starts: one line that names the adapter, exit code 2. (`serve` and
    `batch` share the check; batch runs in-process here, which `serve`, with its signal
    handlers, should not.)"""
    bad = f"big={adapters['high_rank']}"
    code = main(
        [
            "batch",
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out"),
            "--max-lora-rank",
            "8",
            "--lora-modules",
            bad,
        ]
    )
    assert code == 2
    error = capsys.readouterr().err
    assert "kvserve: error: lora_modules: adapter 'big'" in error and "max_lora_rank=8" in error
