"""Per-slot sampling state of the running requests, kept across steps as vLLM v1's input
batch keeps it.

A request's row (temperature, top-k/p, min-p, penalties) is written once, when it first
samples; each step gathers the rows it needs. Penalty counts over the vocabulary grow by
the one token each row sampled, instead of being recounted from every request's whole
history at every step. A preempted request gives its slot back and rebuilds its row from
its history when it samples again.
"""

import torch

from replica.request import Request
from replica.sampler import Penalties, SamplingBatch


class SamplingState:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device

        def column(dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(max_slots, dtype=dtype, device=device)

        self.temperature = column()
        self.top_k = column(torch.long)  # vocab_size where disabled
        self.top_p = column()
        self.min_p = column()
        self.presence = column()
        self.frequency = column()
        self.repetition = column()
        # [max_slots, V], allocated when the first request with penalties samples.
        self.output_counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None  # in the prompt or the output so far
        self._slots: dict[str, int] = {}
        self._free = list(range(max_slots - 1, -1, -1))

    @property
    def num_slots_in_use(self) -> int:
        return len(self._slots)

    def batch(self, requests: list[Request]) -> SamplingBatch:
        params = [r.params for r in requests]
        generators = [r.generator for r in requests]
        logprobs = [p.logprobs for p in params]
        penalized = any(p.has_penalties for p in params)
        if not penalized and all(p.greedy for p in params):  # the common fast path: argmax
            return SamplingBatch(None, None, None, None, generators, True, None, logprobs)
        rows = torch.tensor([self._slot(r) for r in requests], device=self.device)
        sampling = [p for p in params if not p.greedy]
        penalties = None
        if penalized:
            penalties = Penalties(
                presence=self.presence[rows, None],
                frequency=self.frequency[rows, None],
                repetition=self.repetition[rows, None],
                output_counts=self.output_counts[rows],
                seen=self.seen[rows],
            )
        return SamplingBatch(
            temperature=self.temperature[rows],
            top_k=self.top_k[rows] if any(p.top_k for p in sampling) else None,
            top_p=self.top_p[rows] if any(p.top_p < 1 for p in sampling) else None,
            min_p=self.min_p[rows] if any(p.min_p > 0 for p in sampling) else None,
            generators=generators,
            all_greedy=not sampling,
            penalties=penalties,
            logprobs=logprobs,
        )

    def record(self, requests: list[Request], token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled (still on the device) for the requests that use
        penalties, so the next step's penalties include them even before they are read."""
        if self.output_counts is None:
            return
        rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if not rows:
            return
        slots = torch.tensor([self._slots[requests[i].request_id] for i in rows], device=self.device)
        tokens = token_ids[torch.tensor(rows, device=self.device)]
        self.output_counts.index_put_(
            (slots, tokens), torch.ones_like(slots, dtype=torch.float32), accumulate=True
        )
        self.seen[slots, tokens] = True

    def remove(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _slot(self, request: Request) -> int:
        slot = self._slots.get(request.request_id)
        if slot is not None:
            return slot
        slot = self._slots[request.request_id] = self._free.pop()
        p = request.params
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k or self.vocab_size
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        if p.has_penalties and self.output_counts is None:
            shape = (self.temperature.shape[0], self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if self.output_counts is not None:
            self.output_counts[slot] = 0
            self.seen[slot] = False
            if p.has_penalties:
                outputs = torch.tensor(request.output_token_ids, dtype=torch.long, device=self.device)
                self.output_counts[slot].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))
                self.seen[slot, torch.tensor(request.prompt_token_ids, device=self.device)] = True
                self.seen[slot, outputs] = True
        return slot
