import pytest
import ray

from router.placement.coordinator import DEFAULT_STALE_AFTER_S, Coordinator, ReportBook
from wire.messages import ReplicaReport


def report(num_free_blocks: int, age_s: float) -> ReplicaReport:
    return ReplicaReport(
        node_id="node",
        deployment="LLMServer",
        device="cpu",
        tensor_parallel_size=1,
        block_size=16,
        max_model_len=1024,
        max_waiting=None,
        num_free_blocks=num_free_blocks,
        num_total_blocks=8,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_running=0,
        num_waiting=0,
        num_pending_blocks=0,
        num_preemptions=0,
        cpu_affinity=[0],
        torch_threads=1,
        age_s=age_s,
    )


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_snapshot_keeps_fresh_replicas_forgets_silent_ones_and_ages_reports():
    """On a clock moved by hand, so the boundaries are exact: a replica last heard from
    stale_after_s ago is kept, one a moment longer ago is forgotten, and each kept
    report's age grows by exactly the time it has waited here."""
    clock = Clock()
    book = ReportBook(stale_after_s=0.5, clock=clock)
    book.report("a", report(3, age_s=0.02))
    book.report("b", report(5, age_s=0.0))
    assert {r: s.num_free_blocks for r, s in book.snapshot().items()} == {"a": 3, "b": 5}
    # Steps that are exact in binary, so that "exactly stale_after_s ago" is exact.
    clock.now += 0.25
    book.report("a", report(2, age_s=0.05))
    clock.now += 0.25  # b last reported 0.5 s ago, exactly stale_after_s: still fresh
    assert sorted(book.snapshot()) == ["a", "b"]
    clock.now += 2**-10  # b: just over it
    snapshot = book.snapshot()
    assert list(snapshot) == ["a"] and snapshot["a"].num_free_blocks == 2
    # Its age: 0.05 s when sent, plus the 0.25 s and a bit it waited here.
    assert snapshot["a"].age_s == pytest.approx(0.05 + 0.25 + 2**-10)
    book.forget("a")
    assert book.snapshot() == {}


def test_replicas_are_forgotten_after_the_default_2_s_without_a_report():
    """docs/failures.md's figure: the coordinator forgets a dead replica after 2 s."""
    clock = Clock()
    book = ReportBook(clock=clock)
    assert book.stale_after_s == DEFAULT_STALE_AFTER_S == 2.0
    book.report("dead", report(8, age_s=0.0))
    clock.now += 1.999
    assert list(book.snapshot()) == ["dead"]
    clock.now += 0.002
    assert book.snapshot() == {}


def test_the_actor_keeps_reports_forgets_on_request_and_answers_with_the_adapters(ray_cluster):
    """The actor as replicas and routers call it, through Ray: a report is answered with
    the registered adapters' ids, and the snapshot holds it until it is forgotten."""
    coordinator = Coordinator.remote()
    try:
        assert ray.get(coordinator.report.remote("a", report(3, age_s=0.02))) == []
        lora = ray.get(coordinator.register_lora.remote("sql", "/adapters/sql"))
        assert ray.get(coordinator.report.remote("b", report(5, age_s=0.0))) == [lora.lora_int_id]
        snapshot = ray.get(coordinator.snapshot.remote())
        assert {r: s.num_free_blocks for r, s in snapshot.items()} == {"a": 3, "b": 5}
        assert snapshot["a"].age_s >= 0.02
        ray.get(coordinator.forget.remote("a"))
        assert list(ray.get(coordinator.snapshot.remote())) == ["b"]
    finally:
        ray.kill(coordinator)
