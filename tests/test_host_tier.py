"""The host KV tier (kvcache/host_tier.py, replica/kv_offload.py).

- Bookkeeping, as a hypothesis state machine over the real scheduler and KV manager with
  a shadow of what every device block and host slot holds: any interleaving of add,
  step, abort and preempt keeps every cached block's content equal to its hash in both
  tiers (so a restored block holds what was evicted), leaks no host slot and ends with
  every device block free.
- The copies move bytes exactly, for fp32, bf16 and both fp8 caches.
- A LoRA adapter's hash root keeps its blocks apart in the host tier too.
- Greedy fp32 output of the bundled model with the tier equals the output without it,
  for prompts that hit, miss and partly hit the host tier.
"""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule
from test_scheduler_properties import SchedulerMachine, complete_step

from kvcache import KVCacheManager, hash_full_blocks
from kvcache.block_math import cdiv
from kvcache.host_tier import HostTier, KVCopies
from replica.attention import load_backend
from replica.kv_offload import HostKVCache
from replica.kv_sizing import KVCacheLayout
from wire.sampling_params import SamplingParams

PARTIAL = b"partial"  # a device block whose tokens are not all written yet


class HostTierMachine(SchedulerMachine):
    """The scheduler's machine (its abort and preempt rules, its block and queue
    invariants) with a host tier, a shadow of every block's content, and the rules that
    make prefixes come back after they were evicted: resending earlier prompts and
    draining the queue."""

    num_blocks, block_size, max_num_seqs = 8, 2, 3
    num_host_blocks = 6

    def __init__(self):
        super().__init__()
        # What each device block and host slot holds: the chained hash of the tokens
        # whose KV it has (the model's KV is a function of them), PARTIAL, or None.
        self.device: list[bytes | None] = [None] * self.num_blocks
        self.host: list[bytes | None] = [None] * self.num_host_blocks
        self.sent: list[list[int]] = []

    @rule(
        # Few distinct tokens and long prompts: prefixes repeat and outgrow the device cache.
        prompt=st.lists(st.integers(0, 1), min_size=1, max_size=14),
        max_tokens=st.integers(1, 8),
    )
    def add(self, prompt, max_tokens):
        self.sent.append(prompt)
        self.submit(prompt, max_tokens)

    @rule(data=st.data(), more=st.lists(st.integers(0, 1), max_size=8), max_tokens=st.integers(1, 8))
    def resend(self, data, more, max_tokens):
        """A conversation's next turn: an earlier prompt again, with more after it."""
        if self.sent:
            earlier = data.draw(st.sampled_from(self.sent))
            self.add([*earlier, *more][: self.max_len - 1], max_tokens)

    @rule(token=st.integers(0, 1))
    def drain(self, token):
        """Step until every request is done, as a burst of traffic does."""
        for _ in range(200):
            if not self.live:
                break
            self.step(token)

    @rule(token=st.integers(0, 1))
    def step(self, token):
        plan = self.scheduler.schedule()
        copies = self.kv.take_copies()
        assert plan.scheduled or not copies, "copies belong to a step that runs"
        for block, slot in copies.offload:  # offloads first: their blocks may be refilled below
            assert self.device[block] not in (None, PARTIAL)
            self.host[slot] = self.device[block]
        for slot, block in copies.restore:
            self.device[block] = self.host[slot]
        size = self.block_size
        for item in plan.scheduled:  # the forward writes the KV of each row's new tokens
            request = item.request
            blocks = self.kv.block_ids(request.request_id)
            hashes = hash_full_blocks(request.token_ids[: item.context_len], size)
            for j in range(request.num_computed_tokens // size, cdiv(item.context_len, size)):
                self.device[blocks[j]] = hashes[j] if j < len(hashes) else PARTIAL
        for request in complete_step(self.scheduler, plan, token):
            del self.live[request.request_id]

    @invariant()
    def every_cached_block_holds_its_hash(self):
        for block_hash, block_id in self.kv.pool._cached.items():
            assert self.device[block_id] == block_hash
        for block_hash, slot in self.kv.host._slots.items():
            assert self.host[slot] == block_hash

    @invariant()
    def host_slots_are_accounted_for(self):
        host = self.kv.host
        held = list(host._slots.values())
        assert len(set(held)) == len(held)
        assert sorted(held + host._free) == list(range(self.num_host_blocks))
        assert not host._pinned and not host._copies  # every step took its copies

    def teardown(self):
        super().teardown()  # every request aborted, every device block free
        stats = self.kv.stats()
        assert stats.host_cache_hits == self.kv.host.num_restored
        assert stats.num_host_cached_blocks <= self.num_host_blocks


HostTierMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestHostTier = HostTierMachine.TestCase


def test_an_evicted_prefix_comes_back_from_the_host_tier():
    """The path the state machine must find, spelled out: a prompt's blocks are evicted
    by another's, copied down on the way, and a longer prompt with the same start gets
    them restored (and counted) instead of prefilled."""
    kv = KVCacheManager(num_blocks=4, block_size=2, num_host_blocks=4)
    first = [1, 2, 3, 4, 5]
    assert kv.allocate("a", 5, kv.find_cached_prefix(first))
    kv.cache_full_blocks("a", first, 5)
    first_blocks = kv.block_ids("a")[:2]
    kv.free("a")
    assert not kv.take_copies()
    other = [9, 9, 9, 9, 9, 9, 9]
    assert kv.allocate("b", 7, kv.find_cached_prefix(other))
    offloaded = kv.take_copies().offload
    assert sorted(block for block, _ in offloaded) == sorted(first_blocks)
    assert kv.stats().num_offloaded_blocks == 2
    kv.free("b")
    again = [*first, 6, 7]
    cached = kv.find_cached_prefix(again)
    assert not cached.blocks and cached.host_hashes == hash_full_blocks(first, 2)
    before = kv.stats()
    assert kv.allocate("c", 7, cached)
    copies = kv.take_copies()
    slot_of = dict(offloaded)
    assert [slot for slot, _ in copies.restore] == [slot_of[block] for block in first_blocks]
    assert [block for _, block in copies.restore] == kv.block_ids("c")[:2]
    stats = kv.stats()
    assert stats.host_cache_queries - before.host_cache_queries == 3  # none on the device, 2 here
    assert stats.host_cache_hits - before.host_cache_hits == 2


def test_a_lora_root_keeps_its_blocks_apart_in_the_host_tier():
    kv = KVCacheManager(num_blocks=2, block_size=2, num_host_blocks=4)
    prompt = [1, 2, 3]
    adapter_root = b"adapter-7"
    assert kv.allocate("a", 3, kv.find_cached_prefix(prompt, adapter_root))
    kv.cache_full_blocks("a", prompt, 3, adapter_root)
    kv.free("a")
    assert kv.allocate("b", 4, kv.find_cached_prefix([5, 6, 7, 8]))  # evicts the adapter's block
    kv.take_copies()
    kv.free("b")
    assert kv.find_cached_prefix(prompt).host_hashes == []
    assert len(kv.find_cached_prefix(prompt, adapter_root).host_hashes) == 1


def test_the_least_recently_used_unpinned_slot_goes_first():
    tier = HostTier(2)
    tier.offload(0, b"a")
    tier.offload(1, b"b")
    tier.take_copies()
    tier.pin(b"a")  # a restore of a follows in this step: b goes, although a is older
    tier.offload(2, b"c")
    assert b"a" in tier and b"b" not in tier and b"c" in tier
    tier.restore(b"a", 5)
    tier.offload(3, b"d")  # both slots pinned now: the block is dropped, not copied
    copies = tier.take_copies()
    assert b"d" not in tier
    assert copies == KVCopies(offload=[(2, 1)], restore=[(0, 5)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@given(data=st.data())
@settings(max_examples=10, deadline=None)
def test_copies_move_blocks_bytes_for_bytes(dtype, data):
    """Random bytes (NaN patterns included) go down and come back unchanged, into other
    blocks, in every layer."""
    layout = KVCacheLayout(load_backend("torch"), 3, 4, 2, 8, dtype, torch.device("cpu"))
    num_blocks, num_slots = 6, 5
    device = layout.allocate(num_blocks)
    for k, v in device:
        k.view(torch.uint8).random_(0, 256)
        v.view(torch.uint8).random_(0, 256)
    before = [(k.clone(), v.clone()) for k, v in device]
    host = HostKVCache(layout, num_slots)
    blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=num_slots, unique=True))
    slots = data.draw(st.permutations(range(num_slots)))[: len(blocks)]
    targets = data.draw(st.permutations(range(num_blocks)))[: len(blocks)]
    host.copy(KVCopies(offload=list(zip(blocks, slots, strict=True))), device)
    for k, v in device:  # the device blocks are reused
        k.view(torch.uint8).fill_(7)
        v.view(torch.uint8).fill_(7)
    host.copy(KVCopies(restore=list(zip(slots, targets, strict=True))), device)
    for (k, v), (k0, v0) in zip(device, before, strict=True):
        for block, target in zip(blocks, targets, strict=True):
            assert torch.equal(k[target].view(torch.uint8), k0[block].view(torch.uint8))
            assert torch.equal(v[target].view(torch.uint8), v0[block].view(torch.uint8))


HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
MAX_NEW = 12


def conversation_prompts(tokenizer) -> list[list[int]]:
    """Turns as an agent sends them, one at a time: a conversation resent with more each
    turn, with other work between its turns that fills the 24-block device cache and so
    evicts it; then a prompt that shares only its first blocks, and one that shares none."""
    words = HELD_OUT.read_text().split()
    text = [tokenizer(" ".join(words[i : i + 300])).input_ids for i in range(0, 3000, 300)]
    first_turn = text[0][:100]
    second_turn = first_turn + text[1][:60]
    third_turn = second_turn + text[2][:40]
    return [
        first_turn,
        text[3][:350],
        second_turn,
        text[4][:350],
        third_turn,
        first_turn[:40] + text[5][:50],
        text[6][:90],
    ]


def test_greedy_fp32_output_is_the_same_with_and_without_the_host_tier(model_path, tokenizer, hf_model):
    from kvserve import LLM
    from tests.conftest import hf_greedy

    common = dict(dtype="float32", block_size=16, num_kv_blocks=24, max_num_seqs=4)
    with_tier = LLM(str(model_path), kv_offloading_size=0.05, **common)
    without = LLM(str(model_path), **common)
    assert with_tier.engine.kv.host.num_slots == int(0.05 * 2**30) // with_tier.engine.runner.bytes_per_block
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    prompts = conversation_prompts(tokenizer)
    outputs = {}
    for name, llm in (("with", with_tier), ("without", without)):
        outputs[name] = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outputs["with"]] == [o.token_ids for o in outputs["without"]]
    cached = {name: [o.num_cached_tokens for o in outs] for name, outs in outputs.items()}
    stats = with_tier.engine.kv.stats()
    assert stats.host_cache_hits > 0 and stats.num_offloaded_blocks > 0
    # The conversation's turns find their whole prefix (every full block of the turn
    # before) in one tier or the other, where without it they prefill most of it.
    assert cached["with"][2] == 96 and cached["with"][4] == 160
    assert cached["without"][2] < 96 and cached["without"][4] < 160
    assert outputs["with"][4].token_ids == hf_greedy(hf_model, prompts[4], MAX_NEW, set())
