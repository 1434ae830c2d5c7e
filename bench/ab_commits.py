"""kvserve at two commits, side by side on bench/offline.py's workloads.

For a change that must not cost speed (structured outputs, say, must not slow requests
that use none): each commit is checked out in a git worktree, and the two run
`bench/offline.py --systems kvserve_continuous` in turns, round after round, so that
machine noise falls on both. The result is each workload's output tok/s per commit
(median over the rounds) and their ratio.

    python bench/ab_commits.py --base 12a6ff2 --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402


def worktree(commit: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), commit], check=True)
    return where


# Runs a script with the current directory's kvserve: .venv's editable install of this
# checkout would otherwise win over PYTHONPATH, through its import hook.
LAUNCH = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
sys.path.insert(0, ".")
sys.argv = sys.argv[1:]
if sys.argv[0] == "--where":
    import replica
    print(replica.__file__)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_offline(
    tree: Path, workloads: list[str], threads: int, out: Path, more: list[str] = ()
) -> dict[str, float]:
    """Output tok/s per case of one offline.py run of kvserve_continuous in `tree`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    where = subprocess.run(
        [sys.executable, "-c", LAUNCH, "--where"],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert where.startswith(str(tree)), f"kvserve came from {where}, not {tree}"
    command = [sys.executable, "-c", LAUNCH, "bench/offline.py", "--systems", "kvserve_continuous"]
    command += ["--workloads", *workloads, "--threads", str(threads), "--repeats", "1", "--out", str(out)]
    command += list(more)
    subprocess.run(command, cwd=tree, env=env, check=True)
    result = json.loads(out.read_text())
    return {r["case"]: r["systems"]["kvserve_continuous"]["output_tokens_per_s"] for r in result["results"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["anyscale", "mixed"])
    parser.add_argument("--threads", type=int, default=2, help="offline.py's torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "ab_commits_cpu.json")
    parser.add_argument(
        "--offline-args",
        default="",
        help='more bench/offline.py arguments for both commits, e.g. "--dtype float32 --caps 32"',
    )
    args = parser.parse_args()
    commits = {
        name: subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True, capture_output=True, text=True
        ).stdout.strip()
        for name, ref in (("base", args.base), ("head", args.head))
    }
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: worktree(commit, Path(tmp) / name) for name, commit in commits.items()}
        try:
            for round_ in range(args.rounds):
                order = ("base", "head") if round_ % 2 == 0 else ("head", "base")
                for name in order:
                    runs[name].append(
                        run_offline(
                            trees[name],
                            args.workloads,
                            args.threads,
                            Path(tmp) / f"{name}.json",
                            args.offline_args.split(),
                        )
                    )
                    print(name, round_, runs[name][-1], flush=True)
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
        "benchmark": "bench/ab_commits.py: kvserve_continuous of bench/offline.py at two commits, in turns",
        "commits": commits,
        "rounds": args.rounds,
        "offline_args": args.offline_args,
        "machine": machine(threads=args.threads),
        "cases": cases,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({c: round(v["head_over_base"], 3) for c, v in cases.items()}, indent=2))


if __name__ == "__main__":
    main()
