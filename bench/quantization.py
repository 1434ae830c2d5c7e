"""Quantization against the unquantized model (in --dtype, and in --also-dtypes), side
by side in one process: what the linears take in memory, the KV blocks one
--kv-cache-memory-gb holds, perplexity on a held-out English text through the engine's
own prompt logprobs, greedy answers to factual prompts, and single-stream decode speed,
timed in turns. Weight quantizations (--quantizations; "gguf": the bundled model's own
Q4_1 and Q8_0 blocks) and KV cache dtypes (--kv-cache-dtypes) run alone and together.

The text is the first --tokens tokens of /usr/share/common-licenses/GPL-3 (every Debian
machine has it; nobody tuned on it).

    python -m bench.quantization --dtype float32   # -> bench/results/quantization_<machine>.json
    python -m bench.quantization --dtype bfloat16 --also-dtypes float32 --quantizations gguf \
        --kv-cache-dtypes --out bench/results/gguf_<machine>.json
"""

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine, write_result
from bench.runners import engine_record
from kvserve import LLM, SamplingParams

TEXT = Path("/usr/share/common-licenses/GPL-3")
# Each prompt's greedy answer must contain its word.
FACTS = [
    ("The capital of France is", "Paris"),
    ("The largest planet in the solar system is", "Jupiter"),
    ("The chemical symbol for gold is", "Au"),
    ("The first man to walk on the moon was", "Armstrong"),
    ("The capital of Japan is", "Tokyo"),
    ("The capital of Italy is", "Rome"),
]


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate([token_ids], params, use_tqdm=False)[0]
    logprobs = [entry.logprob for entry in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def answers(llm: LLM) -> list[dict]:
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = llm.generate([prompt for prompt, _ in FACTS], params, use_tqdm=False)
    return [
        {"prompt": prompt, "expected": word, "answer": out.text, "correct": word in out.text}
        for (prompt, word), out in zip(FACTS, outs, strict=True)
    ]


def decode_seconds_per_token(llm: LLM, tokens: int) -> float:
    """Wall time of one request of `tokens` output tokens after an 8-token prompt, per token."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([[1, 504, 3458, 282, 4649, 314, 253, 2012]], params, use_tqdm=False)
    return (time.perf_counter() - start) / tokens


def _weight_bytes(row: dict) -> int:
    """Every weight the engine holds: the linears and the rest (embeddings, norms)."""
    return row["weights"]["linear_bytes"] + row["weights"]["other_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engines'")
    parser.add_argument(
        "--also-dtypes",
        nargs="*",
        default=["bfloat16"],
        help="unquantized engines in other dtypes, beside --dtype's (bf16 is emulated on CPUs "
        "without AVX512-BF16)",
    )
    parser.add_argument("--quantizations", nargs="*", default=["int8"])
    parser.add_argument("--kv-cache-dtypes", nargs="*", default=["fp8"])
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.25, help="every engine's")
    parser.add_argument("--tokens", type=int, default=2048, help="of the held-out text")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes of each engine, in turns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/quantization_<machine>.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    # name -> engine; "float32" (--dtype) is the baseline every ratio is against.
    def engine(dtype: str, **kwargs) -> LLM:
        return LLM(
            args.model,
            dtype=dtype,
            max_model_len=args.tokens + 64,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            **kwargs,
        )

    engines = {dtype: engine(dtype) for dtype in dict.fromkeys([args.dtype, *args.also_dtypes])}
    for q in args.quantizations:
        engines[q] = engine(args.dtype, quantization=q)
    for kv in args.kv_cache_dtypes:
        engines[f"kv {kv}"] = engine(args.dtype, kv_cache_dtype=kv)
        for q in args.quantizations:
            engines[f"{q} + kv {kv}"] = engine(args.dtype, quantization=q, kv_cache_dtype=kv)
    token_ids = engines[args.dtype].tokenizer.encode(TEXT.read_text())[: args.tokens]

    results = {}
    for name, llm in engines.items():
        results[name] = {
            **engine_record(llm),
            "perplexity": perplexity(llm, token_ids),
            "answers": answers(llm),
        }
        decode_seconds_per_token(llm, 8)  # warm-up
    times = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            times[name].append(decode_seconds_per_token(llm, args.decode_tokens))
    for name in results:
        results[name]["decode_s_per_token"] = statistics.median(times[name])
        results[name]["decode_s_per_token_runs"] = times[name]
    for name, row in results.items():
        row["vs"] = {
            base: {
                "linear_bytes": row["weights"]["linear_bytes"] / results[base]["weights"]["linear_bytes"],
                "weight_bytes": _weight_bytes(row) / _weight_bytes(results[base]),
                "kv_blocks": row["kv_cache"]["blocks"] / results[base]["kv_cache"]["blocks"],
                "perplexity": row["perplexity"] / results[base]["perplexity"],
                "decode_speedup": results[base]["decode_s_per_token"] / row["decode_s_per_token"],
                # each round's ratio, then their median: a host whose speed shifts for
                # seconds at a time moves both engines of a round alike
                "decode_speedup_per_round": statistics.median(
                    b / t for b, t in zip(times[base], times[name], strict=True)
                ),
            }
            for base in [args.dtype, *args.also_dtypes]
        }
        ratio = row["vs"][args.dtype]
        print(
            f"{name}: linears {row['weights']['linear_bytes'] / 2**20:.1f} MiB "
            f"({ratio['linear_bytes']:.3f}x; all weights {ratio['weight_bytes']:.3f}x), "
            f"KV blocks {row['kv_cache']['blocks']} "
            f"({ratio['kv_blocks']:.2f}x), "
            f"perplexity {row['perplexity']:.3f} ({ratio['perplexity']:.4f}x), decode "
            f"{1 / row['decode_s_per_token']:.1f} tok/s ({ratio['decode_speedup']:.2f}x; "
            f"per round {ratio['decode_speedup_per_round']:.2f}x), "
            f"answers {sum(a['correct'] for a in row['answers'])}/{len(FACTS)}"
        )
    text = {"path": str(TEXT), "tokens": len(token_ids)}
    host = machine(threads=args.threads)
    print(f"wrote {write_result('quantization', args, {'text': text, 'results': results}, host, args.out)}")


if __name__ == "__main__":
    main()
