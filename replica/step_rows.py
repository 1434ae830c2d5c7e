"""A scheduled step's rows in the order the runner takes them (decode rows, one new token
each, first), and what each row's logits are for. A row that completes its request's
input samples a token; beyond those, a step may want the logits of prompt positions
(prompt logprobs) and of proposed tokens' positions (verifying speculative decoding):
the extra rows, whose logits follow the sampling rows'."""

from dataclasses import dataclass

import torch

from replica.input_batch import Fill
from replica.output_processor import InFlight
from replica.prompt_logprobs import PromptRows, plan_prompt_rows
from replica.request import PENDING
from replica.scheduler import ScheduledRequest, SchedulerOutput
from replica.spec_decode.speculator import proposal_rows


@dataclass
class StepRows:
    plan: SchedulerOutput
    items: list[ScheduledRequest]  # in row order
    token_ids: list[list[int]]  # each row's new tokens; [PENDING]: its token is still on the device
    sample_rows: list[int]
    prompt: PromptRows | None  # packed token indices whose logits give prompt logprobs
    spec_rows: list[int]  # packed token indices whose logits verify proposed tokens
    extra_rows: list[int]  # both, ascending

    @classmethod
    def of(cls, plan: SchedulerOutput) -> "StepRows":
        """Before the scheduler advances the plan: planning the prompt rows moves each
        request's next_prompt_logprob past the entries planned."""
        items = sorted(plan.scheduled, key=lambda s: s.num_new_tokens != 1)
        token_ids = [s.new_token_ids for s in items]
        sample_rows = [i for i, s in enumerate(items) if s.produces_token]
        prompt = plan_prompt_rows(items)
        spec_rows = proposal_rows(items)
        extra_rows = sorted([*(prompt.rows if prompt is not None else []), *spec_rows])
        return cls(plan, items, token_ids, sample_rows, prompt, spec_rows, extra_rows)

    def fill(self, previous: InFlight | None, device: torch.device) -> Fill | None:
        """The decode rows whose input is the previous launch's sampled token (async only),
        which they read on the device: (their rows here, their tokens)."""
        token_ids = self.token_ids
        pending = [(i, s.request.pending_row) for i, s in enumerate(self.items) if token_ids[i] == [PENDING]]
        if not pending:
            return None
        rows, sources = zip(*pending, strict=True)
        return list(rows), previous.sampled.token_ids[torch.tensor(sources, device=device)]

    def logits_of(self, extra_logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The logits of `rows`, some of the extra rows, out of every extra row's."""
        if len(rows) == len(self.extra_rows):
            return extra_logits
        position = {row: j for j, row in enumerate(self.extra_rows)}
        return extra_logits[torch.tensor([position[r] for r in rows], device=extra_logits.device)]
