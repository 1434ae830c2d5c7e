"""Counters of proposals and acceptances since the engine started, under vLLM's names
once they reach /metrics (vllm:spec_decode_*)."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # proposals verified (one per request per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[i]: proposals whose token at position i was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
