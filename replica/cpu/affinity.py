"""Pinning a serving replica's threads to CPU cores, as vLLM's CPU backend binds its
engine (VLLM_CPU_OMP_THREADS_BIND).

On a small machine the engine shares its cores with Serve's proxy, the ingress and
Ray's own processes, which preempt it under load. Whether a core of its own pays
depends on the machine and on what else runs there, so pinning is a setting
(`cpu_cores`; `kvserve serve --cpu-cores`, "auto" there, "none" to turn it off).

A core left to the serving processes is idle while a burst of new prompts is prefilled:
every client is waiting for its first token, so there is nothing to stream. With
"auto", steps of BURST_MIN_TOKENS tokens or more use it too (CorePlan).

Where kernels whose threads take work as they come free run most of a step's linear time
(ModelRunner.rows_sharing_work: on the group kernels of a GGUF model, up to the row count
where the chooser's timings move to dequantizing for oneDNN), "auto" gives the engine
every core for that step: the serving processes' moments on a core slow only that
thread's share of it, and the rest of that core's time is the engine's (the commits that
made it so have the served measurements). Where kernels with a fixed share per thread
(oneDNN, torch, gemm.c's bf16 kernel) run most of it, the step keeps to the steady cores:
there a thread held up on the shared core holds up most of the step."""

import contextlib
import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

# About a quarter of a second of prefill on one core for a 135M model. A step this long
# dwarfs the streaming work of the step before it, which the serving processes do
# meanwhile on the borrowed core; decode steps, and a new prompt or two joining a
# decode batch, stay below it.
BURST_MIN_TOKENS = 512


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


def release_openmp_threads() -> bool:
    """Ends the OpenMP worker threads that this thread's parallel regions started
    (OpenMP 5's omp_pause_resource_all), for a thread that has finished its torch work
    but lives on. False where torch loaded no libgomp, or it has no such call (it is
    OpenMP 5.0's).

    libgomp keeps a pool of workers for every thread that starts a parallel region, for
    as long as that thread lives, and counts them all; once they outnumber the process's
    cores it stops spinning at a barrier and sleeps in the kernel at each one instead.
    A replica's engine steps on a thread of its own after loading and warming up on the
    constructor's, which Serve keeps: with two cores and two torch threads, both pools
    stay, and every decode step waits on futexes at each of its few hundred barriers."""
    # torch's copy, as loaded: some wheels rename it (libgomp-<hash>.so.1), and loading
    # another by soname would pause a runtime nothing uses.
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    runtime = next((path for path in loaded if Path(path).name.startswith("libgomp")), None)
    if runtime is None:
        return False
    try:
        pause = ctypes.CDLL(runtime).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft


@dataclass
class CorePlan:
    """A pinned replica's cores for each step, by its size: `burst` (every core) for steps
    of at least BURST_MIN_TOKENS tokens, and for steps of up to `shared_rows` tokens, whose
    kernels share their work; `steady` for the others."""

    steady: list[int]
    burst: list[int]
    shared_rows: int = 0
    pinned: list[int] | None = field(default=None, compare=False)  # where the process is now

    @classmethod
    def resolve(cls, spec: str | list[int], shared_rows: int = 0) -> "CorePlan":
        """ "auto" runs bursts, and steps of up to shared_rows tokens, on every core this
        process may use; a list of cores is kept to."""
        cores = resolve_cores(spec)
        if spec != "auto":
            return cls(cores, cores)
        return cls(cores, sorted(os.sched_getaffinity(0)), shared_rows)

    def cores_for(self, num_tokens: int) -> list[int]:
        if num_tokens >= BURST_MIN_TOKENS or num_tokens <= self.shared_rows:
            return self.burst
        return self.steady

    def pin_for_step(self, num_tokens: int) -> None:
        """Pin the process to the cores of a step of num_tokens tokens. It stays there
        after the step, so that a run of steps of one kind pins once: pinning costs a
        system call for every thread of the process, and a decode step a few milliseconds."""
        cores = self.cores_for(num_tokens)
        if cores != self.pinned:
            pin_process(cores)
            self.pinned = cores
