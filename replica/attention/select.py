"""Which attention backend runs, and with what block size.

Plain functions of (device, dtype, installed packages) so the rules are unit-testable on
any machine; the model runner feeds them the real facts.
"""

import importlib.util
import logging
import os

import torch

from replica.config import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)

# Preference, best first. torch is the fallback that always works.
AUTO_ORDER = {"cuda": ("flash_attn", "triton", "torch"), "cpu": ("cpu", "torch")}
KERNEL_PACKAGES = {"triton": "triton", "flash_attn": "flash_attn"}
# kvserve's own C kernels (replica/cpu), built on first use; "installed" when they built.
CPU_KERNELS = "cpu"
# flash-attn's paged kernels read pages of a multiple of 256 tokens.
FLASH_ATTN_BLOCK_SIZE = 256


def installed_kernel_packages() -> frozenset[str]:
    """Backend names whose package is importable here (found, not imported: importing
    flash-attn initialises CUDA)."""
    return frozenset(name for name, pkg in KERNEL_PACKAGES.items() if importlib.util.find_spec(pkg))


def cpu_kernels_built() -> bool:
    """Whether kvserve's C kernels build (or are already built) on this machine."""
    from replica.cpu.build import CpuKernelsUnavailable, load_library

    try:
        load_library()
    except CpuKernelsUnavailable as e:
        logger.warning("CPU kernels unavailable, using the torch attention backend: %s", e)
        return False
    return True


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on CPU tensors (slowly): for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_problem(
    name: str,
    device_type: str,
    dtype: torch.dtype,
    installed: frozenset[str],
    interpret: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> str | None:
    """Why backend `name` cannot run here, or None when it can. kv_dtype: the KV cache's
    (kv_cache_dtype), when not the model's."""
    if name == "torch":
        return None
    if name == "flash_attn" and kv_dtype not in (None, dtype):
        return (
            f"kvserve's flash-attn backend reads only a KV cache in the model's dtype, not {kv_dtype} "
            "(triton and torch read it)"
        )
    if name == CPU_KERNELS:
        if device_type != "cpu":
            return "kvserve's C kernels run only on the CPU"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"kvserve's C kernels support only float32 and bfloat16, not {dtype}"
        if name not in installed:
            return "kvserve's C kernels could not be built here (is a C compiler installed?)"
        return None
    if name not in installed:
        return f"the {KERNEL_PACKAGES[name]!r} package is not installed"
    if name == "flash_attn":
        if device_type != "cuda":
            return "flash-attn runs only on CUDA devices"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn supports only float16 and bfloat16, not {dtype}"
    if name == "triton" and kv_dtype == torch.bfloat16 and dtype != torch.bfloat16:
        return "kvserve's Triton kernels read a bfloat16 KV cache only beside a bfloat16 model"
    if name == "triton" and device_type != "cuda" and not interpret:
        return "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)"
    return None


def choose_backend(
    requested: str,
    device_type: str,
    dtype: torch.dtype,
    installed: frozenset[str],
    interpret: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> str:
    """`auto`: the best backend that runs here; a name: that backend, or a ValueError
    saying why it can't run."""
    if requested == "auto":
        order = AUTO_ORDER.get(device_type, ("torch",))
        return next(
            n for n in order if backend_problem(n, device_type, dtype, installed, kv_dtype=kv_dtype) is None
        )
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {ATTENTION_BACKENDS}")
    problem = backend_problem(requested, device_type, dtype, installed, interpret, kv_dtype)
    if problem is not None:
        raise ValueError(f"attention backend {requested!r} is unavailable: {problem}")
    return requested


def effective_block_size(backend: str, requested: int) -> int:
    """The KV block size the backend can page with: flash-attn needs a multiple of 256, so
    it replaces any other request with 256 and says so."""
    if backend == "flash_attn" and requested % FLASH_ATTN_BLOCK_SIZE:
        logger.warning(
            "flash-attn pages KV in blocks of a multiple of %d tokens: using block_size=%d instead of %d",
            FLASH_ATTN_BLOCK_SIZE,
            FLASH_ATTN_BLOCK_SIZE,
            requested,
        )
        return FLASH_ATTN_BLOCK_SIZE
    return requested
