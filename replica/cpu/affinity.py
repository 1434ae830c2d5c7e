"""Pinning a serving replica's threads to CPU cores, as vLLM's CPU backend binds its
engine (VLLM_CPU_OMP_THREADS_BIND).

On a small machine the engine shares its cores with Serve's proxy, the ingress and
Ray's own processes, which preempted it under load. Whether a core of its own pays is
not settled: `vllm bench serve` at concurrency 16 on 2 cores gave 98-117 output tok/s
floating and 144-162 pinned in one stretch of time, and 110 against 107 an hour later
(one-off runs, not committed benchmarks)."""

import contextlib
import logging
import os

import torch

logger = logging.getLogger(__name__)


def resolve_cores(spec: str | list[int]) -> list[int]:
    """ "auto": the cores this process may use, less the first one (left to the serving
    processes) when there are two or more; or the given cores, which must be usable."""
    usable = sorted(os.sched_getaffinity(0))
    if spec == "auto":
        return usable[1:] or usable
    unusable = sorted(set(spec) - set(usable))
    if unusable:
        raise ValueError(f"cpu_cores {unusable} are not among this process's cores {usable}")
    return sorted(set(spec))


def pin_process(cores: list[int]) -> None:
    """Every thread of this process (and the threads they start later) runs on `cores`,
    with one torch/OpenMP thread per core."""
    for thread_id in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(thread_id), cores)
    torch.set_num_threads(len(cores))
    logger.info(f"pinned to CPU cores {cores}, {len(cores)} torch threads")
