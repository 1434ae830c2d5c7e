"""An fp8 KV cache (and any other --kv-cache-dtypes) against the model's own dtype when
the cache limits the batch: a long-output workload (short prompts, every request asking
for --output-tokens) on engines with the same kv_cache_memory_gb, which holds
--concurrency such requests in the model's dtype. Engines run in turns, --repeats times,
and each is reported by its median throughput, beside its KV blocks and preemptions.

    python -m bench.kv_cache_dtype       # -> bench/results/kv_cache_dtype_<machine>.json
    python -m bench.kv_cache_dtype --dtypes float32 --kv-cache-dtypes bfloat16 fp8
"""

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from bench.machine import machine, write_result
from bench.runners import engine_record
from kvserve import LLM, SamplingParams
from replica.model_loader import resolve_model


def kv_bytes_per_token(model: str | None, dtype: torch.dtype) -> int:
    config = AutoConfig.from_pretrained(resolve_model(model, None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def run(llm: LLM, prompts: list[list[int]], output_tokens: int) -> dict:
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    before = llm.engine.stats().num_preemptions
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == output_tokens for o in outs)
    return {
        "seconds": seconds,
        "output_tokens_per_s": len(prompts) * output_tokens / seconds,
        "preemptions": llm.engine.stats().num_preemptions - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="the models'")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["fp8"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4, help="requests the unquantized cache holds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/kv_cache_dtype_<machine>.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    block_size = 16
    blocks_per_request = -(-(args.prompt_tokens + args.output_tokens) // block_size)
    engines, memory = {}, {}
    for dtype in args.dtypes:
        per_token = kv_bytes_per_token(args.model, getattr(torch, dtype))
        memory[dtype] = args.concurrency * blocks_per_request * block_size * per_token / 2**30
        for kv in ["auto", *args.kv_cache_dtypes]:
            engines[f"{dtype}, kv {kv}"] = LLM(
                args.model,
                dtype=dtype,
                kv_cache_dtype=kv,
                kv_cache_memory_gb=memory[dtype],
                block_size=block_size,
                max_num_seqs=args.requests,
                enable_prefix_caching=False,
            )
    for llm in engines.values():
        run(llm, prompts[:2], 8)  # warm-up
    runs = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs[name].append(run(llm, prompts, args.output_tokens))

    results = {}
    for name, llm in engines.items():
        dtype = name.split(",")[0]
        median = statistics.median(r["output_tokens_per_s"] for r in runs[name])
        base = statistics.median(r["output_tokens_per_s"] for r in runs[f"{dtype}, kv auto"])
        others = [other for other in engines if other.split(",")[0] == dtype]
        results[name] = {
            **engine_record(llm),
            "kv_cache_memory_gb": memory[dtype],
            "output_tokens_per_s": median,
            "speedup_vs_unquantized_kv": median / base,
            "speedup_vs": {
                other: median / statistics.median(r["output_tokens_per_s"] for r in runs[other])
                for other in others
            },
            "runs": runs[name],
        }
        print(
            f"{name}: {results[name]['kv_cache']['blocks']} blocks, {median:.1f} tok/s "
            f"({median / base:.2f}x), preemptions {[r['preemptions'] for r in runs[name]]}"
        )
    host = machine(threads=args.threads)
    print(f"wrote {write_result('kv_cache_dtype', args, {'results': results}, host, args.out)}")


if __name__ == "__main__":
    main()
