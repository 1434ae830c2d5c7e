"""Build the C kernels (kernels.c, sampling.c, attention.c, attention_paired.c, gemm.c,
gemm_int8.c, gemm_group.c, decoder.c) once per machine and load them with ctypes, bound as
kvserve_abi.h declares them.

The library is compiled for the CPU it runs on (-march=native), so it is built where it
is used, not shipped: the first engine on a machine compiles it (a few seconds) into
the kvserve cache, keyed by the source, the compiler and the CPU, and every later
process loads the file. It links libgomp by soname, so it shares the OpenMP runtime and
thread pool torch already loaded instead of starting a second one.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from replica.cpu.abi import SIZE_FUNCTIONS, DecoderLayer, DecoderShape, GroupWeight, StepLayout
from replica.model_loader import cache_lock, cache_root

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "kernels.c",
        "sampling.c",
        "attention.c",
        "attention_paired.c",
        "gemm.c",
        "gemm_int8.c",
        "gemm_group.c",
        "decoder.c",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("kvserve_abi.h", "avx512_bf16.h", "avx2_exp.h", "pair_panels.h", "scalar.h", "attention.h")
]
FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-fPIC",
    "-shared",
    # No -ffast-math: it would flush denormals for the whole process when the library
    # loads. Reductions vectorize through `omp simd` instead.
    "-fno-math-errno",
    "-fno-trapping-math",
]


class CpuKernelsUnavailable(RuntimeError):
    pass


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def compile_kernels(cc: str, sources: list[Path], target: str | Path) -> subprocess.CompletedProcess:
    """Compile `sources` into the shared library `target` with FLAGS; the compiler's
    output is in the result."""
    return subprocess.run(
        [cc, *FLAGS, "-o", str(target), *map(str, sources), "-lm"], capture_output=True, text=True
    )


def library_key() -> str:
    """What the compiled library depends on (sources, flags, compiler, CPU), hashed: its
    file name, and part of the kernel timings' cache key, since a changed kernel must be
    timed again. Raises CpuKernelsUnavailable without a compiler."""
    cc = compiler()
    if cc is None:
        raise CpuKernelsUnavailable("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in SOURCES + HEADERS), " ".join(FLAGS), version, _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels, building them first if this machine has no copy yet.
    Raises CpuKernelsUnavailable (with the compiler's message) when that fails."""
    key = library_key()
    cc = compiler()
    target = cache_root() / "kernels" / f"kvserve_cpu_{key}.so"
    if not target.is_file():
        with cache_lock(target):
            if not target.is_file():  # built while this process waited
                _build(cc, target)
    # torch first, so libgomp resolves to the copy torch loaded.
    import torch  # noqa: F401

    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def _build(cc: str, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        result = compile_kernels(cc, SOURCES, tmp)
        if result.returncode != 0:
            names = ", ".join(s.name for s in SOURCES)
            raise CpuKernelsUnavailable(f"{cc} failed to build {names}:\n{result.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a loader never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_p, _i64, _i32, _f32, _size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
_STEP, _SHAPE, _LAYERS, _GROUP = (
    ctypes.POINTER(s) for s in (StepLayout, DecoderShape, DecoderLayer, GroupWeight)
)
# Every function kvserve_abi.h declares: (argument types, result type).
# tests/test_cpu_kernels.py checks them against the header's prototypes.
SIGNATURES = {
    "rms_norm": ([_p, _p, _p, _p, _i64, _i32, _f32, _i32, _i32], None),
    "silu_mul": ([_p, _p, _i64, _i32, _i32, _i32], None),
    "argmax_rows": ([_p, _p, _i64, _i64, _i32, _i32], None),
    "sample_rows": ([_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i32, _i32], None),
    "rotary_embed": ([_p, _p, _i64, _i64, _p, _p, _i64, _i32, _i32, _i32, _i32], None),
    "paged_attention": (
        [
            _p, _p, _i64, _i64,  # out, q and its strides
            _p, _i64, _i64, _p, _i64, _i64,  # k, v and their strides
            _p, _p, _p, _p, _STEP,  # cos, sin, k_cache, v_cache, the step's layout
            _i32, _i32, _i32, _i32,  # heads, kv heads, head dim, block size
            _f32, _i32,  # scale, bf16
            _i32, _f32, _f32, _i32,  # KV format, its K and V scales, threads
        ],
        None,
    ),
    "kvserve_step_layout_size": ([], _size),
    "bf16_gemm_available": ([], _i32),
    "packed_bf16_weight_elements": ([_i64, _i64], _i64),
    "pack_bf16_weight": ([_p, _p, _i64, _i64], None),
    "gemm_bf16": ([_p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32], None),
    "f32_gemm_available": ([], _i32),
    "packed_f32_weight_elements": ([_i64, _i64], _i64),
    "pack_f32_weight": ([_p, _p, _i64, _i64], None),
    "gemm_f32": ([_p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32], None),
    "i8_gemm_available": ([], _i32),
    "activation_limit": ([_i64], _i32),
    "packed_i8_weight_bytes": ([_i64, _i64], _i64),
    "pack_i8_weight": ([_p, _p, _i64, _i64], None),
    "gemm_i8": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32], None),
    "group_gemm_available": ([], _i32),
    "gemm_group": ([_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32, _i32], None),
    "gemm_group_q8": ([_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32, _i32], None),
    "group_q8_is_wide": ([], _i32),
    "gemm_group_q8_256": ([_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i32, _i32, _i32], None),
    "dequantize_group": ([_p, _p, _p, _p, _p, _i64, _i64, _i32, _i32, _i32, _i32], None),
    "group_linear": ([_p, _p, _GROUP, _p, _i64, _i64, _i64, _i32, _i32, _i32, _i32], None),
    "group_linear_each": ([_p, _p, _GROUP, _i64, _p, _i64, _i64, _i64, _i32, _i32, _i32, _i32], None),
    "decoder_forward": ([_SHAPE, _LAYERS, _STEP, _p, _p, _p, _p, _i64, _p, _p, _i32], None),
    "decoder_scratch_elements": ([_SHAPE, _i64], _i64),
    "kvserve_decoder_layer_size": ([], _size),
    "kvserve_decoder_shape_size": ([], _size),
}  # fmt: skip


def _declare(lib: ctypes.CDLL) -> None:
    """Bind every function as SIGNATURES declares it; raises RuntimeError where abi.py's
    structs and the compiled ones differ in size."""
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    for struct, size_function in SIZE_FUNCTIONS.items():
        compiled = getattr(lib, size_function)()
        if compiled != ctypes.sizeof(struct):
            raise RuntimeError(
                f"abi.{struct.__name__} is {ctypes.sizeof(struct)} bytes, kvserve_abi.h's {compiled}: "
                "the two declare different fields"
            )
