"""What another thread's OpenMP workers cost a decoding engine: single-stream decode on
the bundled model, timed while a second thread that has run one parallel region lives
on, with its workers kept and with them ended (release_openmp_threads), and with no
second thread, in turns.

A serving replica is that case: the engine loads and warms up on Serve's constructor
thread, which lives on, and steps on a thread of its own. libgomp keeps each thread's
workers; once they outnumber the cores it sleeps at every barrier instead of spinning
(replica/cpu/affinity.py).

    python -m bench.openmp_pools    # bench/results/openmp_pools_<machine>.json
"""

import argparse
import statistics
import threading
from pathlib import Path

import torch

from bench.machine import write_result
from bench.quantization import decode_seconds_per_token
from kvserve import LLM
from replica.cpu.affinity import release_openmp_threads

CASES = ("no other thread", "another thread's workers kept", "another thread's workers ended")


def timed_beside(llm: LLM, case: str, tokens: int) -> float:
    """Decode on this thread while the case's other thread (if any) waits, alive."""
    if case == CASES[0]:
        return decode_seconds_per_token(llm, tokens)
    ready, done = threading.Event(), threading.Event()

    def other() -> None:
        torch.ones(512, 512) @ torch.ones(512, 512)  # a parallel region of every torch thread
        if case == CASES[2]:
            release_openmp_threads()
        ready.set()
        done.wait()

    thread = threading.Thread(target=other)
    thread.start()
    ready.wait()
    try:
        return decode_seconds_per_token(llm, tokens)
    finally:
        done.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quantization", default="gguf", help="'none' for the dequantized model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/openmp_pools_<machine>.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(None, dtype=args.dtype, quantization=quantization, max_model_len=512, kv_cache_memory_gb=0.25)
    decode_seconds_per_token(llm, 8)  # warm-up
    runs = {case: [] for case in CASES}
    for _ in range(args.repeats):
        for case in CASES:
            runs[case].append(timed_beside(llm, case, args.tokens))
    results = {
        case: {"decode_s_per_token": statistics.median(times), "runs": times} for case, times in runs.items()
    }
    base = results[CASES[0]]["decode_s_per_token"]
    for case, row in results.items():
        row["vs_no_other_thread"] = row["decode_s_per_token"] / base
        ms, ratio = row["decode_s_per_token"] * 1e3, row["vs_no_other_thread"]
        print(f"{case:32s} {ms:6.2f} ms/token ({ratio:.2f}x)")
    result = {
        "model": "bundled SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "quantization": quantization,
        "tokens": args.tokens,
        "results": results,
    }
    print(f"wrote {write_result('openmp_pools', args, result, path=args.out)}")


if __name__ == "__main__":
    main()
