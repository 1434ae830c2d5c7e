"""What the CPU kernel selector (replica/cpu/kernel_choice.py) measures and picks on this
machine, for the linears and attention of a Llama-shaped model (default: the bundled
SmolLM2-135M's shapes), at each thread count asked for: every candidate's time per row
bucket, and the choice. It needs no weights, no Ray and no GGUF, so it also runs on a GPU
machine's host CPU.

    python -m bench.kernel_choice                      # -> bench/results/kernel_choice_<machine>.json
    python -m bench.kernel_choice --threads 2 16 --dtype bfloat16 float32
"""

import argparse
import tempfile
from pathlib import Path

import torch

from bench.machine import machine, write_result
from replica.cpu import linear_kernels
from replica.cpu.kernel_choice import KernelChooser, LinearShape

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocabulary 49152.
SMOLLM2 = {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "vocab": 49152}


def measure(
    dtype: torch.dtype, threads: int, model: dict, max_rows: int, max_seqs: int, block_size: int
) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as cache:
        chooser = KernelChooser(max_rows=max_rows, cache_dir=Path(cache))
        hidden, head_dim = model["hidden"], model["head_dim"]
        qkv = (model["heads"] + 2 * model["kv_heads"]) * head_dim
        shapes = [
            (LinearShape(qkv, hidden, dtype), None),
            (LinearShape(model["heads"] * head_dim, hidden, dtype), None),
            (LinearShape(2 * model["intermediate"], hidden, dtype, gated=True), None),
            (LinearShape(hidden, model["intermediate"], dtype), None),
            (LinearShape(model["vocab"], hidden, dtype), max_seqs),  # the output projection
        ]
        for shape, rows in shapes:
            chooser.linear(shape, rows)
        chooser.fresh_prefills_by_sdpa(model["heads"], model["kv_heads"], head_dim, block_size, dtype)
        return {
            "dtype": str(dtype).removeprefix("torch."),
            "threads": threads,
            "runnable_linear_kernels": [
                k for k in linear_kernels.LINEAR_KERNELS if linear_kernels.can_run(k, dtype, hidden)
            ],
            "chosen": chooser.chosen,
            "seconds": chooser.timings,
            "machine": machine(threads),
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--max-rows", type=int, default=2048, help="the token budget of a step")
    parser.add_argument("--max-seqs", type=int, default=128, help="rows of the output projection")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs = []
    for threads in args.threads:
        for name in args.dtype:
            run = measure(
                getattr(torch, name), threads, SMOLLM2, args.max_rows, args.max_seqs, args.block_size
            )
            print(f"{name}, {threads} threads: " + "; ".join(f"{k}: {v}" for k, v in run["chosen"].items()))
            runs.append(run)
    path = write_result("kernel_choice", args, {"model_shapes": "SmolLM2-135M", "runs": runs}, path=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
