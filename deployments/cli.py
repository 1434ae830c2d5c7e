"""The `kvserve` command line."""

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from deployments import serve_process
from deployments.engine_flags import add_engine_flags, engine_flag_values

if TYPE_CHECKING:
    from deployments.app import AppConfig  # imports Ray: only once `serve` starts

# The EngineConfig fields each subcommand takes as flags (deployments/engine_flags.py makes
# them from the fields), in the order its --help lists them.
MODEL_FLAGS = (
    "model",
    "revision",
    "dtype",
    "cpu_kernels",
    "quantization",
    "kv_cache_dtype",
    "tensor_parallel_size",
)
LORA_FLAGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
KV_FLAGS = ("kv_cache_memory_gb", "kv_offloading_size")
ENGINE_FLAGS = {
    "generate": MODEL_FLAGS,
    "serve": (*MODEL_FLAGS, *LORA_FLAGS, "speculative_config", *KV_FLAGS, "scheduling_policy"),
    "batch": (*MODEL_FLAGS, *LORA_FLAGS, "speculative_config", *KV_FLAGS),
}
_TUNING = "tuning: a serve config's engine_args or the offline LLM's keyword arguments set it"
# The EngineConfig fields that are no flag of their own, and why.
NOT_FLAGS = {
    "cpu_cores": 'serve\'s --cpu-cores takes "auto", "none" or "2,3", and its "auto" depends on --replicas',
    "max_waiting": "serve's --max-waiting is the app's (default 64), which overrides the engine's",
    "seed": "generate's --seed is the request's sampling seed",
    "device": _TUNING,
    "block_size": _TUNING,
    "gpu_memory_utilization": _TUNING,
    "num_kv_blocks": _TUNING,
    "max_num_batched_tokens": _TUNING,
    "max_num_seqs": _TUNING,
    "max_model_len": _TUNING,
    "enable_prefix_caching": _TUNING,
    "attention_backend": _TUNING,
    "enable_cuda_graphs": _TUNING,
    "cuda_graph_max_batch": _TUNING,
    "gpu_decoder": _TUNING,
    "async_scheduling": _TUNING,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands_by_name = {"serve": _serve, "generate": _generate, "batch": _batch}
    return commands_by_name[args.command](args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text offline and stream it to the terminal")
    add_engine_flags(gen, ENGINE_FLAGS["generate"])
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

    srv = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API on a local Ray")
    add_engine_flags(srv, ENGINE_FLAGS["serve"])
    _add_lora_modules(srv)
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
    srv.add_argument(
        "--chat-template",
        help="instead of the model's: a Jinja file, or a template that ships with kvserve "
        '("chatml_tools": ChatML with Hermes tool calls, for SmolLM2)',
    )
    srv.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help='"auto" (default): unset sampling fields take the model\'s generation_config.json '
        'values, as in vLLM; "none": temperature 1 and top_p 1 unless a request sets them',
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

    bat = commands.add_parser("batch", help="run a JSONL/Parquet file of prompts through Ray Data")
    add_engine_flags(bat, ENGINE_FLAGS["batch"])
    _add_lora_modules(bat)
    bat.add_argument("input", help="JSONL or Parquet rows with `prompt` or `messages`")
    bat.add_argument("output", help="JSONL file, or a .parquet directory")
    bat.add_argument("--min-replicas", type=int, default=1, help="engine actors to keep")
    bat.add_argument("--max-replicas", type=int, default=2, help="engine actors to scale up to")
    bat.add_argument("--batch-size", type=int, default=64, help="rows per engine call")
    bat.add_argument("--resume", action="store_true", help="skip the ids already in OUTPUT")
    bat.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    bat.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    return parser


def _add_lora_modules(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve from the start: name=path of a local PEFT folder, "
        'or JSON {"name": ..., "path": ...}',
    )


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


def _engine_args(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The subcommand's engine arguments, from its flags, and its start-up adapters.
    LoRA's arguments only where LoRA is on (adapters imply it), with the adapters checked
    against the model before Ray starts (a bad one is a ValueError naming it)."""
    engine_args = engine_flag_values(args, ENGINE_FLAGS[args.command])
    modules = _lora_modules(getattr(args, "lora_modules", []))
    if not (engine_args.get("enable_lora") or modules):
        for name in LORA_FLAGS:
            engine_args.pop(name, None)
        return engine_args, modules
    from deployments.app import check_lora_modules

    check_lora_modules(modules, args.model, args.revision, args.max_lora_rank)
    engine_args["enable_lora"] = True
    return engine_args, modules


def _batch(args: argparse.Namespace) -> int:
    if not _check_model(args):
        return 2
    from replica.config import EngineConfig  # torch-free

    try:
        engine_args, modules = _engine_args(args)
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
        engine_args, _ = _engine_args(args)
        llm = LLM(**engine_args)
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


def _serve(args: argparse.Namespace) -> int:
    return serve_process.run(lambda: _check_model(args), lambda: _serve_config(args))


def _serve_config(args: argparse.Namespace) -> "AppConfig | None":
    """The app's config, on serve_process's start-up thread; None once an error is printed."""
    from deployments.app import AppConfig

    try:
        engine_args, modules = _engine_args(args)
        model, revision = engine_args.pop("model"), engine_args.pop("revision")  # the app's own fields
        return AppConfig(
            model=model,
            revision=revision,
            served_model_name=args.served_model_name,
            replicas=args.replicas,
            router=args.router,
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            max_waiting=args.max_waiting,
            chat_template=args.chat_template,
            generation_config=args.generation_config,
            api_keys=args.api_key
            + [k.strip() for k in os.environ.get("KVSERVE_API_KEYS", "").split(",") if k.strip()],
            engine_args={**engine_args, "cpu_cores": _cpu_cores(args.cpu_cores, args.replicas)},
            lora_modules=modules,
        )
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
