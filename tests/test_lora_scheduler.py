"""The scheduler with LoRA adapters (max_loras): any interleaving of add, step, abort and
preempt keeps at most max_loras adapters running, each in a slot of its own whose users
are exactly its running requests, names in lora_loads every slot that changed adapter,
keeps the block accounting, and, stepped to the end, finishes every request. An adapter
request waiting for a slot is not starved by the adapters already running, and the base
model's requests go past it. Each adapter's KV is cached apart from the base model's."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_scheduler_properties import SchedulerMachine, complete_step

from kvcache import KVCacheManager
from kvcache.hashing import ROOT_HASH
from replica.request import Request, RequestStatus
from replica.scheduler import Scheduler
from wire.lora_request import LoRARequest
from wire.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12
MAX_LEN = NUM_BLOCKS * BLOCK_SIZE
MAX_LORAS = 2
MAX_NUM_SEQS = 4
ADAPTERS = [LoRARequest(f"adapter-{i}", i + 1, f"/adapters/{i}") for i in range(4)]


def _request(rid, prompt, max_tokens, lora=None, priority=0) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(prompt), params, max_tokens=max_tokens, lora=lora, priority=priority)


class LoRASchedulerMachine(SchedulerMachine):
    """The base machine's abort and preempt rules and its block and queue invariants,
    with adapter requests, max_loras and the slot checks."""

    policy = "fcfs"

    def __init__(self):
        super().__init__()
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=10,
            max_num_seqs=MAX_NUM_SEQS,
            policy=self.policy,
            max_loras=MAX_LORAS,
        )
        self.slots = self.scheduler.lora_slots
        self.finished: list[Request] = []

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20),  # tiny vocab: shared prefixes
        max_tokens=st.integers(1, 12),
        adapter=st.sampled_from([None, *ADAPTERS]),
        priority=st.integers(-1, 1),
    )
    def add(self, prompt, max_tokens, adapter, priority):
        rid = str(self.next_id)
        self.next_id += 1
        max_tokens = min(max_tokens, MAX_LEN - len(prompt))
        request = _request(rid, prompt, max_tokens, adapter, priority)
        self.scheduler.add(request)
        self.live[rid] = request

    @rule(token=st.integers(0, 2))
    def step(self, token):
        self._step(token)

    def _step(self, token: int) -> None:
        order = list(self.scheduler.waiting)  # in admission order
        slots_before = list(self.slots.adapters)
        plan = self.scheduler.schedule()

        # The step serves at most max_loras adapters, each from its slot.
        step_adapters = {s.request.lora for s in plan.scheduled if s.request.lora is not None}
        assert len(step_adapters) <= MAX_LORAS
        for lora in step_adapters:
            assert self.slots.slot_of(lora) is not None

        # lora_loads names exactly the slots whose adapter changed, with their new adapter.
        changed = {s: lora for s, lora in enumerate(self.slots.adapters) if lora != slots_before[s]}
        assert len(plan.lora_loads) == len({s for s, _ in plan.lora_loads})
        assert dict(plan.lora_loads) == changed
        assert all(lora is not None for lora in changed.values())

        # Admission order: a request still waiting that was ahead of an admitted one is an
        # adapter request (waiting for a slot), and the one that went past it is a base one.
        admitted = {r.request_id for r in order if r.status is RequestStatus.RUNNING}
        if plan.preempted:
            assert not admitted  # a step that preempts admits nobody
        for i, request in enumerate(order):
            if request.request_id not in admitted:
                continue
            for ahead in order[:i]:
                if ahead.status is RequestStatus.WAITING:
                    assert ahead.lora is not None, (ahead, request)
                    assert request.lora is None, (ahead, request)

        for request in complete_step(self.scheduler, plan, token):
            del self.live[request.request_id]
            self.finished.append(request)

    @invariant()
    def slots_match_the_running_requests(self):
        running = [r for r in self.scheduler.running if r.lora is not None]
        assert len({r.lora for r in running}) <= MAX_LORAS
        held = [lora for lora in self.slots.adapters if lora is not None]
        assert len(held) == len(set(held))  # no adapter in two slots
        for request in running:
            assert self.slots.slot_of(request.lora) is not None
        for slot, lora in enumerate(self.slots.adapters):
            users = sum(1 for r in running if r.lora == lora) if lora is not None else 0
            assert self.slots.users[slot] == users, (slot, lora, self.slots.users)
        assert set(self.slots.running()) == {r.lora for r in running}

    def teardown(self):
        """Stepped to the end, every request finishes, in a bounded number of steps."""
        for _ in range(3000):
            if not self.scheduler.has_unfinished():
                break
            self._step(1)
            self.slots_match_the_running_requests()
            self.blocks_are_accounted_for()
        assert not self.scheduler.has_unfinished(), [
            (r.request_id, r.lora and r.lora.lora_name) for r in self.live.values()
        ]
        assert not self.live
        assert all(r.num_output_tokens == r.max_tokens for r in self.finished)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)
        assert self.slots.users == [0] * MAX_LORAS


class PriorityLoRASchedulerMachine(LoRASchedulerMachine):
    policy = "priority"


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
LoRASchedulerMachine.TestCase.settings = _settings
PriorityLoRASchedulerMachine.TestCase.settings = _settings
TestLoRAScheduler = LoRASchedulerMachine.TestCase
TestPriorityLoRAScheduler = PriorityLoRASchedulerMachine.TestCase


def _first_scheduled(plans: list, request: Request) -> int | None:
    return next(
        (i for i, plan in enumerate(plans) if any(s.request is request for s in plan.scheduled)), None
    )


def test_an_adapter_waiting_for_a_slot_is_not_starved_and_base_requests_go_past_it():
    """max_loras=1: adapter A's requests keep arriving, one each step, while a request of
    adapter B waits. The A requests behind B wait too, so A's slot frees up and B runs
    within a bounded number of steps; base-model requests are admitted past B meanwhile."""
    a, b = ADAPTERS[0], ADAPTERS[1]
    kv = KVCacheManager(256, BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=16, max_loras=1)
    plans = []
    requests: list[Request] = []

    def add(lora, max_tokens=4):
        requests.append(_request(str(len(requests)), [len(requests) % 3] * 5, max_tokens, lora))
        scheduler.add(requests[-1])
        return requests[-1]

    def step():
        plans.append(scheduler.schedule())
        complete_step(scheduler, plans[-1], 1)

    add(a)
    step()
    add(a)
    step()  # two A requests running, A holds the only slot
    b_request = add(b)
    b_arrival = len(plans)
    a_after_b, base_after_b = [], []
    for _ in range(8):
        a_after_b.append(add(a))
        base_after_b.append(add(None))
        step()
        if b_request.status is RequestStatus.RUNNING:
            break
    b_start = _first_scheduled(plans, b_request)
    assert b_start is not None, "B never ran while A requests kept arriving"
    # The A requests running when B arrived had at most 4 tokens to go.
    assert b_start - b_arrival <= 4
    # Every base request that arrived while B waited was admitted the step it arrived.
    for i, base in enumerate(base_after_b):
        assert _first_scheduled(plans, base) == b_arrival + i
    # No A request that arrived after B ran before it.
    for later in a_after_b:
        start = _first_scheduled(plans, later)
        assert start is None or start > b_start
    # The step B started loaded it into the slot.
    assert plans[b_start].lora_loads == [(0, b)]

    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        step()
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert kv.num_free_blocks == 256
    # A ran again once B was done, from the slot B had.
    assert all(_first_scheduled(plans, r) > b_start for r in a_after_b)


def test_adapters_keep_their_order_behind_a_waiting_one():
    """max_loras=1, A running: B, then A, then C wait. The A request behind B is held back,
    and once A's slot frees, B runs, then A, then C: each in its turn, none skipped."""
    a, b, c = ADAPTERS[:3]
    kv = KVCacheManager(256, BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=16, max_loras=1)
    first = _request("first", [0] * 5, 3, a)
    scheduler.add(first)
    plans = [scheduler.schedule()]
    complete_step(scheduler, plans[0], 1)
    queued = [_request("b", [1] * 5, 3, b), _request("a", [2] * 5, 3, a), _request("c", [0] * 5, 3, c)]
    for request in queued:
        scheduler.add(request)
    for _ in range(50):
        if not scheduler.has_unfinished():
            break
        plans.append(scheduler.schedule())
        assert len({s.request.lora for s in plans[-1].scheduled}) <= 1
        complete_step(scheduler, plans[-1], 1)
    starts = [_first_scheduled(plans, r) for r in queued]
    assert starts == sorted(starts) and len(set(starts)) == 3, starts
    assert [plans[s].lora_loads for s in starts] == [[(0, b)], [(0, a)], [(0, c)]]


def test_lora_loads_name_new_adapters_and_not_a_reused_slot():
    a, b, c = ADAPTERS[:3]
    kv = KVCacheManager(64, BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_loras=2)
    slots = scheduler.lora_slots
    counter = iter(range(100))

    def run_one(lora) -> list:
        """One request of `lora` to the end; the lora_loads of the step that admitted it."""
        request = _request(str(next(counter)), [1, 2, 3], 1, lora)
        scheduler.add(request)
        plan = scheduler.schedule()
        assert [s.request for s in plan.scheduled] == [request]
        complete_step(scheduler, plan, 0)
        assert request.is_finished
        return plan.lora_loads

    assert run_one(a) == [(0, a)]
    assert run_one(a) == []  # its idle slot still holds it: nothing to load
    assert run_one(None) == []
    assert run_one(b) == [(1, b)]  # an empty slot before an idle adapter's
    assert run_one(a) == [] and run_one(b) == []
    assert slots.adapters == [a, b] and slots.users == [0, 0]
    loads = run_one(c)  # both idle: one of them makes way
    assert loads == [(slots.slot_of(c), c)] and len(set(slots.adapters) & {a, b}) == 1
    assert run_one(c) == []

    # Two new adapters admitted in one step, neither holding a slot: both listed, each
    # with its own slot, and the request behind them of one of them shares its slot.
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_loras=2)
    slots = scheduler.lora_slots
    both = [_request("x", [1], 2, b), _request("y", [2], 2, c), _request("z", [3], 2, b)]
    for request in both:
        scheduler.add(request)
    plan = scheduler.schedule()
    assert len(plan.scheduled) == 3
    assert sorted(plan.lora_loads, key=lambda p: p[0]) == [(0, b), (1, c)]
    assert slots.adapters == [b, c] and slots.users == [2, 1]
    # A third adapter finds no slot while both are in use: it waits, and nothing loads.
    late = _request("late", [1], 1, a)
    scheduler.add(late)
    complete_step(scheduler, plan, 0)
    plan = scheduler.schedule()
    assert late not in [s.request for s in plan.scheduled] and plan.lora_loads == []
    assert late.status is RequestStatus.WAITING


def test_adapter_kv_is_cached_apart_from_the_base_models():
    kv = KVCacheManager(32, BLOCK_SIZE)
    tokens = list(range(13))  # three full blocks (the last token is never taken from cache)
    a = ADAPTERS[0]
    a_again = LoRARequest(a.lora_name, 99, a.lora_path)  # registered again from the same files
    a_elsewhere = LoRARequest(a.lora_name, a.lora_int_id, "/adapters/other")  # same name, other files
    other_name = LoRARequest("other", 7, a.lora_path)

    def serve(rid: str, root: bytes) -> int:
        """Allocate, cache and free a request of `tokens`; returns the blocks it found."""
        cached = kv.find_cached_prefix(tokens, root)
        assert kv.allocate(rid, len(tokens), cached)
        kv.cache_full_blocks(rid, tokens, len(tokens), root)
        kv.free(rid)
        return len(cached.blocks)

    assert serve("base", ROOT_HASH) == 0
    assert len(kv.find_cached_prefix(tokens).blocks) == 3
    assert kv.find_cached_prefix(tokens, a.block_hash_root).blocks == []
    assert serve("a1", a.block_hash_root) == 0
    assert serve("a2", a.block_hash_root) == 3
    assert len(kv.find_cached_prefix(tokens, a_again.block_hash_root).blocks) == 3
    assert kv.find_cached_prefix(tokens, a_elsewhere.block_hash_root).blocks == []
    assert kv.find_cached_prefix(tokens, other_name.block_hash_root).blocks == []
    assert len({ROOT_HASH, a.block_hash_root, a_elsewhere.block_hash_root, other_name.block_hash_root}) == 4
    # The base model's blocks are still its own.
    assert serve("base2", ROOT_HASH) == 3


def test_scheduler_caches_per_adapter():
    """Through the scheduler: a base request's prompt is no prefix hit for an adapter
    request; a second request of that adapter hits its blocks; the same name from other
    files does not."""
    kv = KVCacheManager(64, BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_loras=2)
    a = ADAPTERS[0]
    a_elsewhere = LoRARequest(a.lora_name, a.lora_int_id + 10, "/adapters/other")
    prompt = list(range(13))

    def run(rid: str, lora) -> Request:
        request = _request(rid, prompt, 2, lora)
        scheduler.add(request)
        while scheduler.has_unfinished():
            complete_step(scheduler, scheduler.schedule(), 0)
        return request

    assert run("base", None).num_cached_tokens == 0
    assert run("base2", None).num_cached_tokens == 12
    assert run("a1", a).num_cached_tokens == 0
    assert run("a2", a).num_cached_tokens == 12
    assert run("elsewhere", a_elsewhere).num_cached_tokens == 0
    assert run("a3", a).num_cached_tokens == 12
    assert kv.num_free_blocks == 64
