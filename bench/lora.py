"""LoRA's cost, side by side in one run: the per-row update's kernels (kernels.py's
masked GEMMs, a loop over the step's adapters, and on CUDA the Triton BGMV kernels)
against the base projection they add to, and offline throughput of the same workload
with LoRA off, on with every row on the base model, and on with the rows spread over
four rank-16 adapters (in turns, each config once per round).

    python -m bench.lora                  # the bundled model on CPU
    python -m bench.lora --device cuda    # a random 1B-shaped Llama (bench/random_model.py)

Writes bench/results/lora_<machine>.json."""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.machine import machine, write_result
from bench.random_model import LLAMA_1B, build_model
from bench.runners import run_kvserve
from bench.workloads import make_workload
from kvserve import LLM
from replica.lora.adapter_files import projection_shapes
from replica.lora.kernels import lora_delta_torch
from replica.model_loader import resolve_model
from wire.lora_request import LoRARequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_delta_by_adapter(x, a, b, token_slots):
    """The alternative to masking: one pair of GEMMs per adapter the step uses."""
    out = x.new_zeros(x.shape[0], b.shape[-1])
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = (token_slots == slot).nonzero().squeeze(1)
            out[rows] = (x[rows] @ a[slot].T) @ b[slot]
    return out


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> None:
    """Random A and B (PEFT's init leaves B zero, which would change nothing) in PEFT's files."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (k, n) in projection_shapes(config).items():
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=g) / rank**0.5 * 0.1
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS)}
    (directory / "adapter_config.json").write_text(json.dumps(adapter))


def time_call(fn, repeats: int, device: str) -> float:
    """Median seconds of one call, after two untimed ones."""
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_part(config: dict, dtype: torch.dtype, device: str, rows: list[int], repeats: int) -> list[dict]:
    shapes = projection_shapes(config)
    groups = {  # the CPU decoder's fused projections: (in, out, slices)
        "qkv": (shapes["q_proj"][0], sum(shapes[t][1] for t in TARGETS[:3]), 3),
        "gate_up": (shapes["gate_proj"][0], 2 * shapes["gate_proj"][1], 2),
        "down": (*shapes["down_proj"], 1),
    }
    candidates = {"masked": lora_delta_torch, "by_adapter": lora_delta_by_adapter}
    if device == "cuda":
        from replica.lora.triton_lora import lora_delta_triton

        candidates["triton"] = lora_delta_triton
    slots, rank, out = 4, 16, []
    g = torch.Generator().manual_seed(0)
    for name, (k, n, parts) in groups.items():
        weight = torch.randn(n, k, generator=g).to(device, dtype)
        a = torch.randn(slots, parts * rank, k, generator=g).to(device, dtype)
        b = torch.randn(slots, parts * rank, n, generator=g).to(device, dtype)
        for t in rows:
            x = torch.randn(t, k, generator=g).to(device, dtype)
            for used in (1, slots):
                token_slots = (torch.arange(t) % used).to(device)
                entry = {"projection": name, "in": k, "out": n, "rows": t, "adapters_in_step": used}
                entry["base_gemm_s"] = time_call(lambda: x @ weight.T, repeats, device)  # noqa: B023
                for cname, fn in candidates.items():
                    entry[f"{cname}_s"] = time_call(lambda fn=fn: fn(x, a, b, token_slots), repeats, device)  # noqa: B023
                best = min(candidates, key=lambda c: entry[f"{c}_s"])  # noqa: B023
                entry["fastest"] = best
                entry["fastest_over_base_gemm"] = entry[f"{best}_s"] / entry["base_gemm_s"]
                print(json.dumps(entry), flush=True)
                out.append(entry)
    return out


def engine_part(model: str, config: dict, args, adapters: list[LoRARequest]) -> dict:
    prompts, lengths = make_workload(
        args.num_requests, args.prompt_len, args.output_len, args.output_len, config["vocab_size"], seed=0
    )
    common = dict(dtype=args.dtype, device=args.device, max_model_len=args.prompt_len + args.output_len + 16)
    if args.device == "cuda":  # two engines share the GPU: a KV cache each that fits the workload
        common["num_kv_blocks"] = 2 * args.num_requests * -(-common["max_model_len"] // 16)
    llms = {
        "lora_off": LLM(model, **common),
        "lora_on_base_rows": LLM(
            model, **common, enable_lora=True, max_loras=len(adapters), max_lora_rank=16
        ),
    }
    llms["lora_on_adapter_rows"] = llms["lora_on_base_rows"]
    rows = {
        "lora_off": None,
        "lora_on_base_rows": None,
        "lora_on_adapter_rows": [adapters[i % len(adapters)] for i in range(len(prompts))],
    }
    for llm in set(llms.values()):  # warm-up, with an adapter where it can
        lora = adapters[0] if llm.engine.loras is not None else None
        llm.generate(prompts[:4], use_tqdm=False, lora_request=lora)
    seconds = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            seconds[name].append(run_kvserve(llm, prompts, lengths, lora_requests=rows[name]).seconds)
            print(name, f"{sum(lengths) / seconds[name][-1]:.1f} tok/s", flush=True)
    tokens = sum(lengths)
    result = {name: {"seconds": s, "output_tokens_per_s": tokens / min(s)} for name, s in seconds.items()}
    base = result["lora_off"]["output_tokens_per_s"]
    for name in result:
        result[name]["over_lora_off"] = result[name]["output_tokens_per_s"] / base
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kernel-repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.num_requests = args.num_requests or (256 if cuda else 16)
    work = Path(tempfile.mkdtemp(prefix="kvserve-lora-bench-"))
    if cuda:
        model = work / "model"
        build_model(model, LLAMA_1B, "cuda")
    else:
        model = resolve_model(None)
    config = json.loads((model / "config.json").read_text())
    adapters = []
    for i in range(4):
        write_adapter(work / f"adapter{i}", config, rank=16, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, str(work / f"adapter{i}")))
    rows = [1, 16, 64, 256, 1024]
    dtype = getattr(torch, args.dtype)
    host = machine(device=args.device)
    result = {
        "model": "random 1B-shaped Llama (bench/random_model.py)"
        if cuda
        else "bundled SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "adapters": "4, rank 16, on q/k/v/o/gate/up/down of every layer",
        "kernels": kernel_part(config, dtype, args.device, rows, args.kernel_repeats),
    }
    result["workload"] = {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "rounds")}
    result["offline"] = engine_part(str(model), config, args, adapters)
    print(f"wrote {write_result('lora', args, result, host, args.out)}")


if __name__ == "__main__":
    main()
