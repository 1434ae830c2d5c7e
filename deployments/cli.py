"""The `kvserve` command line."""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback

import psutil


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    model_args = argparse.ArgumentParser(add_help=False)
    model_args.add_argument(
        "--model",
        default=None,
        help="hub id (org/name), local HF directory or .gguf file (default: the bundled SmolLM2)",
    )
    model_args.add_argument("--revision", default=None, help="of a hub id: branch, tag or commit")
    model_args.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    model_args.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=["auto", "gemm.c", "onednn", "torch"],
        help="on CPU: auto picks each linear's kernel per row count by measurement on this machine "
        "(cached in ~/.cache/kvserve/kernels); a name forces it, for A/B runs",
    )
    model_args.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "fp8"],
        help="int8 (CPUs and GPUs) or fp8 (GPUs of compute capability 8.9+): each decoder linear's "
        "weight in 8 bits, its activations quantized per token",
    )
    model_args.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="the KV cache's element type; fp8 (e4m3) or fp8_e5m2 holds twice bf16's tokens in "
        "the same memory (default auto: the model's dtype)",
    )
    model_args.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices (GPUs, or CPU processes) each replica's model is split over",
    )

    # LoRA adapters (vLLM's flags), for `serve` and `batch`.
    lora_args = argparse.ArgumentParser(add_help=False)
    lora_args.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the model (implied by --lora-modules)",
    )
    lora_args.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve from the start: name=path of a local PEFT folder, "
        'or JSON {"name": ..., "path": ...}',
    )
    lora_args.add_argument("--max-loras", type=int, default=1, help="most adapters in one engine step")
    lora_args.add_argument("--max-lora-rank", type=int, default=16, help="highest adapter rank accepted")
    lora_args.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters a replica keeps loaded, least recently used dropped past it (default: --max-loras)",
    )

    # Speculative decoding (vLLM's flag), for `serve` and `batch`.
    spec_args = argparse.ArgumentParser(add_help=False)
    spec_args.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or \'{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 4}\'',
    )

    gen = commands.add_parser(
        "generate", parents=[model_args], help="generate text offline and stream it to the terminal"
    )
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default: on)",
    )

    srv = commands.add_parser(
        "serve",
        parents=[model_args, lora_args, spec_args],
        help="serve the OpenAI-compatible HTTP API on a local Ray",
    )
    srv.add_argument("--served-model-name", default=None, help="the model name clients send")
    srv.add_argument("--replicas", type=int, default=1)
    srv.add_argument(
        "--router",
        default="kv",
        choices=["kv", "pow2"],
        help="kv: by free KV blocks and cached prefix (default); pow2: Serve's power-of-two choices",
    )
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, local only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=9000)
    srv.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this key (repeatable); KVSERVE_API_KEYS takes comma-separated keys too",
    )
    srv.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    srv.add_argument(
        "--chat-template",
        help="instead of the model's: a Jinja file, or a template that ships with kvserve "
        '("chatml_tools": ChatML with Hermes tool calls, for SmolLM2)',
    )
    srv.add_argument(
        "--cpu-cores",
        default="auto",
        help='CPU serving: cores to pin the replica to, e.g. "2,3" (one thread each); '
        '"auto" (default): all but the first, with one replica, and every core for long '
        'prefill steps; "none": no pinning',
    )
    srv.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="requests a replica lets wait for KV room; past it: another replica, then 429",
    )
    srv.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs (default): in arrival order; priority: by each request's `priority`, lower first",
    )

    bat = commands.add_parser(
        "batch",
        parents=[model_args, lora_args, spec_args],
        help="run a JSONL/Parquet file of prompts through Ray Data",
    )
    bat.add_argument("input", help="JSONL or Parquet rows with `prompt` or `messages`")
    bat.add_argument("output", help="JSONL file, or a .parquet directory")
    bat.add_argument("--min-replicas", type=int, default=1, help="engine actors to keep")
    bat.add_argument("--max-replicas", type=int, default=2, help="engine actors to scale up to")
    bat.add_argument("--batch-size", type=int, default=64, help="rows per engine call")
    bat.add_argument("--resume", action="store_true", help="skip the ids already in OUTPUT")
    bat.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    bat.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    bat.add_argument("--kv-cache-memory-gb", type=float, default=1.0)

    args = parser.parse_args(argv)
    commands_by_name = {"serve": _serve, "generate": _generate, "batch": _batch}
    return commands_by_name[args.command](args)


def _check_model(args: argparse.Namespace) -> bool:
    """Before Ray starts: a missing or gated model is one line on stderr, not a replica's
    traceback. Fetches a hub model's tokenizer and config, which the driver needs anyway."""
    from replica.model_loader import ModelNotFoundError, resolve_model

    try:
        resolve_model(args.model, args.revision, weights=False)
    except ModelNotFoundError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return False
    return True


def _speculative_config(value: str) -> dict:
    """Checked as the flag is read, so bad JSON or an unknown key is an argparse error at
    start; passed on as the dict, as a serve config's engine_args would hold it."""
    from replica.spec_decode.config import SpeculativeConfig  # torch-free

    try:
        SpeculativeConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(value)


def _lora_modules(values: list[str]) -> dict[str, str]:
    """`--lora-modules` as vLLM takes it: name=path, or JSON {"name": ..., "path": ...}.
    Paths become absolute here, where they were typed: Ray's workers run elsewhere."""
    modules = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                name, path = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError):
                expected = '{"name": ..., "path": ...}'
                raise ValueError(f"--lora-modules: expected {expected}, got {value!r}") from None
        else:
            name, equals, path = value.partition("=")
            if not (equals and name and path):
                raise ValueError(f"--lora-modules takes name=path, got {value!r}")
        modules[str(name)] = os.path.abspath(os.path.expanduser(str(path)))
    return modules


def _lora(args: argparse.Namespace) -> tuple[dict[str, str], dict]:
    """The start-up adapters, checked against the model before Ray starts (a bad one is
    a ValueError naming it), and the LoRA engine arguments, only where LoRA is on
    (adapters imply it)."""
    modules = _lora_modules(args.lora_modules)
    if not (args.enable_lora or modules):
        return modules, {}
    from deployments.app import check_lora_modules

    check_lora_modules(modules, args.model, args.revision, args.max_lora_rank)
    engine_args = {
        "enable_lora": True,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }
    return modules, engine_args


def _batch(args: argparse.Namespace) -> int:
    if not _check_model(args):
        return 2
    from replica.config import EngineConfig  # torch-free

    try:
        modules, lora_args = _lora(args)
        engine_args = {
            "model": args.model,
            "revision": args.revision,
            "dtype": args.dtype,
            "cpu_kernels": args.cpu_kernels,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "kv_cache_memory_gb": args.kv_cache_memory_gb,
            "tensor_parallel_size": args.tensor_parallel_size,
            "speculative_config": args.speculative_config,
            **lora_args,
        }
        EngineConfig.from_kwargs(**engine_args)  # a bad combination fails here, not in each actor
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    import ray

    from deployments.batch import run_batch

    # Passed only when given: a run without adapters needs nothing of run_batch's LoRA side.
    lora = {"lora_modules": modules} if modules else {}
    ray.init(include_dashboard=False)  # joins a running cluster, else starts a local Ray
    try:
        summary = run_batch(
            args.input,
            args.output,
            engine_args=engine_args,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            batch_size=args.batch_size,
            resume=args.resume,
            num_cpus_per_replica=args.num_cpus_per_replica,
            num_gpus_per_replica=args.num_gpus_per_replica,
            **lora,
        )
    except (FileNotFoundError, FileExistsError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    print(
        f"{summary.rows} rows written ({summary.errors} with errors, {summary.skipped} already done), "
        f"{summary.generated_tokens} tokens in {summary.seconds:.1f} s = {summary.tokens_per_s:.1f} tokens/s",
        flush=True,
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams
    from replica.model_loader import ModelNotFoundError
    from replica.parallel.workers import WorkerError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(
            args.model,
            dtype=args.dtype,
            cpu_kernels=args.cpu_kernels,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            revision=args.revision,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except (ValueError, ModelNotFoundError, WorkerError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    engine = llm.engine
    prompt = args.prompt
    if args.chat and llm.tokenizer.chat_template is not None:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    try:
        engine.add_request(prompt, params)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write("\n")
                print(f"[{out.num_output_tokens} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _cpu_cores(spec: str, replicas: int) -> str | list[int] | None:
    """ "auto" pins a single replica only: replicas on one node would share its cores."""
    if spec == "none" or (spec == "auto" and replicas > 1):
        return None
    if spec == "auto":
        return spec
    try:
        return [int(core) for core in spec.split(",")]
    except ValueError:
        message = f'--cpu-cores takes "auto", "none" or core numbers like "2,3", got {spec!r}'
        raise ValueError(message) from None


def _with_gpus(config):
    """With tensor parallelism on a Ray that has GPUs, each rank takes one GPU, and a
    replica must find its ranks' GPUs on one node. (Without it a replica asks for no GPU,
    as before: replicas of a small model may share one.)"""
    import ray

    if config.tensor_parallel_size == 1:
        return config
    per_node = [node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]]
    if not max(per_node, default=0):
        return config
    if max(per_node) < config.tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size {config.tensor_parallel_size} needs that many GPUs on one node; "
            f"the nodes have {sorted(per_node, reverse=True)}"
        )
    return config.model_copy(update={"num_gpus_per_replica": 1})


SHUTDOWN_TIMEOUT_S = 25.0
"""After SIGINT or SIGTERM, how long `kvserve serve` gives Serve and Ray to stop before it
kills the local Ray's processes and exits anyway: within the 30 s that Kubernetes waits
before SIGKILL."""


def _say(message: str) -> None:
    """To stderr with os.write: safe in a signal handler, where print() can find stderr's
    buffer mid-write and raise."""
    os.write(sys.stderr.fileno(), f"kvserve: {message}\n".encode())


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        with contextlib.suppress(psutil.Error):  # gone since
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


class _Stopping:
    """SIGINT and SIGTERM, handled alike: the first asks for a clean shutdown, a second
    for one at once."""

    def __init__(self) -> None:
        self.requested = threading.Event()  # by a signal, or by a failed start
        self.now = threading.Event()
        self.signalled = False
        self.code = 0

    def install(self) -> None:
        # Over an inherited SIG_IGN too: a server started in the background by a script
        # inherits SIGINT ignored.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signalled:
            _say(f"{name} again: stopping now")
            self.now.set()
            return
        self.signalled = True
        _say(f"{name}: shutting down (at most {SHUTDOWN_TIMEOUT_S:.0f} s; another signal stops it at once)")
        self.requested.set()

    def fail(self, code: int) -> None:
        self.code = code
        self.requested.set()


class _NotOnMainThread(logging.Filter):
    """Drops Ray's warning that ray.init, off the main thread, set no SIGTERM handler:
    that is why it runs there (Ray's handler exits with 15), and kvserve's handles it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")


def _import_ray() -> None:
    """Imports Ray with two of its settings off in this process only (it reads them at
    import; the processes it starts keep its defaults):
    - its C++ crash handler, which takes SIGTERM in a driver: it logs a stack trace, passes
      the signal on and sets a 3 s alarm that aborts the process, so a shutdown that took
      longer than 3 s ended in `Aborted` (SIGABRT);
    - auto-connect, with which a Ray call still running on the start-up thread after
      ray.shutdown() would start a new local Ray that nothing stops."""
    driver_only = {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1", "RAY_ENABLE_AUTO_CONNECT": "0"}
    saved = {name: os.environ.get(name) for name in driver_only}
    os.environ.update(driver_only)
    try:
        import ray  # noqa: F401
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    logging.getLogger("ray._private.worker").addFilter(_NotOnMainThread())


class _Server:
    """`kvserve serve`: start-up runs on a thread, and the main thread only waits for a
    signal and shuts down, so that a signal at any moment (loading the model, starting
    Ray, deploying, serving) ends it the same way, in bounded time."""

    def __init__(self, args: argparse.Namespace, stopping: _Stopping) -> None:
        self.args = args
        self.stopping = stopping
        self.ray_lock = threading.Lock()  # held by ray.init, and by the shutdown from its start
        self.ray_started = False
        self.processes: list[psutil.Process] = []  # the local Ray's, taken as shutdown begins
        self.stopped = threading.Event()
        self.starter = threading.Thread(target=self._start_quietly, name="kvserve-start", daemon=True)

    def run(self) -> int:
        self.starter.start()
        while not self.stopping.requested.wait(1.0):
            pass
        return self._stop()

    def _start_quietly(self) -> None:
        """Once a shutdown has begun, what fails here is Serve or Ray going away under it.
        The thread then waits for the shutdown to end: the local Ray's processes are
        started to die with the thread that started them (PR_SET_PDEATHSIG is per thread),
        and its GCS and raylet would be killed mid-flight."""
        try:
            code = self._start()
        except BaseException:
            code = 0 if self.stopping.signalled else 1
            if code:
                traceback.print_exc()
        if code:
            self.stopping.fail(code)
        self.stopped.wait()

    def _start(self) -> int:
        if not _check_model(self.args):
            return 2
        _import_ray()
        import ray
        from ray import serve

        from deployments.app import GRPC_SERVICER, AppConfig, build_app

        args = self.args
        try:
            modules, lora_args = _lora(args)
            config = AppConfig(
                model=args.model,
                revision=args.revision,
                served_model_name=args.served_model_name,
                replicas=args.replicas,
                router=args.router,
                host=args.host,
                port=args.port,
                grpc_port=args.grpc_port,
                max_waiting=args.max_waiting,
                chat_template=args.chat_template,
                api_keys=args.api_key
                + [k.strip() for k in os.environ.get("KVSERVE_API_KEYS", "").split(",") if k.strip()],
                engine_args={
                    "dtype": args.dtype,
                    "cpu_kernels": args.cpu_kernels,
                    "quantization": args.quantization,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "kv_cache_memory_gb": args.kv_cache_memory_gb,
                    "cpu_cores": _cpu_cores(args.cpu_cores, args.replicas),
                    "tensor_parallel_size": args.tensor_parallel_size,
                    "scheduling_policy": args.scheduling_policy,
                    "speculative_config": args.speculative_config,
                    **lora_args,
                },
                lora_modules=modules,
            )
        except ValueError as e:
            print(f"kvserve: error: {e}", file=sys.stderr)
            return 2
        # Ray Serve's own throughput settings (user code on the replica's main event loop,
        # buffered access logs, gRPC between handles, GC frozen after start-up) take per-request
        # overhead off the few cores a CPU replica has. Every Serve process reads them, so they
        # go to the local Ray this starts and to the job's workers. Direct ingress stays off:
        # with it, Serve's proxy still answers on our ports, and its 30 s draining period
        # holds up shutdown.
        serve_env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
        serve_env = {name: os.environ.get(name, value) for name, value in serve_env.items()}
        os.environ.update(serve_env)
        with self.ray_lock:
            if self.stopping.requested.is_set():
                return 0
            # Joins a running cluster, else starts a local Ray.
            ray.init(include_dashboard=False, runtime_env={"env_vars": serve_env})
            self.ray_started = True
        if self.stopping.requested.is_set():
            return 0
        try:
            config = _with_gpus(config)
        except ValueError as e:
            print(f"kvserve: error: {e}", file=sys.stderr)
            return 2
        serve.start(
            http_options={"host": config.host, "port": config.port},
            grpc_options={"port": config.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        )
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        url = f"http://{config.host}:{config.port}"
        print(f"kvserve is serving {config.model_name} at {url}/v1 (Ctrl-C stops it)")
        body = json.dumps({"model": config.model_name, "messages": [{"role": "user", "content": "Hi!"}]})
        auth = " -H 'Authorization: Bearer $KEY'" if config.api_keys else ""
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
        print(f"  gRPC (service kvserve.LLM) on {config.host}:{config.grpc_port}", flush=True)
        return 0

    def _stop(self) -> int:
        """Serve, then Ray, then whatever of the local Ray is left; past SHUTDOWN_TIMEOUT_S
        (or at a second signal) the watchdog ends the process instead."""
        code = self.stopping.code
        self.processes = _descendants()
        threading.Thread(target=self._watchdog, args=(code,), daemon=True).start()
        self.ray_lock.acquire()  # ray.init cannot be interrupted: let it finish first
        self.processes = _descendants()
        try:
            if self.ray_started:
                import ray
                from ray import serve

                if self._local_ray_alive(self.processes):
                    serve.shutdown()
                ray.shutdown()
        finally:
            self._end(self.processes)  # also what a ray.init that failed half-way started
            self.stopped.set()
        # The start-up thread can still be on its way out (a model download, a serve.run
        # whose app is gone). Exiting under it risks a crash in the interpreter's teardown.
        self.starter.join(timeout=2.0)
        if self.starter.is_alive():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code

    @staticmethod
    def _local_ray_alive(processes: list[psutil.Process]) -> bool:
        """False when the local Ray's GCS or raylet is gone or going: systemd signals every
        process of the service, Ctrl-C in a terminal every one in the foreground group.
        Serve's shutdown would then wait 30 s for a controller that cannot answer."""
        core = []
        for p in processes:
            with contextlib.suppress(psutil.Error):
                if p.name() in ("gcs_server", "raylet"):
                    core.append(p)
        gone, _ = psutil.wait_procs(core, timeout=1.0)
        return not gone

    @staticmethod
    def _end(processes: list[psutil.Process], timeout: float = 5.0) -> None:
        """Ends what ray.shutdown() left of the local Ray it started (a Ray this joined is
        not this process's child, and is left alone)."""
        left = _alive(processes)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, left = psutil.wait_procs(left, timeout=timeout)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def _watchdog(self, code: int) -> None:
        if self.stopping.now.wait(SHUTDOWN_TIMEOUT_S):
            reason = "stopping at once"
        else:
            reason = f"shutdown did not finish within {SHUTDOWN_TIMEOUT_S:.0f} s"
        _say(f"{reason}: killing the local Ray's processes and exiting")
        for p in _alive(self.processes + _descendants()):
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


def _serve(args: argparse.Namespace) -> int:
    stopping = _Stopping()
    stopping.install()
    return _Server(args, stopping).run()


if __name__ == "__main__":
    sys.exit(main())
