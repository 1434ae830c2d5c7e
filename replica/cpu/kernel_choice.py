"""Which CPU kernel runs where, chosen by timing the candidates on this machine.

A CPU flag does not predict the winner: gemm.c's AVX512-BF16 kernel and oneDNN trade
places between CPUs, and on CPUs with AMX oneDNN's matrix units win by a wide margin. So at
model load every distinct linear (shape, dtype, gated or not) is timed with each kernel
that can run it (linear_kernels.py) at row buckets spanning the steps' row counts, and the
fastest at each row count (interpolated between buckets) is kept; fresh prefills are
timed through the C attention kernel and through SDPA. Timings are cached per machine
(machine.py's fingerprint: CPU model, ISA flags, threads, torch and oneDNN versions) and
per build of kvserve's kernels, in ~/.cache/kvserve/kernels/timings_*.json (beside the
compiled kernels; $KVSERVE_KERNEL_CACHE moves them), so a second start on the same
machine measures nothing.

`cpu_kernels` forces a choice for A/B runs: "gemm.c" (kvserve's own kernels everywhere
they can run, the C attention kernel for fresh prefills), "onednn" or "torch" (that
library kernel for every linear, SDPA for fresh prefills)."""

import bisect
import collections
import copy
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.config import CPU_KERNEL_CHOICES
from replica.cpu import group_quant, linear_kernels, ops
from replica.cpu.abi import GroupWeight
from replica.cpu.build import library_key
from replica.cpu.group_quant import GroupQuantWeight
from replica.cpu.machine import fingerprint
from replica.model_loader import cache_root

logger = logging.getLogger(__name__)

# Row counts a step's linears see: a decode batch's sequences up to the token budget.
ROW_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 2048)
# Fresh-prefill attention is timed on this many chunks of FRESH_CHUNK rows.
FRESH_CHUNKS, FRESH_CHUNK = 4, 128
# Weight copies cycled through, more than a server CPU's L3 holds (4x this EPYC's 32 MB),
# so that each call reads its weight from memory as a step does: timed from cache,
# F.linear beat oneDNN at rows where it lost inside the model.
STREAMED_BYTES = 128 << 20
MIN_TIMED_S = 0.002  # a timing repeats one call until this much time has passed
IN_C_ROWS = 64  # time_linears calls gemm_group.c's kernels from C this many rows' worth at a time
# How time_linears times, in the timings cache's key: a new way makes old timings stale.
TIMING = "gemm_group.c from C, the mean of memory and cache"
FROM_CACHE = " from cache"  # time_linears' name for a gemm_group.c kernel's timing on one weight copy
ROUNDS = 3  # timings per candidate; the best counts
# The least part of a step's linear time that work-sharing kernels take for a pinned
# replica to run that step on every core (sharing_rows, CorePlan).
SHARED_MAJORITY = 0.5
MARGIN = 0.1  # how much faster than the default kernel (fastest()) another kernel must be
# A kernel this many times slower than the fastest at one bucket is not timed at larger
# ones (its time there counts as infinite): torch's int8 kernel on a CPU without AVX-512
# takes seconds a call at 2048 rows.
GIVE_UP_RATIO = 4.0
# Kernels whose cost at a few rows is a fixed one (a group weight dequantized at each call)
# and whose cost per row is a library GEMM's: they lose by far at one row, and may win at
# many, so they are timed at every bucket.
NEVER_GIVEN_UP = frozenset({linear_kernels.GROUP_DEQUANT})


@dataclass(frozen=True)
class LinearShape:
    out_features: int  # of the whole weight (a gated one: gate and up rows)
    in_features: int
    dtype: torch.dtype
    gated: bool = False
    # "int8": the int8 kernels run it too; a group format ("q4g32m", group_quant.py): its
    # weight holds a file's integers, which only the group kernels read
    quantization: str | None = None

    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.quantization:
            dtype = f"{self.quantization}/{dtype}"
        return f"linear {dtype} {self.out_features}x{self.in_features}{' gated' if self.gated else ''}"

    def kernels(self) -> tuple[str, ...]:
        """The candidates, in the order of preference that fastest() breaks ties by: a
        quantized linear's unquantized kernels stay candidates, for the row counts where
        they measure faster than every int8 one. A group-quantized linear has no float
        weight to run them on (it would take 3-4 times the memory)."""
        if group_quant.is_format(self.quantization):
            return linear_kernels.GROUP_KERNELS
        quantized = linear_kernels.INT8_KERNELS if self.quantization == "int8" else ()
        return quantized + linear_kernels.LINEAR_KERNELS


@dataclass(frozen=True)
class LinearChoice:
    """kernels[i] runs steps of up to bounds[i] rows (and more than bounds[i - 1]); larger
    steps run the last one."""

    bounds: tuple[int, ...]
    kernels: tuple[str, ...]
    # What it was chosen by: each kernel's seconds at each of `buckets` (none if forced).
    buckets: tuple[int, ...] = ()
    seconds: tuple[tuple[str, tuple[float, ...]], ...] = ()

    def kernel_for(self, rows: int) -> str:
        return self.kernels[min(bisect.bisect_left(self.bounds, rows), len(self.kernels) - 1)]

    def seconds_for(self, rows: int) -> float | None:
        """The chosen kernel's measured time at `rows`, interpolated; None if untimed."""
        timed = dict(self.seconds).get(self.kernel_for(rows))
        return None if timed is None else interpolated(self.buckets, list(timed), rows)

    def used(self) -> set[str]:
        return set(self.kernels)

    def describe(self) -> str:
        """e.g. 'gemm.c at <=40 rows, onednn above'."""
        if len(self.kernels) == 1:
            return self.kernels[0]
        runs = zip(self.bounds[:-1], self.kernels[:-1], strict=True)
        parts = [f"{kernel} at <={bound} rows" for bound, kernel in runs]
        return ", ".join([*parts, f"{self.kernels[-1]} above"])

    @classmethod
    def forced(cls, kernel: str) -> "LinearChoice":
        return cls((ROW_BUCKETS[-1],), (kernel,))


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """The row buckets a step of at most max_rows rows can fall in."""
    end = bisect.bisect_left(ROW_BUCKETS, max_rows) + 1
    return ROW_BUCKETS[:end]


def interpolated(buckets: tuple[int, ...], seconds: list[float], rows: int) -> float:
    """A kernel's time at `rows`, linear between the buckets it was timed at (and the
    first or last bucket's time outside them). Infinite next to a bucket where it was not
    timed (given up on): nothing is known of it there, and inf - inf would give NaN, which
    loses every comparison and so would keep whatever kernel was compared against."""
    i = bisect.bisect_left(buckets, rows)
    if i == 0 or i == len(buckets):
        return seconds[min(i, len(buckets) - 1)]
    low, high = buckets[i - 1], buckets[i]
    if math.isinf(seconds[i - 1]) or math.isinf(seconds[i]):
        return math.inf
    return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (rows - low) / (high - low)


def margin(kernel: str, default: str) -> float:
    """How much faster than fastest()'s default `kernel` must be to run in its place:
    MARGIN, but none between gemm_group.c's kernels: they read one layout and each runs in
    decoder.c's one-call loop, so a choice between them that flips on noise costs neither."""
    same_layout = {kernel, default} <= set(linear_kernels.GROUP_GEMM_C_KERNELS)
    return 0.0 if same_layout else MARGIN


def fastest(buckets: tuple[int, ...], seconds: dict[str, list[float]]) -> LinearChoice:
    """The fastest kernel at every row count up to the last bucket; seconds[kernel][i] is
    its time at buckets[i], and times in between are interpolated: a step's rows fall
    anywhere between the buckets, and the kernel that wins at a bucket's upper end can
    lose well below it. The default (for a group-quantized weight, gemm_group.c's
    int8-activation kernel where it runs, in bf16 models, else its exact one; an int8
    kernel where one was timed; else gemm.c where it runs, else oneDNN, else the first
    kernel) keeps a row count unless another kernel beats it by more than margin() (MARGIN,
    but none between gemm_group.c's kernels): a choice that flips on noise costs a second
    weight layout (for a quantized linear, a float one beside the int8 one), and gemm.c
    (or its int8 or group kernel) is the default because decoder.c's one-call step loop runs only
    in steps where every linear chose it, which saves per-kernel calls a linear timed
    alone does not show (offline.py --kernel-ab measures the whole). A kernel that beats
    the default at one bucket only, between two where it does not, takes no row counts
    around it: such lone wins were noise (another kernel from one start-up to the next),
    and each costs a layout and, for its steps, the one-call loop. A win over a default
    that was given up on (infinite) is never lone: the default cannot run there.

    Infinite times (kernels given up on, time_buckets) never run: at every row count the
    kernel chosen has a finite time wherever any kernel has one."""
    preferred = (
        linear_kernels.GROUP_Q8_GEMM_C,
        linear_kernels.GROUP_GEMM_C,
        *linear_kernels.INT8_KERNELS,
        linear_kernels.GEMM_C,
        linear_kernels.ONEDNN,
    )
    default = next((k for k in preferred if k in seconds), next(iter(seconds)))

    def beats_default(kernel: str, i: int) -> bool:
        return seconds[kernel][i] * (1 + margin(kernel, default)) < seconds[default][i]

    def lone_win(kernel: str, i: int) -> bool:
        return (
            0 < i < len(buckets) - 1
            and math.isfinite(seconds[default][i])
            and not (beats_default(kernel, i - 1) or beats_default(kernel, i + 1))
        )

    # kernel -> at each bucket, whether it may run at the row counts next to it
    trusted = {k: [k == default or not lone_win(k, i) for i in range(len(buckets))] for k in seconds}
    bounds: list[int] = []
    kernels: list[str] = []
    for rows in range(1, buckets[-1] + 1):
        above = min(bisect.bisect_left(buckets, rows), len(buckets) - 1)  # the buckets around rows
        around = (max(above - 1, 0), above) if buckets[above] != rows else (above,)
        times = {
            kernel: interpolated(buckets, s, rows)
            for kernel, s in seconds.items()
            if all(trusted[kernel][i] for i in around)
        }
        best = min(times, key=times.__getitem__)
        kernel = best if times[best] * (1 + margin(best, default)) < times[default] else default
        if kernels and kernels[-1] == kernel:
            bounds[-1] = rows
        else:
            bounds.append(rows)
            kernels.append(kernel)
    timed = tuple((kernel, tuple(s)) for kernel, s in seconds.items())
    return LinearChoice(tuple(bounds), tuple(kernels), buckets, timed)


def sharing_rows(choices: list[LinearChoice], max_rows: int, sharing: tuple[str, ...]) -> int:
    """The most rows, up to max_rows, such that kernels in `sharing` take at least
    SHARED_MAJORITY of a step's linear time at every step of 1 to that many rows, by the
    chooser's own timings (a forced choice, untimed, counts each linear alike); 0 where
    not even one row's do. A kernel that gives each thread a fixed share stalls its step
    while a thread's core is taken; one that runs a small part of the step (the lm_head,
    where oneDNN wins at one row) stalls only that part."""
    weights = collections.Counter(choices)  # every layer's linears share a few choices
    if not weights:
        return 0
    for rows in range(1, max_rows + 1):
        shared = total = 0.0
        for choice, count in weights.items():
            seconds = choice.seconds_for(rows)
            seconds = count * (1.0 if seconds is None else seconds)
            if not math.isfinite(seconds):
                return rows - 1
            total += seconds
            shared += seconds if choice.kernel_for(rows) in sharing else 0.0
        if shared < SHARED_MAJORITY * total:
            return rows - 1
    return max_rows


def int8_kept_out(seconds: dict[str, list[float]]) -> str:
    """Why a linear's int8 weight runs at no row count: each kernel's time at one row
    (decoding a single sequence), where the int8 kernels save most by reading a quarter
    of bf16's bytes (half of fp32's), and still lost. torch's int8 kernel runs on every
    CPU, so one was always timed."""
    at_one = ", ".join(
        f"{k} {seconds[k][0] * 1e6:.0f} us" for k in sorted(seconds, key=lambda k: seconds[k][0])
    )
    return f"no int8 kernel was faster at any step size timed; at 1 row: {at_one}"


def one_layout(buckets: tuple[int, ...], seconds: dict[str, list[float]]) -> LinearChoice:
    """fastest() among the kernels that read one layout of a group-quantized weight: the
    file's integers as they are (gemm_group.c's kernels and the dequantizing one), or
    torch's int4 packing. Both layouts at once would double the weight's memory, which is
    what 4 bits are for. torch's layout takes the linear only where its choice is more than
    MARGIN faster, on average over the buckets, than the first's (each choice's time at a
    bucket taken relative to the fastest kernel there)."""
    own = {k: s for k, s in seconds.items() if k != linear_kernels.GROUP_TORCH}
    choices = [fastest(buckets, own)] if own else []
    if linear_kernels.GROUP_TORCH in seconds:
        choices.append(fastest(buckets, {linear_kernels.GROUP_TORCH: seconds[linear_kernels.GROUP_TORCH]}))
    best = [min(s[i] for s in seconds.values()) for i in range(len(buckets))]

    def slowdown(choice: LinearChoice) -> float:
        ratios = [seconds[choice.kernel_for(rows)][i] / best[i] for i, rows in enumerate(buckets)]
        return sum(ratios) / len(ratios)

    if len(choices) == 2 and slowdown(choices[1]) * (1 + MARGIN) < slowdown(choices[0]):
        return choices[1]
    return choices[0]


def _time_rounds(calls: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Seconds per call of each of `calls`: after one untimed call each, ROUNDS rounds in
    which the calls take turns, each repeated over at least MIN_TIMED_S; the best round
    counts. Taking turns puts the machine's drift on every candidate alike."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(ROUNDS):
        for name, call in calls.items():
            count, start = 0, time.perf_counter()
            while True:
                call()
                count += 1
                elapsed = time.perf_counter() - start
                if elapsed >= MIN_TIMED_S:
                    break
            best[name] = min(best[name], elapsed / count)
    return best


def time_buckets(
    kernels: list[str], buckets: tuple[int, ...], measure: Callable[[int, list[str]], dict[str, float]]
) -> dict[str, list[float]]:
    """Each kernel's seconds at each bucket, measure(rows, kernels) timing the kernels
    still in the running at that bucket's rows: one GIVE_UP_RATIO times slower than the
    fastest at a bucket is not timed at larger ones, and counts as infinite there (but
    for NEVER_GIVEN_UP's)."""
    times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
    timed = list(kernels)
    for rows in buckets:
        measured = measure(rows, timed)
        for kernel in kernels:
            times[kernel].append(measured.get(kernel, math.inf))
        best = min(measured.values())
        timed = [k for k in timed if measured[k] <= GIVE_UP_RATIO * best or k in NEVER_GIVEN_UP]
    return times


def time_linears(kernels: list[str], shape: LinearShape, buckets: tuple[int, ...]) -> dict[str, list[float]]:
    """Seconds per call of each kernel on a random weight of `shape` at each bucket's
    rows (time_buckets), cycling through copies of the weight so that each call reads it
    from memory, as a step reads each layer's weights once. gemm_group.c's kernels are
    called from C, IN_C_ROWS rows' worth of calls at a time, as decoder.c's one-call step
    calls them: a call from Python costs tens of microseconds, the same for every kernel,
    which at one row hides most of the difference between two of them. Each of those is
    also timed on one copy over and over (from cache), and counts the mean of the two: a
    decode step of a small model finds part of its weights in cache, where the kernel that
    computes faster gains what a timing from memory alone does not show when two tie there."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape.out_features, shape.in_features, generator=g) * 0.02).to(shape.dtype)
    if group_quant.is_format(shape.quantization):
        weight = group_quant.quantize(weight, shape.quantization)
    weight_bytes = (
        weight.nbytes() if isinstance(weight, GroupQuantWeight) else weight.numel() * weight.element_size()
    )
    copies = max(1, min(256, STREAMED_BYTES // weight_bytes))
    out_features = shape.out_features // (2 if shape.gated else 1)
    packed = {
        kernel: [linear_kernels.pack(kernel, copy.deepcopy(weight), None, shape.gated) for _ in range(copies)]
        for kernel in kernels
    }
    layouts = {kernel: itertools.cycle(layouts) for kernel, layouts in packed.items()}
    # gemm_group.c's kernels run as decoder.c's step runs them, from C, one layer's weight
    # after another's (group_linear_each): the copies twice over, so that any run of them
    # in turn lies side by side.
    in_c = {
        kernel: (GroupWeight * (2 * copies))(*(w.struct() for w, _ in packed[kernel] * 2))
        for kernel in kernels
        if kernel in linear_kernels.GROUP_GEMM_C_KERNELS
    }
    in_cache = {
        kernel: (GroupWeight * IN_C_ROWS)(*[weights[0]] * IN_C_ROWS) for kernel, weights in in_c.items()
    }

    def measure(rows: int, timed: list[str]) -> dict[str, float]:
        x = torch.randn(rows, shape.in_features, generator=g).to(shape.dtype)
        per_c_call = max(1, min(copies, IN_C_ROWS // rows))
        starts = {kernel: itertools.cycle(range(0, copies, per_c_call)) for kernel in in_c}

        def call(kernel: str, cached: bool = False) -> None:
            if kernel in in_c:
                weights = (in_cache[kernel], 0) if cached else (in_c[kernel], next(starts[kernel]))
                number = linear_kernels.GROUP_LINEAR_KERNEL[kernel]
                group_quant.group_linear_each(
                    x, *weights, per_c_call, None, out_features, shape.gated, number
                )
            else:
                w, b = next(layouts[kernel])
                linear_kernels.run(kernel, x, w, b, out_features, shape.gated)

        calls = {k: functools.partial(call, k) for k in timed}
        calls |= {k + FROM_CACHE: functools.partial(call, k, True) for k in timed if k in in_c}
        seconds = _time_rounds(calls)
        return {
            k: (seconds[k] + seconds[k + FROM_CACHE]) / 2 / per_c_call if k in in_c else seconds[k]
            for k in timed
        }

    return time_buckets(kernels, buckets, measure)


def time_fresh_prefill(
    by_sdpa: bool, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> float:
    """Seconds for one layer's attention over FRESH_CHUNKS fresh prefills of FRESH_CHUNK
    rows (rotary, KV write and attention), through SDPA or the C kernel."""
    from replica.attention.metadata import build_metadata

    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-FRESH_CHUNK // block_size)
    cache_shape = (FRESH_CHUNKS * blocks_per_seq, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = torch.zeros(cache_shape, dtype=dtype), torch.zeros(cache_shape, dtype=dtype)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(FRESH_CHUNKS)]
    rows = FRESH_CHUNKS * FRESH_CHUNK
    q = torch.randn(rows, num_heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    angles = torch.arange(FRESH_CHUNK).repeat(FRESH_CHUNKS)[:, None] * torch.rand(head_dim, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    lens = [FRESH_CHUNK] * FRESH_CHUNKS

    def call() -> None:
        meta = build_metadata(tables, lens, lens, block_size, torch.device("cpu"))
        ops.paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5, cos, sin)

    saved = ops.FRESH_PREFILLS_BY_SDPA
    ops.FRESH_PREFILLS_BY_SDPA = by_sdpa
    try:
        return _time_rounds({"attention": call})["attention"]
    finally:
        ops.FRESH_PREFILLS_BY_SDPA = saved


class KernelChooser:
    """Measures (or reads from the cache) and remembers what it chose, for the start-up
    log line. One per model load; `save` writes new timings back to the cache."""

    def __init__(
        self,
        forced: str = "auto",
        max_rows: int = ROW_BUCKETS[-1],
        cache_dir: Path | None = None,
        quantization: str | None = None,
    ):
        """max_rows: the most rows a step gives a linear (the token budget). quantization:
        the engine's; every linear PackedLinear.choose chooses for runs its kernels."""
        if forced not in CPU_KERNEL_CHOICES:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_CHOICES}, got {forced!r}")
        self.forced, self.max_rows, self.quantization = forced, max_rows, quantization
        # a changed kernel, or a changed way of timing them, is timed again
        self.machine = {**fingerprint(), "kernels": library_key(), "timing": TIMING}
        key = hashlib.sha256(json.dumps(self.machine, sort_keys=True).encode()).hexdigest()[:16]
        cache_dir = cache_dir or Path(os.environ.get("KVSERVE_KERNEL_CACHE") or cache_root() / "kernels")
        self.cache_path = cache_dir / f"timings_{key}.json"
        # "linear ..." or "fresh prefill ..." -> kernel -> str(bucket rows) -> seconds
        self.timings: dict[str, dict[str, dict[str, float]]] = self._read_cache()
        self.measured: set[str] = set()
        self.chosen: dict[str, str] = {}  # what was chosen where, for the log line
        # int8 linears that no int8 kernel runs at any row count, and why (int8_kept_out)
        self.kept_out: dict[str, str] = {}
        # Every layer of a model has the same shapes: each is chosen once per load.
        self._choices: dict[tuple[LinearShape, tuple[int, ...]], LinearChoice] = {}

    def linear(self, shape: LinearShape, max_rows: int | None = None) -> LinearChoice:
        """The kernel per row count for a linear of `shape` in steps of up to max_rows
        (default: the chooser's)."""
        where = shape.key().removeprefix("linear ")
        runnable = [
            k
            for k in shape.kernels()
            if linear_kernels.can_run(
                k, shape.dtype, shape.in_features, shape.quantization, shape.out_features
            )
        ]
        if self.forced != "auto":
            # A quantized linear forced to "gemm.c" or "torch" runs that kernel's int8 (or
            # group) version.
            kind = "group" if group_quant.is_format(shape.quantization) else shape.quantization
            kernel = f"{kind} {self.forced}" if kind else self.forced
            if kernel not in runnable:
                raise ValueError(
                    f"cpu_kernels={self.forced!r} cannot run a {shape.key()} here "
                    f"(this CPU and dtype can run: {', '.join(runnable)})"
                )
            choice = LinearChoice.forced(kernel)
        else:
            buckets = buckets_up_to(max_rows or self.max_rows)
            choice = self._choices.get((shape, buckets))
            if choice is None:
                seconds = self._timed(
                    shape.key(), runnable, buckets, lambda: time_linears(runnable, shape, buckets)
                )
                choice = self._choices[shape, buckets] = (
                    one_layout(buckets, seconds)
                    if group_quant.is_format(shape.quantization)
                    else fastest(buckets, seconds)
                )
                if shape.quantization == "int8" and not choice.used() & set(linear_kernels.INT8_KERNELS):
                    self.kept_out[where] = int8_kept_out(seconds)
        self.chosen[where] = choice.describe()
        return choice

    def fresh_prefills_by_sdpa(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> bool:
        """Whether SDPA, not the C kernel, attends prefills with nothing cached before them."""
        if self.forced != "auto":
            by_sdpa = self.forced != linear_kernels.GEMM_C
        else:
            dtype_name = str(dtype).removeprefix("torch.")
            key = f"fresh prefill {dtype_name} {num_heads}/{num_kv_heads}x{head_dim} block {block_size}"
            args = (num_heads, num_kv_heads, head_dim, block_size, dtype)
            bucket = (FRESH_CHUNKS * FRESH_CHUNK,)
            seconds = self._timed(
                key, ["c", "sdpa"], bucket, lambda: {"c": [time_fresh_prefill(False, *args)],
                                                     "sdpa": [time_fresh_prefill(True, *args)]}
            )  # fmt: skip
            by_sdpa = seconds["sdpa"][0] < seconds["c"][0]
        self.chosen["fresh prefill attention"] = "sdpa" if by_sdpa else "c kernel"
        return by_sdpa

    def describe(self) -> str:
        how = f"forced {self.forced}" if self.forced != "auto" else "measured" if self.measured else "cached"
        return f"cpu kernels ({how}): " + "; ".join(f"{where}: {what}" for where, what in self.chosen.items())

    def save(self) -> None:
        """Writes the timings measured in this load to the cache (atomically: replicas on
        one machine may load at once)."""
        if not self.measured:
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            latest = self._read_cache()
            latest.update({key: self.timings[key] for key in self.measured})
            with tempfile.NamedTemporaryFile("w", dir=self.cache_path.parent, delete=False) as f:
                json.dump({"machine": self.machine, "timings": latest}, f, indent=1)
            os.replace(f.name, self.cache_path)
        except OSError as e:  # a read-only home is no reason to fail a load
            logger.warning("cannot cache kernel timings in %s: %s", self.cache_path, e)

    def _timed(
        self, key: str, kernels: list[str], buckets: tuple[int, ...], measure
    ) -> dict[str, list[float]]:
        """Seconds of each kernel at each bucket of `key`: cached, or all measured now
        (measure() -> {kernel: seconds per bucket}), so that they share the machine's state."""
        entry = self.timings.setdefault(key, {})
        if not all(str(b) in entry.get(kernel, {}) for kernel in kernels for b in buckets):
            for kernel, measured in measure().items():
                entry[kernel] = {
                    **entry.get(kernel, {}),
                    **{str(b): s for b, s in zip(buckets, measured, strict=True)},
                }
            self.measured.add(key)
        return {kernel: [entry[kernel][str(b)] for b in buckets] for kernel in kernels}

    def _read_cache(self) -> dict:
        try:
            saved = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return {}
        return saved.get("timings", {}) if saved.get("machine") == self.machine else {}
