"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): each prompt token's
logprob given the tokens before it, its rank, and the top-k alternatives, taken from the
engine's own prefill, as lm-eval's loglikelihood tasks need them.

Position p of a prompt predicts token p + 1, so a chunk of prefill over positions
[start, end) yields the entries of tokens start + 1 .. end, up to the last prompt token
(the last prompt position's logits sample the first output token instead). The engine
asks the runner for the logits of exactly those rows, beyond the rows that sample, and
only for requests that want prompt logprobs: every other request's step costs what it
did. Entries are computed across chunked-prefill chunks, and the first prompt token's
is None, as in vLLM.

Cached prefixes have KV but no logits, so a request whose prompt logprobs are not all
computed yet skips the prefix-cache lookup and prefills its whole prompt (what vLLM v1
does too); its blocks are still published to the cache for the requests after it.
Where the request stands is `Request.next_prompt_logprob`, moved when a step is
launched, so a request preempted and recomputed neither repeats nor loses an entry.

The plan (which rows, which target tokens) is CPU bookkeeping; the log-softmax runs on
the device, in fp32, in slices that bound its memory, and its results stay there until
the engine completes the step (`PromptLogprobs.resolve`), as sampled tokens do under
async scheduling."""

from dataclasses import dataclass

import torch

from replica.request import Request
from wire.outputs import TokenLogprob

# Rows per fp32 log-softmax: bounds the step's extra memory to SLICE_ROWS x vocab floats.
SLICE_ROWS = 512


@dataclass
class PromptSpan:
    """Consecutive entries of one request computed in a step, in row order."""

    request: Request
    num_entries: int


@dataclass
class PromptRows:
    """A step's rows for prompt logprobs: packed token indices, ascending."""

    rows: list[int]
    targets: list[int]  # the prompt token each row predicts
    spans: list[PromptSpan]
    num_top: int  # the largest k any of the step's requests asks for


def plan_prompt_rows(items: list) -> PromptRows | None:
    """items: the step's ScheduledRequests in packed order, before the scheduler
    advances them. Moves each request's next_prompt_logprob past the entries planned."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[PromptSpan] = []
    num_top = 0
    offset = 0  # the packed index of the item's first token
    for item in items:
        request: Request = item.request
        if request.needs_prompt_logprobs:
            start = request.num_computed_tokens
            # The scheduler skips cached prefixes for these requests, so a chunk never
            # starts past the next entry's position.
            first = max(start, request.next_prompt_logprob - 1)
            end = min(item.context_len, request.num_prompt_tokens - 1)
            if end > first:
                rows += range(offset + first - start, offset + end - start)
                targets += request.prompt_token_ids[first + 1 : end + 1]
                spans.append(PromptSpan(request, end - first))
                num_top = max(num_top, request.params.prompt_logprobs)
                request.next_prompt_logprob = end + 1
        offset += item.num_new_tokens
    return PromptRows(rows, targets, spans, num_top) if rows else None


@dataclass
class PromptLogprobs:
    """A step's prompt-logprob entries, on the device until resolved."""

    spans: list[PromptSpan]
    logprobs: torch.Tensor  # [R] the prompt tokens' own
    ranks: torch.Tensor  # [R] their 1-based ranks in the vocabulary
    top_logprobs: torch.Tensor  # [R, k]
    top_ids: torch.Tensor  # [R, k]

    def resolve(self) -> None:
        """Read the entries back and append them to their requests, in prompt order."""
        chosen, ranks = self.logprobs.tolist(), self.ranks.tolist()
        values, ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        row = 0
        for span in self.spans:
            request = span.request
            k = request.params.prompt_logprobs
            first = len(request.prompt_logprobs)
            for j in range(span.num_entries):
                top = dict(zip(ids[row][:k], values[row][:k], strict=True))
                token = request.prompt_token_ids[first + j]
                request.prompt_logprobs.append(TokenLogprob(token, chosen[row], top, ranks[row]))
                row += 1


@torch.inference_mode()
def compute_prompt_logprobs(logits: torch.Tensor, plan: PromptRows) -> PromptLogprobs:
    """logits: [R, V] for plan.rows, in the model's dtype -> fp32 log-softmax entries."""
    targets = torch.tensor(plan.targets, dtype=torch.long, device=logits.device)[:, None]
    k = max(plan.num_top, 1)
    parts = []
    for start in range(0, logits.shape[0], SLICE_ROWS):
        logprobs = logits[start : start + SLICE_ROWS].float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[start : start + SLICE_ROWS])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        parts.append((chosen[:, 0], ranks, *logprobs.topk(k, dim=-1)))
    chosen, ranks, top_values, top_ids = (torch.cat(p) for p in zip(*parts, strict=True))
    return PromptLogprobs(plan.spans, chosen, ranks, top_values, top_ids)
