"""kvserve at two commits, side by side on the offline benchmark's workloads.

For a change that must not cost speed (structured outputs, say, must not slow requests
that use none): each commit is checked out in a git worktree, and each tree's own
offline benchmark runs `--systems kvserve_continuous` in turns, round after round, so
that machine noise falls on both. The result is each workload's output tok/s per commit
(median over the rounds) and their ratio. With `--served`, each tree also serves: its own
`kvserve serve` under a closed loop of streaming completions at a fixed concurrency,
the same requests for both, in the same turns.

A tree runs its benchmark the way it was written to run: as a module
(`python -m bench.offline`) where bench/ is a package, else as a file
(`python bench/offline.py`), as every commit before bench/ became one does.

    python -m bench.ab_commits --base 12a6ff2 --rounds 3
    python -m bench.ab_commits --base 639e6c0 --smoke    # tiny workloads, one round, to the temp dir
    python -m bench.ab_commits --base 639e6c0 --served --concurrency 16
    python -m bench.ab_commits --base 72e330a --offline-args "--quantization gguf" \
        --served --served-args "--quantization gguf"      # the bundled GGUF's own blocks
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.machine import ROOT, machine, write_result
from bench.servers import Server, free_port
from bench.sse import latency_summary, stream
from bench.workloads import make_workload
from replica.model_loader import BUNDLED_NAME

# Small enough for a smoke run, and arguments that every tree's offline benchmark takes.
SMOKE_ARGS = "--mixed-requests 8 --mixed-cap 16 --batch-size 8 --max-num-batched-tokens 256"


def worktree(commit: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), commit], check=True)
    return where


def offline_command(tree: Path) -> list[str]:
    """How `tree` runs its offline benchmark. Run from the tree's root, either form imports
    the tree's own packages: they come first on sys.path, before the editable install's
    finder, which Python consults last."""
    if (tree / "bench" / "__init__.py").exists():
        return [sys.executable, "-m", "bench.offline"]
    return [sys.executable, "bench/offline.py"]


def run_offline(
    tree: Path, workloads: list[str], threads: int, out: Path, more: list[str] = ()
) -> dict[str, float]:
    """Output tok/s per case of one offline run of kvserve_continuous in `tree`."""
    where = subprocess.run(
        [sys.executable, "-c", "import replica; print(replica.__file__)"],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(tree)), f"kvserve came from {where}, not {tree}"
    command = [*offline_command(tree), "--systems", "kvserve_continuous", "--workloads", *workloads]
    command += ["--threads", str(threads), "--repeats", "1", "--out", str(out), *more]
    subprocess.run(command, cwd=tree, check=True)
    result = json.loads(out.read_text())
    return {r["case"]: r["systems"]["kvserve_continuous"]["output_tokens_per_s"] for r in result["results"]}


def served_command(
    tree: Path, port: int, dtype: str, more: list[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """`kvserve serve` of `tree`: its packages first on PYTHONPATH, which Ray's workers
    inherit, so the replicas run the tree's code too."""
    command = [sys.executable, "-m", "deployments.cli", "serve", "--dtype", dtype]
    command += ["--port", str(port), "--grpc-port", str(free_port()), *more]
    return command, {"PYTHONPATH": str(tree)}


async def closed_loop(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """Every prompt as a streamed completion, `concurrency` in flight at once. Sampling is
    explicit, so that commits with different sampling defaults do the same work."""
    payload = {"model": BUNDLED_NAME, "max_tokens": max_tokens, "ignore_eos": True}
    payload |= {"temperature": 1.0, "top_p": 1.0}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def one(prompt: list[int]):
            async with gate:
                return await stream(client, "/v1/completions", {**payload, "prompt": prompt})

        await one(prompts[0])  # warm-up, untimed
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
    return latency_summary(results, time.perf_counter() - start)


def run_served(tree: Path, args, prompts: list[list[int]], log: Path) -> dict:
    port = free_port()
    command, env = served_command(tree, port, args.served_dtype, args.served_args.split())
    server = Server(command, port, log, env).start()
    try:
        server.wait_ready()
        summary = asyncio.run(closed_loop(server.url, prompts, args.served_output, args.concurrency))
    finally:
        server.stop()
    if summary["errors"]:
        raise RuntimeError(f"{summary['errors']} requests failed; see {log}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["anyscale", "mixed"])
    parser.add_argument("--threads", type=int, default=2, help="the offline benchmark's torch threads")
    parser.add_argument(
        "--offline-args",
        default="",
        help='more offline benchmark arguments for both commits, e.g. "--dtype float32 --caps 32"',
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/ab_commits_<machine>.json"
    )
    parser.add_argument("--served", action="store_true", help="also compare `kvserve serve` in turns")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--served-requests", type=int, default=64)
    parser.add_argument("--served-prompt", type=int, default=128)
    parser.add_argument("--served-output", type=int, default=64)
    parser.add_argument("--served-dtype", default="auto")
    parser.add_argument(
        "--served-args", default="", help='more `kvserve serve` arguments, e.g. "--quantization gguf"'
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the mixed workload, tiny, once; to the temp dir"
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.workloads = 1, ["mixed"]
        args.offline_args = f"{SMOKE_ARGS} {args.offline_args}"
    commits = {
        name: subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True, capture_output=True, text=True
        ).stdout.strip()
        for name, ref in (("base", args.base), ("head", args.head))
    }
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    served: dict[str, list[dict]] = {"base": [], "head": []}
    prompts, _ = make_workload(args.served_requests, args.served_prompt, 1, 1, 49152, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: worktree(commit, Path(tmp) / name) for name, commit in commits.items()}
        try:
            for round_ in range(args.rounds):
                order = ("base", "head") if round_ % 2 == 0 else ("head", "base")
                for name in order:
                    out = Path(tmp) / f"{name}.json"
                    runs[name].append(
                        run_offline(trees[name], args.workloads, args.threads, out, args.offline_args.split())
                    )
                    print(name, round_, runs[name][-1], flush=True)
                    if args.served:
                        log = Path(tmp) / f"{name}_serve.log"
                        served[name].append(run_served(trees[name], args, prompts, log))
                        print(name, round_, "served", served[name][-1], flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
                )
    cases = {}
    for case in runs["base"][0]:
        base = statistics.median(r[case] for r in runs["base"])
        head = statistics.median(r[case] for r in runs["head"])
        cases[case] = {
            "base_tok_s": [r[case] for r in runs["base"]],
            "head_tok_s": [r[case] for r in runs["head"]],
            "median_base_tok_s": base,
            "median_head_tok_s": head,
            "head_over_base": head / base,
        }
    result = {
        "what": "kvserve_continuous of each commit's own offline benchmark, the commits in turns",
        "commits": commits,
        "cases": cases,
    }
    if args.served:
        medians = {
            name: {
                key: statistics.median(r[key] for r in served[name])
                for key in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s")
            }
            for name in served
        }
        rate = {name: medians[name]["output_tokens_per_s"] for name in medians}
        result["served"] = {
            "what": f"kvserve serve, {args.served_requests} streamed completions of "
            f"{args.served_prompt} -> {args.served_output} tokens at concurrency {args.concurrency}",
            "runs": served,
            "medians": medians,
            "head_over_base": rate["head"] / rate["base"],
        }
        cases["served"] = {"head_over_base": rate["head"] / rate["base"]}
    path = write_result("ab_commits", args, result, machine(threads=args.threads), args.out, args.smoke)
    print(json.dumps({c: round(v["head_over_base"], 3) for c, v in cases.items()}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
