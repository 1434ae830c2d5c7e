"""Ranks 1..N-1 of a tensor-parallel replica: Ray actors in the replica's placement group.

Under Serve the replica's deployment reserves `tensor_parallel_size` bundles
(`placement_group_bundles`); the replica itself, rank 0, runs in the first and the
workers go into the others. Anywhere else (the offline LLM, a batch actor) the engine
reserves a placement group of its own for the workers.

Each step is one actor call per worker with the step's small description (token ids,
context lengths, block tables, sampling rows); the workers return nothing, and the
driver only looks at their results to surface an error or a death.
"""

import asyncio
import threading
import weakref
from collections.abc import Callable
from dataclasses import asdict
from typing import TypeVar

import ray
import torch
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replica.config import EngineConfig
from replica.devices import resolve_device
from replica.model_runner import ModelRunner
from replica.parallel.group import TPGroup, connect_store, serve_store

PLACEMENT_TIMEOUT_S = 60.0
# Steps a worker may still be running before the driver waits for the oldest one.
MAX_STEPS_IN_FLIGHT = 8
T = TypeVar("T")


class WorkerError(RuntimeError):
    """A tensor-parallel worker could not be placed, failed to start, or died."""


def replica_bundles(num_ranks: int, gpus: bool, num_cpus: float = 0) -> list[dict[str, float]]:
    """A placement group's bundles, one per rank. Without GPUs, a token share of a core
    where no CPUs are asked for (a bundle may not be all zeros), so that ranks are
    placed together without reserving cores."""
    bundle = {"GPU": 1, "CPU": num_cpus} if gpus else {"CPU": num_cpus or 0.01}
    return [dict(bundle) for _ in range(num_ranks)]


@ray.remote(num_cpus=0)
class TPWorker:
    """One rank: the model runner over its shard and nothing else."""

    def start(self, config: dict, model_path: str, host: str, port: int, rank: int) -> None:
        config = EngineConfig(**config)
        device = resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray shows this actor its own GPU only
        store = connect_store(host, port, config.tensor_parallel_size)
        group = TPGroup.join(store, rank, config.tensor_parallel_size, device)
        self.runner = ModelRunner(config, model_path, group)

    def execute(
        self, token_ids, context_lens, block_tables, sample_rows, fill_rows, prompt_rows, kv_copies
    ) -> None:
        self.runner.execute(
            token_ids,
            context_lens,
            block_tables,
            sample_rows,
            fill_rows=fill_rows,
            prompt_rows=prompt_rows,
            kv_copies=kv_copies,
        )

    def ping(self) -> bool:
        return True


class WorkerSet:
    def __init__(self, config: EngineConfig, model_path: str):
        """Place and start the workers. Their start-up joins rank 0's group, so it
        finishes only while `run_beside` builds rank 0 (tp_runner.py)."""
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        world = config.tensor_parallel_size
        gpus = resolve_device(config.device).type == "cuda"
        self._own_group: PlacementGroup | None = None
        group, first_bundle = get_current_placement_group(), 1
        if group is None or len(group.bundle_specs) < world:
            # Not inside a replica's reservation: reserve the workers' share ourselves.
            bundles = replica_bundles(world - 1, gpus)
            group = self._own_group = placement_group(bundles, strategy="STRICT_PACK")
            first_bundle = 0
            ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                ray.util.remove_placement_group(group)
                raise WorkerError(
                    f"tensor_parallel_size={world} needs {world - 1} more bundles of {bundles[0]} on one "
                    f"node for its workers, and Ray could not place them within {PLACEMENT_TIMEOUT_S:.0f} s "
                    f"(available: {ray.available_resources()})"
                )
        bundle = group.bundle_specs[first_bundle]
        host = ray.util.get_node_ip_address()
        self.store = serve_store(host, world)
        self.actors = [
            TPWorker.options(
                num_cpus=0,
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, first_bundle + i),
            ).remote()
            for i in range(world - 1)
        ]
        self._starts = [
            actor.start.remote(asdict(config), str(model_path), host, self.store.port, rank)
            for rank, actor in enumerate(self.actors, start=1)
        ]
        self._in_flight: list[ray.ObjectRef] = []
        # Actors die with their last handle anyway; a placement group of our own does not.
        self._release = weakref.finalize(self, _release, self.actors, self._own_group)

    def run_beside(self, build_rank0: Callable[[], T]) -> T:
        """Build rank 0 (which joins the workers' collectives) while watching the
        workers: one that fails to start raises here instead of leaving rank 0 waiting
        in a collective until its timeout."""
        result: list = []
        failure: list[BaseException] = []

        def build() -> None:
            try:
                result.append(build_rank0())
            except BaseException as e:  # handed to the caller's thread
                failure.append(e)

        thread = threading.Thread(target=build, name="kvserve-tp-rank0", daemon=True)
        thread.start()
        pending = list(self._starts)
        while (thread.is_alive() or pending) and not failure:
            if not pending:
                thread.join(timeout=0.2)
                continue
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            try:
                ray.get(done)
            except Exception as e:
                self.shutdown()
                raise WorkerError(f"a tensor-parallel worker failed to start: {e}") from e
        if failure:
            self.shutdown()
            raise failure[0]
        return result[0]

    def execute(
        self, token_ids, context_lens, block_tables, sample_rows, fill_rows, prompt_rows, kv_copies
    ) -> None:
        """Send one step to every worker. Results of earlier steps are checked without
        waiting, so a worker's error or death surfaces within a step or two (rank 0's
        collectives fail first when a worker's process is gone)."""
        self._check_finished(wait_for_oldest=len(self._in_flight) >= MAX_STEPS_IN_FLIGHT * len(self.actors))
        args = (token_ids, context_lens, block_tables, sample_rows, fill_rows, prompt_rows, kv_copies)
        self._in_flight.extend(actor.execute.remote(*args) for actor in self.actors)

    def _check_finished(self, wait_for_oldest: bool) -> None:
        if not self._in_flight:
            return
        if wait_for_oldest:
            ray.wait(self._in_flight[: len(self.actors)], num_returns=len(self.actors))
        done, _ = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
        done_set = set(done)
        self._in_flight = [ref for ref in self._in_flight if ref not in done_set]
        try:
            ray.get(done)
        except Exception as e:
            raise WorkerError(f"a tensor-parallel worker failed: {e}") from e

    async def check_alive(self, timeout_s: float = 20.0) -> None:
        """For the replica's health check: every worker answers (after the step it is
        running), or this raises and Serve replaces the replica."""
        try:
            await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in self.actors)), timeout_s)
        except Exception as e:
            raise WorkerError(f"a tensor-parallel worker is gone or stuck: {e!r}") from e

    def shutdown(self) -> None:
        self._release()


def _release(actors: list, own_group: PlacementGroup | None) -> None:
    if not ray.is_initialized():
        return
    for actor in actors:
        ray.kill(actor)
    if own_group is not None:
        ray.util.remove_placement_group(own_group)
