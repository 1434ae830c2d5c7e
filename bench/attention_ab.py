"""kvserve's CPU paged attention (replica/cpu/attention*.c) at two commits, in turns in one
process, on the bundled model's attention shapes over 30 layers' caches.

For a kernel change too small to show through bench.ab_commits's whole workloads
(a step is mostly GEMM): the base commit's C sources are built beside this checkout's,
and the two run the same calls in turns, so that machine noise falls on both. Cases:
- prefill: fresh prompts (nothing cached), rotary embedding on, as a prefill step runs;
- decode: one new token per sequence over contexts of about `--context` tokens.
In bf16 (the default) or, with --dtype float32, fp32, which takes the generic pages.
It reports each build's median and best time per 30 layers, their ratios, and whether
the two wrote the same outputs and KV caches bit for bit. Both commits must declare the
same C ABI (replica/cpu/kvserve_abi.h), since one set of Python bindings calls both.

    python -m bench.attention_ab --base a816bf1 --name store_outputs_one_pass
"""

import argparse
import contextlib
import ctypes
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import ROOT, machine, write_result
from replica.attention.metadata import build_metadata
from replica.cpu import build, ops

LAYERS, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 30, 1400, 3, 9, 64  # SmolLM2-135M


def build_at(commit: str, where: Path) -> ctypes.CDLL:
    """The kernels as they were at `commit` (its own set of C files), compiled with this
    checkout's flags."""
    folder = build.SOURCES[0].parent.relative_to(ROOT)
    git = ["git", "-C", str(ROOT)]
    listing = subprocess.run(
        [*git, "ls-tree", "--name-only", commit, f"{folder}/"], capture_output=True, text=True, check=True
    )
    names = [Path(line).name for line in listing.stdout.split() if line.endswith((".c", ".h"))]
    for name in names:
        shown = subprocess.run(
            [*git, "show", f"{commit}:{folder}/{name}"], capture_output=True, text=True, check=True
        )
        (where / name).write_text(shown.stdout)
    target = where / "kernels.so"
    sources = [where / name for name in names if name.endswith(".c")]
    result = build.compile_kernels(build.compiler(), sources, target)
    if result.returncode != 0:
        raise RuntimeError(f"building {commit}'s kernels failed:\n{result.stderr[-2000:]}")
    lib = ctypes.CDLL(str(target))
    try:
        build._declare(lib)  # this checkout's bindings: the two commits must share the ABI
    except (AttributeError, RuntimeError) as e:
        raise SystemExit(f"{commit}'s kernels do not have this checkout's C ABI (kvserve_abi.h): {e}") from e
    return lib


@contextlib.contextmanager
def kernels(lib: ctypes.CDLL):
    """ops' calls go to `lib` inside the block."""
    saved = ops.load_library
    ops.load_library = lambda: lib
    try:
        yield
    finally:
        ops.load_library = saved


def rotary(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (100000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def make_case(kind: str, sequences: int, tokens: int, block_size: int, seed: int, dtype: torch.dtype) -> dict:
    """Random caches in `dtype` for every layer, block tables drawn at random from them (a
    cache's pages sit anywhere), and one step's q, k, v, cos and sin."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shape = (NUM_BLOCKS, KV_HEADS, block_size, HEAD_DIM)
    caches = [tuple((torch.randn(shape) * 0.5).to(dtype) for _ in "kv") for _ in range(LAYERS)]
    if kind == "prefill":
        context_lens = query_lens = [tokens] * sequences
        positions = torch.arange(tokens).repeat(sequences)
    else:
        context_lens = [tokens + rng.randrange(-tokens // 4, tokens // 4 + 1) for _ in range(sequences)]
        query_lens = [1] * sequences
        positions = torch.tensor([n - 1 for n in context_lens])
    blocks = list(range(NUM_BLOCKS))
    rng.shuffle(blocks)
    tables, used = [], 0
    for n in context_lens:
        need = -(-n // block_size)
        tables.append(blocks[used : used + need])
        used += need
    meta = build_metadata(tables, context_lens, query_lens, block_size, torch.device("cpu"))
    rows = sum(query_lens)
    q, k, v = (torch.randn(rows, h, HEAD_DIM).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    cos, sin = rotary(positions, dtype)
    flops = sum(
        2 * 2 * HEAD_DIM * HEADS * LAYERS * (2 * c - n + 1) * n / 2
        for c, n in zip(context_lens, query_lens, strict=True)
    )
    return {"caches": caches, "meta": meta, "qkv": (q, k, v), "rotary": (cos, sin), "flops": flops}


def one_step(case: dict) -> tuple[float, torch.Tensor]:
    q, k, v = case["qkv"]
    start = time.perf_counter()
    for k_cache, v_cache in case["caches"]:
        out = ops.paged_attention(q, k, v, k_cache, v_cache, case["meta"], HEAD_DIM**-0.5, *case["rotary"])
    return time.perf_counter() - start, out


def compare(libs: dict[str, ctypes.CDLL], case: dict, rounds: int) -> dict:
    times = {name: [] for name in libs}
    results = {}
    for r in range(rounds):
        for name in list(libs) if r % 2 == 0 else list(libs)[::-1]:
            with kernels(libs[name]):
                seconds, out = one_step(case)
            times[name].append(seconds)
            k_cache, v_cache = case["caches"][-1]
            results[name] = (out.clone(), k_cache.clone(), v_cache.clone())
    base, head = (times[name][2:] for name in libs)  # the first rounds warm the caches
    same = all(torch.equal(a, b) for a, b in zip(*results.values(), strict=True))
    return {
        "ms_median": {name: round(statistics.median(t[2:]) * 1000, 2) for name, t in times.items()},
        "ms_best": {name: round(min(t[2:]) * 1000, 2) for name, t in times.items()},
        "speedup_median": round(statistics.median(base) / statistics.median(head), 3),
        "speedup_best": round(min(base) / min(head), 3),
        "head_gflops_best": round(case["flops"] / min(head) / 1e9, 1),
        "bit_identical": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="commit whose C kernels are the baseline")
    parser.add_argument("--name", default=None, help="what the head changes, recorded in the result")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/attention_ab_<machine>.json"
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16",
        help="float32 runs the generic pages (bf16 runs the paired ones on AVX512-BF16 CPUs)",
    )  # fmt: skip
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "replica/cpu"]
    ).returncode
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            args.base: build_at(args.base, Path(tmp)),
            head + ("+changes" if dirty else ""): build.load_library(),
        }
        cases = {
            f"prefill {args.prompts}x{args.prompt_len}": make_case(
                "prefill", args.prompts, args.prompt_len, args.block_size, args.seed, dtype
            ),
            f"decode {args.sequences}x~{args.context}": make_case(
                "decode", args.sequences, args.context, args.block_size, args.seed, dtype
            ),
        }
        report = {name: compare(libs, case, args.rounds) for name, case in cases.items()}
    for name, row in report.items():
        print(f"{name}: {row}")
    out = {
        "what": "CPU paged attention, two commits' C kernels in turns in one process, 30 layers per timing",
        "commits": list(libs),
        "cases": report,
    }
    print(f"wrote {write_result('attention_ab', args, out, machine(threads=args.threads), args.out)}")


if __name__ == "__main__":
    main()
