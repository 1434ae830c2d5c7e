"""Iteration-level scheduler (vLLM v1's single rule).

Every step each running request gets the tokens it needs to catch up
(`num_tokens - num_computed_tokens`), within the token budget; waiting requests are
admitted with what budget remains. Chunked prefill and mixed prefill/decode steps
fall out of that rule. When blocks run out, the newest running request is preempted
and later recomputed from scratch (its prefix blocks are likely still cached).

The `priority` policy (vLLM's) orders both queues by each request's priority, lower
values first: waiting requests are admitted by (priority, arrival), and the running
request preempted first is the newest of the lowest priority. With equal priorities it
schedules exactly as `fcfs` does.

The `static` policy exists only as the benchmark baseline: a new batch is admitted
only once every request of the previous batch has finished.

A running request with proposed tokens (speculative decoding) is scheduled for them too,
as a chunk of its catch-up token and the proposals, cut to the budget like any chunk.

With LoRA adapters, a step serves at most max_loras of them (lora/slots.py). A waiting
request whose adapter finds no slot waits, and so does every adapter request behind it,
so that the adapters already running cannot keep its slot from freeing up; requests for
the base model still go past it.
"""

import bisect
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from kvcache.block_math import cdiv
from kvcache.kv_manager import CachedPrefix
from replica.lora.slots import LoRASlots
from replica.request import FinishReason, Request, RequestStatus
from replica.request_queue import FCFSQueue, PriorityQueue
from wire.lora_request import LoRARequest

NO_PREFIX = CachedPrefix([], 0)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # proposed tokens included
    num_spec_tokens: int = 0  # the last num_spec_tokens are proposed, to be verified

    @property
    def context_len(self) -> int:
        """Tokens with KV once this step has run (proposed ones included)."""
        return self.request.num_computed_tokens + self.num_new_tokens

    @property
    def new_token_ids(self) -> list[int]:
        request = self.request
        known = request.token_ids[request.num_computed_tokens : self.context_len - self.num_spec_tokens]
        return known + request.spec_token_ids[: self.num_spec_tokens]

    @property
    def produces_token(self) -> bool:
        """Whether this step completes the request's input, so a token is sampled."""
        return self.context_len - self.num_spec_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Adapters that took a slot this step: their weights go there before it runs.
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: str = "fcfs",
        max_loras: int = 0,
    ):
        """max_loras: adapters one step can serve (0: LoRA off)."""
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.static = policy == "static"
        self.by_priority = policy == "priority"  # else request priorities are ignored
        self.waiting = PriorityQueue() if self.by_priority else FCFSQueue()
        # In preemption order (see _run): the last one is preempted first.
        self.running: list[Request] = []
        self._batch_open = True  # static policy: whether the current batch still admits
        self.num_preemptions = 0
        self.lora_slots = LoRASlots(max_loras) if max_loras else None

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def num_pending_blocks(self) -> int:
        """Blocks that admitted and waiting requests will still take if each runs to its
        max_tokens (prefix hits ignored). Routers subtract this from the free blocks, so
        that short prompts with long answers ahead do not look cheap."""
        pending = 0
        for request in (*self.running, *self.waiting):
            final = cdiv(request.num_prompt_tokens + request.max_tokens, self.kv.block_size)
            pending += max(0, final - len(self.kv.block_ids(request.request_id)))
        return pending

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_tokens >= request.max_tokens:
                i += 1  # its last token is in flight (async scheduling): nothing left to run
                continue
            behind = request.num_tokens - request.num_computed_tokens
            n = min(behind + len(request.spec_token_ids), budget)
            if not self._make_room(request, n, out):
                break  # the request itself was preempted: it was running's last
            out.scheduled.append(ScheduledRequest(request, n, max(0, n - behind)))
            budget -= n
            i += 1

        if out.preempted:
            return out
        if self.static and not self.running:
            self._batch_open = True
        passed_over: list[Request] = []  # adapter requests that wait for a slot, in order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self._batch_open:
            request = self.waiting.peek()
            if request.lora is not None and (passed_over or not self.lora_slots.can_take(request.lora)):
                passed_over.append(self.waiting.pop())
                continue
            # Prompt logprobs need every prompt token's logits, which cached blocks lack.
            skip_cache = request.needs_prompt_logprobs
            root = request.block_hash_root
            cached = NO_PREFIX if skip_cache else self.kv.find_cached_prefix(request.token_ids, root)
            num_computed = cached.num_blocks * self.kv.block_size
            n = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate(request.request_id, num_computed + n, cached):
                self._batch_open = not self.static
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_preemptions == 0:
                # A resumed request (migration) can also find its earlier output cached.
                request.num_cached_tokens = min(num_computed, request.num_prompt_tokens)
            self._run(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        for request in reversed(passed_over):  # back in their places, ahead of later arrivals
            self.waiting.add_preempted(request)
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
        if self.static and (not self.waiting or len(self.running) >= self.max_num_seqs):
            self._batch_open = False
        return out

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Retire a request (finished or aborted) and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self._stop_running(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)

    def _run(self, request: Request) -> None:
        """Add to running, kept in admission order and, under the priority policy, by
        priority first (a stable insert), so that its last request is the one to preempt:
        the newest of the lowest priority. Running requests are served in this order too,
        so a victim is never one already scheduled this step."""
        if self.by_priority:
            bisect.insort(self.running, request, key=lambda r: r.priority)
        else:
            self.running.append(request)
        if request.lora is not None:
            self.lora_slots.acquire(request.lora)

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        if request.lora is not None:
            self.lora_slots.release(request.lora)

    def _make_room(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Preempt running requests, the last (see _run) first, until `request` can hold
        n more tokens. Returns False if `request` itself had to go."""
        while not self.kv.allocate(request.request_id, request.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def advance(self, plan: SchedulerOutput) -> None:
        """Record that the model computed KV for every scheduled token, and publish
        blocks that became full to the prefix cache."""
        for item in plan.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            # A block ending in a token still in flight is published once that token is known.
            known = min(request.num_computed_tokens, request.num_tokens - request.num_pending)
            self.kv.cache_full_blocks(request.request_id, request.token_ids, known, request.block_hash_root)

    def reject_proposed(self, request: Request, num_rejected: int) -> None:
        """Speculative decoding: the last num_rejected tokens computed were proposed and
        rejected. Their KV is stale and the blocks that held only them go back."""
        request.num_computed_tokens -= num_rejected
        self.kv.trim(request.request_id, request.num_computed_tokens)

    def preempt(self, request: Request) -> None:
        """Drop a running request's KV; it will be recomputed when readmitted."""
        request.spec_token_ids, request.spec_probs = [], None
        self._stop_running(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
