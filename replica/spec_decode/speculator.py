"""The engine's side of speculative decoding: which running requests propose in a step,
their proposals (request.spec_token_ids, which the scheduler schedules after the
request's catch-up token), and, once the step has run, the verification of each against
the target's logits at its positions, giving back the KV of rejected tokens.

A step may speculate while at most disable_by_batch_size requests run; a request
proposes unless it opted out (`speculative=False`), uses penalties (they count every
token sampled before the next), is still prefilling, or is paused by its acceptance
(acceptance.py)."""

from collections.abc import Callable
from dataclasses import replace

import llguidance
import torch

from replica.config import EngineConfig
from replica.constraints import GrammarCompiler, apply_logit_bias
from replica.cpu.affinity import CorePlan
from replica.request import Request
from replica.scheduler import ScheduledRequest, Scheduler
from replica.spec_decode.ngram import NgramProposer
from replica.spec_decode.verify import Verified, verify
from wire.spec_decode_stats import SpecDecodeStats


class Speculator:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, vocab_size: int, num_blocks: int):
        """vocab_size, num_blocks: the target's (a draft model must share the vocabulary;
        its KV has as many blocks)."""
        self.spec = spec = config.speculative_config
        self.scheduler = scheduler
        self.stats = SpecDecodeStats()
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec)
        else:
            from replica.spec_decode.draft_model import DraftModelProposer  # a second model

            self.proposer = DraftModelProposer(config, spec, vocab_size, num_blocks)

    def may_speculate(self) -> bool:
        """Whether this step may speculate: then it runs in step (no async scheduling),
        since a proposal starts from a request's newest token. Only while a request that
        may propose has a lead (proposer.has_lead): text an n-gram lookup cannot predict
        keeps async scheduling's overlap."""
        running = self.scheduler.running
        return len(running) <= self.spec.disable_by_batch_size and any(
            _may_propose(r) and self.proposer.has_lead(r) for r in running
        )

    def propose(self) -> None:
        """Proposals for the running requests that speculate this step. Stale ones (made
        for a step that did not schedule them) are dropped first."""
        running = self.scheduler.running
        for request in running:
            request.speculation.tick()
            if request.spec_token_ids:
                request.spec_token_ids, request.spec_probs = [], None
                self.proposer.rollback(request.request_id, request.num_tokens)
        if not self.may_speculate():
            return
        chosen = [(r, k) for r in running if (k := self._num_to_propose(r))]
        if not chosen:
            return
        requests, sizes = map(list, zip(*chosen, strict=True))
        for request, proposal in zip(requests, self.proposer.propose(requests, sizes), strict=True):
            tokens = proposal.token_ids
            if request.matcher is not None and tokens:  # the grammar rejects what it cannot follow
                tokens = tokens[: request.matcher.validate_tokens(tokens)]
            request.spec_token_ids = tokens
            if proposal.probs is not None and tokens:
                request.spec_probs = proposal.probs[: len(tokens)]

    def _num_to_propose(self, request: Request) -> int:
        if not _may_propose(request) or request.num_pending:
            return 0
        if request.num_computed_tokens != request.num_tokens - 1:  # a prefill chunk
            return 0
        room = request.max_tokens - request.num_output_tokens - 1  # the last token is the target's
        return max(0, min(self.spec.num_speculative_tokens, room))

    def verify(
        self,
        items: list[ScheduledRequest],
        sample_rows: list[int],
        logits: torch.Tensor,
        proposal_logits: torch.Tensor,
        grammars: GrammarCompiler | None,
    ) -> list[tuple[Request, Verified]]:
        """Verify each speculating item's proposal. logits: every sampling row's last
        position; proposal_logits: the positions before it of the speculating items (the
        rows of proposal_rows), in order. Tokens are appended by the engine."""
        spec = self.spec
        verified = []
        start = 0
        for j, i in enumerate(sample_rows):
            item = items[i]
            k = item.num_spec_tokens
            if not k:
                continue
            request = item.request
            rows = torch.cat([proposal_logits[start : start + k], logits[j : j + 1]])
            start += k
            probs = request.spec_probs[:k] if request.spec_probs is not None else None
            edit, accept = _edits(request, grammars)
            result = verify(rows, request.spec_token_ids[:k], probs, request, edit, accept)
            if request.matcher is not None and result.num_accepted:
                request.matcher.rollback(result.num_accepted)  # consumed again as they are appended
            self.scheduler.reject_proposed(request, k - result.num_accepted)
            self.proposer.rollback(request.request_id, request.num_tokens + result.num_accepted)
            self.stats.record(k, result.num_accepted)
            request.speculation.record(
                k, result.num_accepted, spec.acceptance_window, spec.min_acceptance_rate, spec.backoff_steps
            )
            request.spec_token_ids, request.spec_probs = [], None
            verified.append((request, result))
        return verified

    def stats_snapshot(self) -> SpecDecodeStats:
        """A copy: the stats cross to other threads while the engine steps."""
        return replace(self.stats, accepted_per_pos=list(self.stats.accepted_per_pos))

    def drop(self, request_id: str) -> None:
        """A request finished or was preempted: its draft KV, if any, goes."""
        self.proposer.drop(request_id)

    def use_cores(self, plan: CorePlan) -> None:
        self.proposer.use_cores(plan)


def _may_propose(request: Request) -> bool:
    params = request.params
    return params.speculative and not params.has_penalties and request.speculation.ready()


def proposal_rows(items: list[ScheduledRequest]) -> list[int]:
    """Packed rows whose logits verify proposed tokens: in each speculating item, the
    num_spec_tokens rows before its last (the last is its sampling row)."""
    rows = []
    offset = 0
    for item in items:
        offset += item.num_new_tokens
        rows.extend(range(offset - 1 - item.num_spec_tokens, offset - 1))
    return rows


def _edits(
    request: Request, grammars: GrammarCompiler | None
) -> tuple[Callable[[torch.Tensor, int], None] | None, Callable[[int], object] | None]:
    """verify()'s edit and accept_token: each position's logits get the logit bias and the
    grammar's mask, as the sampler's would, the grammar having consumed the proposed
    tokens accepted before it."""
    if not request.edits_logits:
        return None, None
    bias = request.params.logit_bias
    matcher: llguidance.LLMatcher | None = request.matcher

    def edit(row: torch.Tensor, position: int) -> None:
        if bias:
            apply_logit_bias(row, [0], [bias])
        if matcher is not None:
            grammars.mask(row, [0], [matcher])

    return edit, (matcher.consume_token if matcher is not None else None)
