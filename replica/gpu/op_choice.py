"""Which implementation of each fused element-wise op runs on this GPU, per row count, by
measurement at load: kvserve's Triton kernel (fused_ops.py, one launch), its torch
reference (transformers' ops, several launches), or that reference compiled by
torch.compile (inductor fuses it into kernels of its own: the library's candidate, as vLLM
compiles its decoder), as the CPU's linears are chosen (replica/cpu/kernel_choice.py: the
same buckets, the same `fastest`, Triton the default that another must beat by the
margin). Each is timed with CUDA events on the model's own shapes, alone; one that fails
(a compile error) counts as never faster. The choice goes to the log. Where nothing is
timed (a CPU, the tests under the Triton interpreter), the Triton kernels run.
"""

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from replica.cpu.kernel_choice import LinearChoice, buckets_up_to, fastest
from replica.gpu import fused_ops

logger = logging.getLogger(__name__)


def compiled(reference: Callable) -> Callable:
    """`reference` under torch.compile, compiled at its first call (dynamic row counts)."""
    fn = None

    def run(*args, **kwargs):
        nonlocal fn
        if fn is None:
            fn = torch.compile(reference, dynamic=True)
        return fn(*args, **kwargs)

    return run


TRITON, TORCH, COMPILED = "triton", "torch", "torch.compile"
IMPLEMENTATIONS = {
    "add_rms_norm": {
        TRITON: fused_ops.add_rms_norm,
        TORCH: fused_ops.add_rms_norm_reference,
        COMPILED: compiled(fused_ops.add_rms_norm_reference),
    },
    "silu_mul": {
        TRITON: fused_ops.silu_mul,
        TORCH: fused_ops.silu_mul_reference,
        COMPILED: compiled(fused_ops.silu_mul_reference),
    },
    "rope_write_kv": {
        TRITON: fused_ops.rope_write_kv,
        TORCH: fused_ops.rope_write_kv_reference,
        # rotary compiled; the cache write's own Triton kernel beside it
        COMPILED: partial(fused_ops.rope_write_kv_reference, rotary=compiled(fused_ops.rotary_reference)),
    },
}
ROUNDS, CALLS = 5, 20


@dataclass
class OpChoices:
    """op name -> its choice of implementation by row count; an op not in it runs Triton."""

    choices: dict[str, LinearChoice] = field(default_factory=dict)

    def pick(self, op: str, rows: int) -> Callable:
        choice = self.choices.get(op)
        return IMPLEMENTATIONS[op][choice.kernel_for(rows) if choice else TRITON]

    def describe(self) -> str:
        return "; ".join(f"{op}: {c.describe()}" for op, c in self.choices.items()) or "triton everywhere"


def gpu_seconds(call: Callable[[], None]) -> float:
    """A call's time on the GPU: the median over ROUNDS of CALLS back-to-back calls, with
    CUDA events, after a warm-up (Triton's compile)."""
    call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            call()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(rounds)


@dataclass(frozen=True)
class OpShapes:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    head_norms: bool  # Qwen3's per-head norms before rotary


Timings = dict[str, dict[str, list[float]]]  # op -> implementation -> seconds at each bucket


def time_ops(shapes: OpShapes, buckets: tuple[int, ...], device: torch.device) -> Timings:
    s = shapes
    out: Timings = {op: {name: [] for name in impls} for op, impls in IMPLEMENTATIONS.items()}
    weight = torch.ones(s.hidden, dtype=s.dtype, device=device)
    head_weight = torch.ones(s.head_dim, dtype=s.dtype, device=device)
    norms = (head_weight, head_weight, 1e-6) if s.head_norms else None
    num_blocks = -(-buckets[-1] // s.block_size)
    cache_shape = (num_blocks, s.num_kv_heads, s.block_size, s.head_dim)
    k_cache = torch.zeros(cache_shape, dtype=s.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    for rows in buckets:
        x = torch.randn(rows, s.hidden, dtype=s.dtype, device=device)
        residual = torch.randn_like(x)
        gate_up = torch.randn(rows, 2 * s.intermediate, dtype=s.dtype, device=device)
        qkv = torch.randn(rows, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, dtype=s.dtype, device=device)
        cos = torch.randn(rows, s.head_dim, dtype=s.dtype, device=device)
        slots = torch.arange(rows, device=device)
        for name in (TRITON, TORCH, COMPILED):
            impl = {op: impls[name] for op, impls in IMPLEMENTATIONS.items()}
            calls = {
                "add_rms_norm": partial(impl["add_rms_norm"], x, weight, 1e-6, residual),
                "silu_mul": partial(impl["silu_mul"], gate_up),
                "rope_write_kv": partial(
                    impl["rope_write_kv"],
                    qkv,
                    cos,
                    cos,
                    k_cache,
                    v_cache,
                    slots,
                    s.num_heads,
                    s.num_kv_heads,
                    norms=norms,
                ),  # fmt: skip
            }
            for op, call in calls.items():
                try:
                    out[op][name].append(gpu_seconds(call))
                except Exception as e:  # never chosen; the others still are
                    logger.warning("%s's %s candidate failed at %d rows: %s", op, name, rows, e)
                    out[op][name].append(math.inf)
    return out


def choose_ops(shapes: OpShapes, max_rows: int, device: torch.device) -> tuple[OpChoices, dict]:
    """The choices, and the buckets and timings they came from."""
    buckets = buckets_up_to(max_rows)
    timings = time_ops(shapes, buckets, device)
    choices = OpChoices({op: fastest(buckets, seconds) for op, seconds in timings.items()})
    return choices, {"buckets": buckets, **timings}
