"""8-bit and 4-bit weights against the model's dtype, side by side in one run:

a. GEMMs: every distinct linear of the model at several row counts, dense (F.linear in
   each dense dtype) against replica/quantized_linear.py's int8 (torch._int_mm) and fp8
   (torch._scaled_mm, where the device has fp8 GEMMs), and fp8 weight-only (the weight
   stored in e4m3, widened to the activations' dtype at each call), each timed in turns,
   median of --reps.
b. On CUDA only, the engine: kvserve on bench.gpu's Anyscale workload (one cap, a
   subset of requests) and its batch-1 decode step, with quantization None, the same
   model as a 4-bit GPTQ checkpoint (replica/gpu/group_linear.py, whose candidates'
   timings it records), "int8" and "fp8", one engine at a time.

On a CPU, part (a) is what `quantization="fp8"` is refused on: no fp8 path there beats
the dense dtype (kvserve's CPU int8 kernels are measured by bench.quantization).

    python -m bench.quantized_gemm                 # GPU: 1B-shaped model, bf16
    python -m bench.quantized_gemm --device cpu    # the bundled model's shapes
    python -m bench.quantized_gemm --smoke         # tiny, seconds, to the temp dir
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from bench.budget import Budget, Report, budget_spent, failed, say, skipped
from bench.gpu_measurements import batch1_step
from bench.machine import machine, result_path, software_versions
from bench.packed_checkpoint import save_packed
from bench.random_model import LLAMA_1B, TINY, build_model
from bench.runners import free_memory, run_kvserve, sync
from bench.workloads import make_workload, warm_up_workload
from kvserve import LLM
from replica.quantized_linear import FP8, QuantizedLinear, fp8_supported, quantize_rows

# The bundled SmolLM2-135M's linears: (in, out) of q, k/v, o, gate/up, down, lm_head.
BUNDLED = dict(hidden_size=576, intermediate_size=1536, kv=192, vocab_size=49152)


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    kv = shape.get("kv") or shape["num_key_value_heads"] * shape["head_dim"]
    return {
        "q_proj/o_proj": (hidden, hidden),
        "k_proj/v_proj": (hidden, kv),
        "gate_proj/up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
        "lm_head": (hidden, shape["vocab_size"]),
    }


class WeightOnlyFp8(nn.Module):
    """The weight in e4m3 with a scale per row, widened to x's dtype at every call."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.scale = quantize_rows(linear.weight.detach(), "fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return nn.functional.linear(x, w)


def time_call(fn, x: torch.Tensor, device: str, reps: int) -> float:
    fn(x)
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(x)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_part(shapes: dict, rows: list[int], dense_dtypes: list[torch.dtype], device: str, reps: int) -> dict:
    out = {}
    fp8 = device == "cpu" or fp8_supported(torch.device(device))
    for name, (k, n) in shapes.items():
        torch.manual_seed(0)
        linear = nn.Linear(k, n, bias=False, device=device)
        kernels = {
            str(d).removeprefix("torch."): nn.Linear(k, n, bias=False, device=device, dtype=d)
            for d in dense_dtypes
        }
        for dense in kernels.values():
            dense.weight.data.copy_(linear.weight)
        act_dtype = dense_dtypes[0]  # the quantized kernels' activations: the default dtype
        kernels["int8"] = QuantizedLinear(linear, "int8")
        if fp8:
            kernels["fp8"] = QuantizedLinear(linear, "fp8")
            kernels["fp8_weight_only"] = WeightOnlyFp8(linear)
        per_rows = {}
        for m in rows:
            x = {d: torch.randn(m, k, device=device).to(d) for d in dense_dtypes}
            times = {label: [] for label in kernels}
            with torch.inference_mode():
                for _ in range(3):  # in turns, so drift falls on every kernel alike
                    for label, module in kernels.items():
                        xs = x[module.weight.dtype] if module.weight.dtype in x else x[act_dtype]
                        times[label].append(time_call(module, xs, device, reps))
            per_rows[m] = {label: min(t) for label, t in times.items()}
            say(
                f"{name} {k}x{n} rows {m}: "
                + ", ".join(f"{lb} {t * 1e3:.3f} ms" for lb, t in per_rows[m].items())
            )
        out[name] = {"in_features": k, "out_features": n, "seconds": per_rows}
    return out


def gptq_checkpoint(model_dir: Path) -> Path:
    """The random model's projections as a symmetric 4-bit GPTQ checkpoint (groups of
    128), beside it, quantized on the GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = model_dir.with_name(model_dir.name + "-gptq")
    if not (out / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
        save_packed(model, "gptq", out, AutoTokenizer.from_pretrained(model_dir), symmetric=True)
        del model
        free_memory()
    return out


def engine_part(report: Report, args, model_dir: Path, budget: Budget) -> None:
    cap = args.cap
    prompts, lengths = make_workload(
        args.num_requests, args.prompt_len, args.mean_output, cap, LLAMA_1B["vocab_size"], 0
    )
    warm = warm_up_workload(args.prompt_len, LLAMA_1B["vocab_size"], 0)
    engines = report.result["engines"]
    # the 4-bit engine second: issue 57 reads its batch-1 step against bf16's
    for quantization in (None, "gptq", "int8", "fp8"):
        label = quantization or "bfloat16"
        if budget.left() <= 0:
            engines[label] = budget_spent(args.budget_s)
            continue
        if quantization == "fp8" and not fp8_supported(torch.device("cuda")):
            engines[label] = skipped("this GPU has no fp8 GEMMs")
            continue

        def run(quantization=quantization):
            path = model_dir
            if quantization == "gptq":  # the checkpoint says so; the engine detects it
                path, quantization = gptq_checkpoint(model_dir), None
            llm = LLM(
                str(path), dtype="bfloat16", device="cuda", quantization=quantization,
                max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=args.prompt_len + cap,
                enable_prefix_caching=False, gpu_memory_utilization=0.85,
            )  # fmt: skip
            run_kvserve(llm, *warm)
            timed = run_kvserve(llm, prompts, lengths, budget.limit(args.limit_s))
            step = batch1_step(llm, prompts[0], 100, "cuda")
            runner = llm.engine.runner
            result = {
                "status": "ran",
                "weights": runner.weights.describe(),
                "linear_bytes": runner.weights.linear_bytes,
                "num_kv_blocks": runner.num_blocks,
                "throughput": {**asdict(timed), "tokens_per_s": timed.output_tokens / timed.seconds},
                "batch1_decode": step,
                "group_kernels": runner.group_timings,  # the 4-bit linears' candidates, timed
            }
            del llm, runner
            free_memory()
            return result

        try:
            engines[label] = run()
            say(f"kvserve {label}: {engines[label]}")
        except Exception as e:
            engines[label] = failed(e)
        report.write()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--mean-output", type=float, default=128)
    parser.add_argument("--cap", type=int, default=128)
    parser.add_argument("--limit-s", type=float, default=25, help="per engine's timed run")
    parser.add_argument("--budget-s", type=float, default=150, help="no engine starts after this")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, seconds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--out-dir", type=Path, default=None, help="write quantized_gemm_<machine>.json here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    budget = Budget(args.budget_s)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        shape, rows, reps = TINY, args.rows or [1, 40], args.reps or 3
    elif device == "cuda":
        shape, rows, reps = LLAMA_1B, args.rows or [1, 16, 64, 256, 1024, 4096], args.reps or 20
    else:
        shape, rows, reps = BUNDLED, args.rows or [1, 16, 64, 256], args.reps or 5
    dense = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16]
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    host = machine(device=device)
    path = args.out or result_path("quantized_gemm", host, args.smoke, args.out_dir)
    report = Report(path, "quantized_gemm", args, host)
    report.result.update(
        device=device_name,
        versions=software_versions(),
        threads=torch.get_num_threads(),
        shapes="tiny random Llama"
        if args.smoke
        else ("Llama-3.2-1B" if device == "cuda" else "SmolLM2-135M"),
        rows=rows,
        reps=reps,
        dense_dtypes=[str(d).removeprefix("torch.") for d in dense],
        fp8_gemm=device == "cpu" or fp8_supported(torch.device(device)),
        fp8_dtype=str(FP8),
        engines=skipped("the engine part runs on CUDA only") if device != "cuda" else {},
    )
    start = time.perf_counter()
    gemms = report.section("gemms", lambda: gemm_part(linear_shapes(shape), rows, dense, device, reps))
    if gemms is not None:
        report.result["gemms"] = gemms
    report.write()
    if device == "cuda":
        model_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-"))
        build_model(model_dir, LLAMA_1B, device)
        engine_part(report, args, model_dir, budget)
    report.result["seconds"] = time.perf_counter() - start
    report.write()
    say(f"wrote {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
