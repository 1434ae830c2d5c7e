"""The CPU kernel chooser's choice (replica/cpu/kernel_choice.py: time_buckets' give-up
rule, then fastest) as properties: over arbitrary timing tables (finite and infinite
times, ties, kernels given up at any bucket), and replayed on the recorded timings of
every machine seen. A kernel that was not timed at a row count, or lost there by more
than the margin, never runs there.

Recorded timings come from three places, so that a new machine's timings are added by
dropping its file in: tests/data/kernel_timings/ and ../shared/machines/ (the timing
cache's own format, ~/.cache/kvserve/kernels/timings_*.json) and bench/results/
kernel_choice_*.json (what bench/kernel_choice.py writes)."""

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.cpu.affinity import BURST_MIN_TOKENS
from replica.cpu.kernel_choice import (
    GIVE_UP_RATIO,
    MARGIN,
    SHARED_MAJORITY,
    LinearChoice,
    fastest,
    interpolated,
    margin,
    sharing_rows,
    time_buckets,
)
from replica.cpu.linear_kernels import FP32_SHARING_KERNELS, GROUP_SHARING_KERNELS

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("group q8 gemm.c", "group gemm.c", "int8 gemm.c", "gemm.c", "onednn", "torch")


def recorded_tables() -> list[tuple[str, dict[str, dict[str, float]]]]:
    """(where, {kernel: {bucket rows: seconds}}) for every linear of every machine seen."""
    tables, seen = [], set()
    cache_files = [*sorted((ROOT / "tests/data/kernel_timings").glob("*.json"))]
    cache_files += sorted((ROOT.parent / "shared/machines").glob("*kernel_timings*.json"))
    for path in cache_files:
        if path.read_bytes() in seen:  # a shared file already copied into tests/data
            continue
        seen.add(path.read_bytes())
        timings = json.loads(path.read_text())["timings"]
        tables += [(f"{path.name}: {key}", t) for key, t in timings.items() if key.startswith("linear")]
    for path in sorted((ROOT / "bench/results").glob("kernel_choice_*.json")):
        for run in json.loads(path.read_text())["runs"]:
            for key, t in run["seconds"].items():
                if key.startswith("linear"):
                    tables.append((f"{path.name} ({run['threads']} threads): {key}", t))
    return tables


RECORDED = recorded_tables()


def trusted(buckets, seconds, default, kernel, i) -> bool:
    """fastest()'s lone-win rule, stated on its own: a kernel that beats the default by
    the margin at neither neighbour of an inner bucket, where the default has a time, does
    not run next to that bucket (noise, in the timings seen)."""

    def beats(j):
        return seconds[kernel][j] * (1 + margin(kernel, default)) < seconds[default][j]

    inner = 0 < i < len(buckets) - 1
    return kernel == default or not (
        inner and math.isfinite(seconds[default][i]) and not (beats(i - 1) or beats(i + 1))
    )


def default_of(seconds) -> str:
    return next((k for k in KERNELS if k in seconds), next(iter(seconds)))


def check_choice(buckets, seconds) -> None:
    """At every row count from 1 to the last bucket: the kernel chosen has a finite time
    wherever any kernel has one, and is within MARGIN of the fastest kernel that may run
    there (the lone-win rule aside)."""
    choice = fastest(buckets, seconds)
    default = default_of(seconds)
    for rows in range(1, buckets[-1] + 1):
        above = min(next(i for i, b in enumerate(buckets) if b >= rows), len(buckets) - 1)
        around = (above,) if buckets[above] == rows else (above - 1, above)
        times = {k: interpolated(buckets, s, rows) for k, s in seconds.items()}
        allowed = [k for k in seconds if all(trusted(buckets, seconds, default, k, i) for i in around)]
        chosen = choice.kernel_for(rows)
        where = f"{rows} rows: chose {chosen} ({times[chosen]:.3g} s) among {times}"
        if any(math.isfinite(t) for t in times.values()):
            assert math.isfinite(times[chosen]), where
        best = min(times[k] for k in allowed)
        assert chosen in allowed, where
        assert times[chosen] <= (1 + MARGIN) * best or times[chosen] == best, where


# A time: a handful of shared values (ties), any positive value, or given up on.
times_st = st.one_of(st.sampled_from([1e-4, 2e-4, 1e-3]), st.floats(1e-6, 1.0), st.just(math.inf))


@st.composite
def tables(draw, pruned: bool):
    """Buckets and {kernel: seconds per bucket}: arbitrary (any kernel infinite at any
    bucket), or as time_buckets leaves them (given up after losing by GIVE_UP_RATIO)."""
    buckets = tuple(sorted(draw(st.sets(st.integers(1, 300), min_size=1, max_size=6))))
    kernels = draw(st.lists(st.sampled_from(KERNELS), min_size=1, max_size=4, unique=True))
    if not pruned:
        return buckets, {
            k: draw(st.lists(times_st, min_size=len(buckets), max_size=len(buckets))) for k in kernels
        }
    raw = {
        k: draw(st.lists(st.floats(1e-6, 1.0), min_size=len(buckets), max_size=len(buckets))) for k in kernels
    }
    index = {b: i for i, b in enumerate(buckets)}
    return buckets, time_buckets(
        kernels, buckets, lambda rows, timed: {k: raw[k][index[rows]] for k in timed}
    )


@settings(max_examples=300, deadline=None)
@given(tables(pruned=False))
def test_any_table_never_runs_an_infinite_or_beaten_kernel(table):
    check_choice(*table)


@settings(max_examples=300, deadline=None)
@given(tables(pruned=True))
def test_tables_with_kernels_given_up_never_run_them(table):
    buckets, seconds = table
    for s in seconds.values():  # once given up on, a kernel stays given up on
        first = next((i for i, t in enumerate(s) if math.isinf(t)), len(s))
        assert all(math.isinf(t) for t in s[first:])
    assert all(any(math.isfinite(s[i]) for s in seconds.values()) for i in range(len(buckets)))
    check_choice(buckets, seconds)


def test_a_default_given_up_on_runs_at_no_row_count_above():
    """The AMX Xeon's case: gemm.c (the default) given up after 64 rows; between two of
    its infinite buckets its time was NaN, which lost no comparison, so it kept them."""
    buckets = (1, 8, 32, 64, 128, 256, 512, 2048)
    inf = math.inf
    seconds = {
        "gemm.c": [0.07, 0.10, 0.35, 0.67, inf, inf, inf, inf],
        "onednn": [0.10, 0.09, 0.11, 0.13, 0.16, 0.37, 0.82, 1.62],
    }
    choice = fastest(buckets, seconds)
    assert all(choice.kernel_for(rows) == "onednn" for rows in range(65, 4097))
    assert math.isinf(interpolated(buckets, seconds["gemm.c"], 200))
    assert math.isinf(interpolated(buckets, seconds["gemm.c"], 100))
    assert interpolated(buckets, seconds["gemm.c"], 4096) == inf


@settings(max_examples=200, deadline=None)
@given(tables(pruned=False))
def test_a_choice_knows_the_time_of_the_kernel_it_runs(table):
    buckets, seconds = table
    choice = fastest(buckets, seconds)
    for rows in range(1, buckets[-1] + 1):
        expected = interpolated(buckets, seconds[choice.kernel_for(rows)], rows)
        assert choice.seconds_for(rows) == expected
    assert LinearChoice.forced("onednn").seconds_for(1) is None


def shared_part(
    choices: list[LinearChoice], rows: int, sharing: tuple[str, ...] = FP32_SHARING_KERNELS
) -> float:
    """sharing_rows' rule, linear by linear: the sharing kernels' part of the time."""
    times = [(c.kernel_for(rows), c.seconds_for(rows)) for c in choices]
    total = sum(t for _, t in times)
    return sum(t for k, t in times if k in sharing) / total if total else 1.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(tables(pruned=True), min_size=1, max_size=4),
    st.lists(st.integers(1, 30), min_size=7, max_size=7),
)
def test_replicas_share_cores_where_sharing_kernels_take_most_of_every_step(linear_tables, counts):
    """Over arbitrary timings and numbers of each linear: steps share every core up to the
    first row count where the sharing kernels take less than SHARED_MAJORITY of the linear
    time; adding linears that run sharing kernels never takes rows away."""
    choices = [fastest(*t) for t, n in zip(linear_tables, counts, strict=False) for _ in range(n)]
    max_rows = min(t[0][-1] for t in linear_tables)
    short = [rows for rows in range(1, max_rows + 1) if shared_part(choices, rows) < SHARED_MAJORITY]
    expected = short[0] - 1 if short else max_rows
    assert sharing_rows(choices, max_rows, FP32_SHARING_KERNELS) == expected
    sharing = LinearChoice.forced("gemm.c")
    assert sharing_rows(choices + [sharing] * counts[4], max_rows, FP32_SHARING_KERNELS) >= expected
    assert sharing_rows([sharing] * counts[5], max_rows, FP32_SHARING_KERNELS) == max_rows
    assert sharing_rows([LinearChoice.forced("onednn")] * counts[6], max_rows, FP32_SHARING_KERNELS) == 0
    assert sharing_rows([], max_rows, FP32_SHARING_KERNELS) == 0


def test_an_lm_head_on_onednn_at_one_row_keeps_every_core():
    """The case met on the Zen 3 EPYC: its SmolLM2's 120 decoder linears on gemm.c at every
    row count, its lm_head (a fifth of the weights) on oneDNN at 1 and 2 rows. oneDNN's
    fixed shares stall only the lm_head's part of a step, so the replica keeps every core;
    were the lm_head most of a step, it would not."""
    buckets = (1, 8, 64)
    layer = fastest(buckets, {"gemm.c": [1e-4, 2e-4, 1e-3], "onednn": [2e-4, 4e-4, 2e-3]})
    head = fastest(buckets, {"gemm.c": [3e-4, 5e-4, 3e-3], "onednn": [2e-4, 6e-4, 4e-3]})
    assert head.kernel_for(1) == "onednn" and head.kernel_for(64) == "gemm.c"
    assert sharing_rows([layer] * 120 + [head], 64, FP32_SHARING_KERNELS) == 64
    assert sharing_rows([layer] + [head] * 10, 64, FP32_SHARING_KERNELS) == 0


def test_decodes_share_cores_up_to_where_the_group_kernels_give_way_to_onednn():
    """The case met on the Zen 4 EPYC in bf16: the bundled GGUF's linears on the group
    kernels up to 32 or 64 rows, dequantized for oneDNN beyond. Steps up to 32 rows share
    every core, larger ones keep to the steady cores."""
    buckets = (1, 8, 32, 64, 128)
    sharing = ("group q8 gemm.c",)
    layer = fastest(
        buckets,
        {"group q8 gemm.c": [1e-4, 3e-4, 1e-3, 3e-3, 8e-3], "group dequant": [5e-4, 7e-4, 15e-4, 2e-3, 3e-3]},
    )
    assert layer.kernel_for(32) == "group q8 gemm.c" and layer.kernel_for(64) == "group dequant"
    rows = sharing_rows([layer] * 120, 128, sharing)
    assert 32 <= rows < 64
    assert all(layer.kernel_for(r) in sharing for r in range(1, rows + 1))
    assert layer.kernel_for(rows + 1) not in sharing


def test_the_recorded_machines_are_all_here():
    """The replay below covers the AMX Xeons (2 and 16 cores), the AVX2 EPYC and the
    AVX512-BF16 EPYC: a missing file would silently shrink it."""
    names = {where.split(":")[0].split(" (")[0] for where, _ in RECORDED}
    assert {
        "intel_xeon_amx_2c.json",
        "kernel_choice_cpu_xeon_amx.json",
        "kernel_choice_cpu_epyc_zen3.json",
        "kernel_choice_cpu_epyc_zen4.json",
    } <= names


def replayed(table: dict[str, dict[str, float]]):
    """A recorded table as buckets, its raw times per bucket (inf where none was recorded)
    and what today's give-up rule would have timed of them."""
    buckets = tuple(sorted({int(b) for t in table.values() for b in t}))
    raw = {k: [table[k].get(str(b), math.inf) for b in buckets] for k in table}
    index = {b: i for i, b in enumerate(buckets)}
    pruned = time_buckets(list(table), buckets, lambda rows, timed: {k: raw[k][index[rows]] for k in timed})
    return buckets, raw, pruned


# SmolLM2-135M's linears: how many of each shape the model has, in fp32 and as the bundled
# GGUF's blocks in a bf16 model.
SMOLLM2_FP32_LINEARS = {
    "linear float32 960x576": 30,
    "linear float32 576x576": 30,
    "linear float32 3072x576 gated": 30,
    "linear float32 576x1536": 30,
    "linear float32 49152x576": 1,
}
SMOLLM2_GGUF_BF16_LINEARS = {
    "linear q4g32m/bfloat16 960x576": 30,
    "linear q4g32m/bfloat16 576x576": 30,
    "linear q4g32m/bfloat16 3072x576 gated": 30,
    "linear q4g32m/bfloat16 576x1536": 30,
    "linear q8g32/bfloat16 49152x576": 1,
}


def recorded_smollm2_choices(linears: dict[str, int]) -> list[tuple[str, list[LinearChoice]]]:
    """(machine, every linear's choice) for each machine that timed all of `linears`."""
    tables: dict[str, dict[str, dict]] = {}
    for where, table in RECORDED:
        machine, key = where.split(": ", 1)
        tables.setdefault(machine, {})[key] = table
    machines = []
    for machine, timed in tables.items():
        if linears.keys() <= timed.keys():
            choices = []
            for key, count in linears.items():
                buckets, _, pruned = replayed(timed[key])
                choices += [fastest(buckets, pruned)] * count
            machines.append((machine, choices))
    return machines


RECORDED_SMOLLM2 = recorded_smollm2_choices(SMOLLM2_FP32_LINEARS)
RECORDED_GGUF = recorded_smollm2_choices(SMOLLM2_GGUF_BF16_LINEARS)


def test_every_recorded_machine_has_the_bundled_models_fp32_timings():
    assert len(RECORDED_SMOLLM2) >= 5


def test_the_zen4_gguf_timings_are_here():
    assert any("amd_epyc_zen4_2c_gguf_bf16.json" in where for where, _ in RECORDED_GGUF)


@pytest.mark.parametrize(
    "where,choices,sharing",
    [(w, c, FP32_SHARING_KERNELS) for w, c in RECORDED_SMOLLM2]
    + [(w, c, GROUP_SHARING_KERNELS) for w, c in RECORDED_GGUF],
    ids=[w for w, _ in RECORDED_SMOLLM2] + [f"gguf {w}" for w, _ in RECORDED_GGUF],
)
def test_recorded_machines_pin_by_the_sharing_kernels_part_of_each_step(where, choices, sharing):
    """The pinning rule on each machine's recorded timings of the bundled model (fp32, and
    its GGUF's blocks in bf16), over the steps Engine.rows_sharing_work asks about (short of
    a burst): every core up to the first step where the sharing kernels take less than
    SHARED_MAJORITY of the linear time, and a finite time everywhere."""
    max_rows = BURST_MIN_TOKENS - 1
    assert all(math.isfinite(c.seconds_for(rows)) for c in set(choices) for rows in range(1, max_rows + 1))
    short = [rows for rows in range(1, max_rows + 1) if shared_part(choices, rows, sharing) < SHARED_MAJORITY]
    assert sharing_rows(choices, max_rows, sharing) == (short[0] - 1 if short else max_rows)


@pytest.mark.parametrize("where,table", RECORDED, ids=[where for where, _ in RECORDED])
def test_recorded_machines_choose_within_the_margin(where, table):
    """Each machine's recorded times, through today's give-up rule and fastest(): the
    kernel chosen at every row count is one that was timed there and within the margin of
    the best (times between buckets interpolated), against the recorded times themselves."""
    buckets, raw, pruned = replayed(table)
    kernels = list(table)
    choice = fastest(buckets, pruned)
    check_choice(buckets, pruned)
    # Against the recorded times, where the give-up rule took nothing the fastest needed.
    for i, rows in enumerate(buckets):
        chosen = choice.kernel_for(rows)
        best = min(raw[k][i] for k in kernels)
        assert math.isfinite(raw[chosen][i])
        default = default_of(raw)
        if not trusted(buckets, raw, default, min(kernels, key=lambda k: raw[k][i]), i):
            continue  # a lone win, left to the default
        assert raw[chosen][i] <= (1 + MARGIN) * best, (
            f"{rows} rows: {chosen} {raw[chosen][i]:.3g} s, best {best:.3g} s"
        )
    assert GIVE_UP_RATIO > 1 + MARGIN
