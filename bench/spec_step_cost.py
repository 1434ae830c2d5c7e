"""What verifying proposals costs against a plain decode step, by batch size: the
measurement behind speculative decoding's default `disable_by_batch_size`.

A step that verifies k proposed tokens per request runs k + 1 tokens per request where a
decode step runs one. While a step is bound by reading the weights the two cost about the
same, and any accepted token is a gain; as the batch grows the step becomes bound by
arithmetic, the verification step costs up to k + 1 times as much, and it pays only when
most proposals are accepted. For each batch size this times both steps on the model
runner (the engine's own forward, on contexts of --context tokens) and reports the ratio
and the break-even: the accepted tokens per request per step needed for speculation to
be no slower.

    python -m bench.spec_step_cost    # bench/results/spec_step_cost_<machine>.json
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.machine import write_result
from replica.config import EngineConfig
from replica.model_loader import resolve_model
from replica.model_runner import ModelRunner


def time_step(
    runner: ModelRunner, tokens_per_row: int, batch: int, context: int, tables, repeats: int
) -> float:
    """Median seconds of one step of `batch` rows, each feeding tokens_per_row tokens after
    `context` tokens of KV, with logits at every fed position (as verification wants)."""
    token_ids = [[7] * tokens_per_row for _ in range(batch)]
    lens = [context + tokens_per_row] * batch
    sample_rows = list(range(batch))
    extra = [r * tokens_per_row + i for r in range(batch) for i in range(tokens_per_row - 1)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(token_ids, lens, tables, sample_rows, prompt_rows=extra or None)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/spec_step_cost_<machine>.json"
    )
    args = parser.parse_args()

    block_size = 16
    k = args.num_speculative_tokens
    per_row = -(-(args.context + k + 1) // block_size)
    max_batch = max(args.batch_sizes)
    config = EngineConfig(dtype=args.dtype, num_kv_blocks=per_row * max_batch, max_num_seqs=max_batch)
    runner = ModelRunner(config, resolve_model(None))
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(max_batch)]
    # The contexts' KV: one prefill per row (its content does not change the step's cost).
    for r in range(max_batch):
        runner.execute([[5] * args.context], [args.context], [tables[r]], [0])
    rows = []
    for batch in args.batch_sizes:
        decode = time_step(runner, 1, batch, args.context, tables[:batch], args.repeats)
        verify = time_step(runner, k + 1, batch, args.context, tables[:batch], args.repeats)
        ratio = verify / decode
        # A step yields 1 + accepted tokens per request: no slower once 1 + a >= ratio.
        rows.append(
            {
                "batch": batch,
                "decode_s": decode,
                "verify_s": verify,
                "ratio": ratio,
                "break_even_accepted": ratio - 1,
            }
        )
        print(
            f"batch {batch:3d}: decode {decode * 1e3:7.1f} ms, "
            f"verify {k}+1 {verify * 1e3:7.1f} ms, ratio {ratio:.2f}"
        )
    result = {
        "model": "bundled SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "context": args.context,
        "num_speculative_tokens": k,
        "rows": rows,
    }
    print(f"wrote {write_result('spec_step_cost', args, result, path=args.out)}")


if __name__ == "__main__":
    main()
