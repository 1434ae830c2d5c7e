"""Draft-model proposals: a small model of the target's vocabulary guesses the next k
tokens of each request, and the target verifies them all in one forward.

The draft runs in the target's process with a ModelRunner and a paged KV cache of its
own (no prefix caching: its blocks live only as long as its requests' drafts). It keeps,
per request, how much of the request's tokens it already holds KV for, so each proposal
only runs the tokens the target added since the last one (the accepted drafts and the
target's own token), then one decode step per further draft token.
"""

from dataclasses import dataclass, field, replace

import torch
from transformers import AutoConfig

from kvcache import KVCacheManager
from replica.config import EngineConfig
from replica.cpu.affinity import CorePlan
from replica.model_loader import resolve_model
from replica.model_runner import ModelRunner
from replica.request import Request
from replica.spec_decode.config import SpeculativeConfig
from replica.spec_decode.proposal import Proposal


@dataclass
class _DraftKV:
    """What a request's draft KV holds: its first `num_known` tokens, then `drafts`, the
    draft tokens fed after them. A draft the target rejected no longer matches the
    request's tokens, so propose() rechecks them rather than trusting rollback alone."""

    num_known: int = 0
    drafts: list[int] = field(default_factory=list)

    def num_valid(self, token_ids: list[int]) -> int:
        """Tokens of token_ids whose KV here is theirs."""
        n = self.num_known
        for draft in self.drafts:
            if n >= len(token_ids) or token_ids[n] != draft:
                break
            n += 1
        return n


@dataclass
class _Job:
    """One request's proposal in progress."""

    index: int  # in propose()'s arguments
    request: Request
    k: int  # tokens to propose
    start: int  # first token of request.token_ids still to run through the draft
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftModelProposer:
    def __init__(
        self, config: EngineConfig, spec: SpeculativeConfig, target_vocab_size: int, num_blocks: int
    ):
        """num_blocks: the draft's KV blocks, sized by the engine (the draft's memory
        comes out of the target's budget)."""
        path = resolve_model(spec.model, None)
        # Checked before the weights load: a mismatch is a configuration error.
        draft_vocab_size = AutoConfig.from_pretrained(path).vocab_size
        if draft_vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config: the draft model {spec.model!r} has vocab_size {draft_vocab_size}, "
                f"the target model {target_vocab_size}; a draft model must share the target's vocabulary"
            )
        draft_config = replace(
            config,
            model=spec.model,
            revision=None,
            enable_lora=False,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=False,
            kv_offloading_size=0.0,
            speculative_config=None,
            # Drafts decode only in steps that speculate, of at most disable_by_batch_size requests.
            cuda_graph_max_batch=min(config.cuda_graph_max_batch, spec.disable_by_batch_size),
        )
        self.runner = ModelRunner(draft_config, path)
        self.kv = KVCacheManager(self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=False)
        self.max_model_len = self.runner.max_model_len
        # Catch-up forwards are split to the target's token budget, which bounds their memory.
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._held: dict[str, _DraftKV] = {}

    def has_lead(self, request: Request) -> bool:
        """A draft model proposes after any token."""
        return True

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        """num_tokens[i] draft tokens for requests[i], whose token_ids are all known. A
        request that cannot get draft KV blocks gets no proposal: the draft never
        preempts anything, speculation is only ever an optimisation."""
        proposals = [Proposal([]) for _ in requests]
        jobs: list[_Job] = []
        for i, (request, k) in enumerate(zip(requests, num_tokens, strict=True)):
            n = len(request.token_ids)
            # Draft j is fed at position n + j - 2: the last fed (draft k - 1) stays in the window.
            k = min(k, self.max_model_len + 1 - n)
            if k <= 0:
                continue
            if not self.kv.allocate(request.request_id, n + k - 1):
                self.drop(request.request_id)
                continue
            held = self._held.setdefault(request.request_id, _DraftKV())
            # At least the last token runs: its logits give draft 1.
            jobs.append(_Job(i, request, k, start=min(held.num_valid(request.token_ids), n - 1)))
        if not jobs:
            return proposals

        self._draw(jobs, self._catch_up(jobs))
        for step in range(1, max(job.k for job in jobs)):
            active = [job for job in jobs if job.k > step]
            n = [len(job.request.token_ids) for job in active]
            logits = self.runner.execute(
                token_ids=[[job.tokens[-1]] for job in active],
                context_lens=[m + step for m in n],
                block_tables=[self.kv.block_ids(job.request.request_id) for job in active],
                sample_rows=list(range(len(active))),
            )
            self._draw(active, logits)

        for job in jobs:
            self._held[job.request.request_id] = _DraftKV(len(job.request.token_ids), job.tokens[:-1])
            probs = torch.stack(job.probs) if job.probs else None
            proposals[job.index] = Proposal(job.tokens, probs)
        return proposals

    def _catch_up(self, jobs: list[_Job]) -> torch.Tensor:
        """Run each job's tokens from job.start through the draft; logits [len(jobs), V]
        of each one's last token. Usually one forward of a token or two per request; a
        request new to the draft brings its whole prompt, so forwards are cut at the
        token budget (a chunked prefill, as the target's)."""
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        starts = [job.start for job in jobs]
        while any(logits_row is None for logits_row in logits):
            budget = self.max_num_batched_tokens
            rows: list[tuple[int, int]] = []  # (job, end of its chunk)
            for i, job in enumerate(jobs):
                if logits[i] is None and budget > 0:
                    end = min(len(job.request.token_ids), starts[i] + budget)
                    rows.append((i, end))
                    budget -= end - starts[i]
            rows.sort(key=lambda row: row[1] - starts[row[0]] != 1)  # the runner wants decodes first
            ends_here = [r for r, (i, end) in enumerate(rows) if end == len(jobs[i].request.token_ids)]
            out = self.runner.execute(
                token_ids=[jobs[i].request.token_ids[starts[i] : end] for i, end in rows],
                context_lens=[end for _, end in rows],
                block_tables=[self.kv.block_ids(jobs[i].request.request_id) for i, _ in rows],
                sample_rows=ends_here,
            )
            for row, r in enumerate(ends_here):
                logits[rows[r][0]] = out[row]
            for i, end in rows:
                starts[i] = end
        return torch.stack(logits)

    def _draw(self, jobs: list[_Job], logits: torch.Tensor) -> None:
        """Append each job's next draft token: the argmax for greedy requests; else a
        draw from q = softmax(logits / temperature), with the request's own generator
        when seeded so that its output stays reproducible. No top-k/top-p: the target's
        verification is exact for any q, and plain q is what the draft model says."""
        tokens = logits.argmax(dim=-1)
        for row, job in enumerate(jobs):
            params = job.request.params
            if params.greedy:
                continue
            q = torch.softmax(logits[row].float() / params.temperature, dim=-1)
            tokens[row] = torch.multinomial(q, 1, generator=job.request.generator)[0]
            job.probs.append(q)
        for job, token in zip(jobs, tokens.tolist(), strict=True):
            job.tokens.append(token)

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        """The target verified the proposal: the first num_valid_tokens of the request's
        tokens agree with what the draft holds KV for. Its blocks stay allocated (at most
        k - 1 tokens past the need); the next propose() overwrites their stale KV."""
        held = self._held.get(request_id)
        if held is None:
            return
        num_valid = min(held.num_known + len(held.drafts), num_valid_tokens)
        if num_valid <= held.num_known:
            held.num_known, held.drafts = num_valid, []
        else:
            del held.drafts[num_valid - held.num_known :]

    def drop(self, request_id: str) -> None:
        """Free the request's draft KV: it finished, was aborted or was preempted."""
        self._held.pop(request_id, None)
        self.kv.free(request_id)

    def use_cores(self, plan: CorePlan) -> None:
        """A pinned serving replica's draft runs on the target's cores."""
        self.runner.use_cores(plan)
