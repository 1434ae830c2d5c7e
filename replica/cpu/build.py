"""Build the C kernels (kernels.c, attention.c, attention_paired.c, gemm.c, decoder.c)
once per machine and load them with ctypes.

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

from replica.model_loader import cache_root

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("kernels.c", "attention.c", "attention_paired.c", "gemm.c", "decoder.c")
]
HEADERS = [Path(__file__).with_name(name) for name in ("avx512_bf16.h", "scalar.h", "attention.h")]
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


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels, building them first if this machine has no copy yet.
    Raises CpuKernelsUnavailable (with the compiler's message) when that fails."""
    cc = compiler()
    if cc is None:
        raise CpuKernelsUnavailable("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in SOURCES + HEADERS), " ".join(FLAGS), version, _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"kvserve_cpu_{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        try:
            result = compile_kernels(cc, SOURCES, tmp)
            if result.returncode != 0:
                names = ", ".join(s.name for s in SOURCES)
                raise CpuKernelsUnavailable(f"{cc} failed to build {names}:\n{result.stderr[-2000:]}")
            os.replace(tmp, target)  # atomic: concurrent builders race, one wins
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    # torch first, so libgomp resolves to the copy torch loaded.
    import torch  # noqa: F401

    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.rms_norm.argtypes = [p, p, p, p, i64, i32, f32, i32, i32]
    lib.silu_mul.argtypes = [p, p, i64, i32, i32, i32]
    lib.argmax_rows.argtypes = [p, p, i64, i64, i32, i32]
    lib.sample_rows.argtypes = [p, p, p, p, i64, i64, i32, i32]
    lib.rotary_embed.argtypes = [p, p, i64, i64, p, p, i64, i32, i32, i32, i32]
    lib.paged_attention.argtypes = [
        p, p, i64, i64,  # out, q and its strides
        p, i64, i64, p, i64, i64,  # k, v and their strides
        p, p, p, p, p, i64,  # cos, sin, k_cache, v_cache, slots, num_tokens
        i32, p, i32, p,  # decodes: count, tables, table width, context lens
        i32, p, p, p, p, i32,  # prefills: count, query starts and ends, context lens, tables, table width
        i32, i32, i32, i32, f32, i32, i32,  # heads, kv heads, head dim, block size, scale, bf16, threads
    ]  # fmt: skip
    lib.packed_bf16_weight_elements.argtypes = [i64, i64]
    lib.packed_bf16_weight_elements.restype = i64
    lib.pack_bf16_weight.argtypes = [p, p, i64, i64]
    lib.gemm_bf16.argtypes = [p, p, p, p, i64, i64, i64, i32, i32]
    lib.bf16_gemm_available.argtypes = []
    lib.bf16_gemm_available.restype = i32
    for name in (
        "rms_norm", "silu_mul", "argmax_rows", "sample_rows", "rotary_embed", "paged_attention",
        "pack_bf16_weight", "gemm_bf16",
    ):  # fmt: skip
        getattr(lib, name).restype = None
