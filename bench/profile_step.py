"""Where an engine step's time goes, measured on the offline mixed workload.

Each phase of Engine.step is timed (scheduling, input preparation, the decoder forward,
lm_head, sampling, output objects), and inside the forward each kind of work: GEMMs,
attention, norms, the MLP activation, rotary, and what is left (Python per layer, small
torch ops). Times are self times: a GEMM inside attention counts as GEMM. The same
workload runs three ways: the torch attention backend with transformers' modules
(kvserve before the CPU fast path); the `cpu` backend's kernels called layer by layer
from FusedDecoder's Python loop, which shows each kind of kernel; and the same kernels
from decoder.c's one call per step (what runs by default where it applies), whose
kernels Python cannot see, so the breakdown shows what the Python between them cost.

    python -m bench.profile_step          # -> bench/results/profile_step_<machine>.json
"""

import argparse
import contextlib
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.models.llama import modeling_llama

import replica.engine
import replica.model_runner
from bench.machine import machine, write_result
from bench.runners import run_kvserve
from bench.workloads import make_mixed_workload
from kvserve import LLM
from replica.cpu import layers, ops


class SelfTimer:
    """Accumulates self time per category: entering a nested category pauses the outer one."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self._stack: list[list] = []  # [category, start of the running stretch]

    @contextlib.contextmanager
    def category(self, name: str):
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            inner = self._stack.pop()
            self.seconds[inner[0]] += now - inner[1]
            if self._stack:
                self._stack[-1][1] = now

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.category(name):
                return fn(*args, **kwargs)

        return timed


def instrument(timer: SelfTimer, llm: LLM, backend: str) -> list:
    """Wrap the engine's phases and the forward's kinds of work; returns undo actions."""
    engine, runner = llm.engine, llm.engine.runner
    native = getattr(runner.run_decoder, "native", None)  # before run_decoder is wrapped
    undo = []

    def patch(owner, name: str, category: str) -> None:
        original = getattr(owner, name)
        setattr(owner, name, timer.wrap(category, original))
        undo.append(lambda: setattr(owner, name, original))

    patch(engine, "step", "step: other (engine bookkeeping)")
    patch(engine.scheduler, "schedule", "step: scheduling")
    patch(runner, "execute", "step: input preparation")
    patch(runner, "run_decoder", "forward: other (Python per layer, small ops)")
    # lm_head's own GEMM counts as lm_head: call its class's forward from before patching.
    lm_head, lm_forward = runner.lm_head, type(runner.lm_head).forward
    runner.lm_head = timer.wrap("step: lm_head", lambda x: lm_forward(lm_head, x))
    undo.append(lambda: setattr(runner, "lm_head", lm_head))
    patch(replica.engine, "sample", "step: sampling")
    patch(engine.sampling, "batch", "step: sampling")
    patch(engine.output_processor, "append_token", "step: output objects (detokenize, stop checks)")
    if native is not None:
        patch(native, "forward", "forward: C decoder step (every layer's kernels)")
    if backend == "cpu":
        patch(layers.PackedLinear, "forward", "forward: GEMM")
        patch(ops, "paged_attention", "forward: attention (with rotary and KV write)")
        patch(ops, "rms_norm", "forward: norms (with residual adds)")
        patch(ops, "silu_mul", "forward: MLP activation")
    else:
        patch(torch.nn.Linear, "forward", "forward: GEMM")
        patch(modeling_llama.LlamaRMSNorm, "forward", "forward: norms (with residual adds)")
        patch(modeling_llama, "apply_rotary_pos_emb", "forward: rotary")
        key = f"kvserve_{runner.backend.name}"
        AttentionInterface.register(key, timer.wrap("forward: attention (with rotary and KV write)",
                                                    runner.backend.attention))  # fmt: skip
        undo.append(lambda: AttentionInterface.register(key, runner.backend.attention))
        act = type(runner.model.model.layers[0].mlp.act_fn)
        patch(act, "forward", "forward: MLP activation")
    return undo


def profile(backend: str, native: bool, prompts, lengths, engine_args: dict) -> dict:
    llm = LLM(None, attention_backend=backend, **engine_args)
    fused = llm.engine.runner.run_decoder if backend == "cpu" else None
    if fused is not None and not native:
        fused.native = None
    loop = "transformers' modules"
    if fused is not None:
        loop = "C (decoder.c)" if fused.native is not None else "FusedDecoder's Python loop"
    run_kvserve(llm, prompts[:4], [4] * 4)  # warm-up
    timer = SelfTimer()
    undo = instrument(timer, llm, backend)
    steps = 0
    original_step = llm.engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return original_step()

    llm.engine.step = counted_step
    start = time.perf_counter()
    run_kvserve(llm, prompts, lengths)
    wall = time.perf_counter() - start
    for action in undo:
        action()
    measured = sum(timer.seconds.values())
    return {
        "attention_backend": backend,
        "decoder_loop": loop,
        "wall_seconds": wall,
        "steps": steps,
        "output_tokens_per_s": sum(lengths) / wall,
        "seconds": dict(sorted(timer.seconds.items(), key=lambda kv: -kv[1])),
        "share": {k: v / measured for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])},
        "ms_per_step": {k: 1000 * v / steps for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/profile_step_<machine>.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine_args = dict(
        dtype="bfloat16", max_num_seqs=64, block_size=32, kv_cache_memory_gb=2.0, enable_prefix_caching=False
    )
    host = machine(threads=args.threads)
    prompts, lengths = make_mixed_workload(args.requests, (32, 160), 48, 256, 49152, seed=0)
    result = {
        "device": f"cpu: {host['cpu']}, {args.threads} threads",
        "model": "bundled SmolLM2-135M-Instruct",
        "workload": {"num_requests": args.requests, "prompt_lens": [32, 160], "mean_output": 48, "cap": 256},
        "engine_args": engine_args,
        "notes": "Self times per category, summed over the run; 'forward: other' is the decoder's time "
        "outside the listed kernels (Python per layer, embeddings, small torch ops); 'step: input "
        "preparation' is the runner's time outside the forward and lm_head (attention metadata, "
        "input tensors, gathering the rows that sample).",
        "runs": [
            profile(backend, native, prompts, lengths, engine_args)
            for backend in args.backends
            for native in ((False, True) if backend == "cpu" else (False,))
        ],
    }
    for run in result["runs"]:
        print(f"\n{run['attention_backend']} ({run['decoder_loop']}): {run['wall_seconds']:.1f} s, "
              f"{run['steps']} steps, "
              f"{run['output_tokens_per_s']:.0f} tok/s")  # fmt: skip
        for name, ms in run["ms_per_step"].items():
            print(f"  {ms:7.2f} ms/step  {run['share'][name]:6.1%}  {name}")
    print(f"\nwrote {write_result('profile_step', args, result, host, args.out)}")


if __name__ == "__main__":
    main()
