"""Verification of one request's proposal against the target model's logits at its k+1
positions (the k proposed tokens and the one after them), in one pass of the step.

Greedy requests accept proposed tokens while each is the target's argmax, then take the
target's argmax at the first disagreement (or after the last proposed token). Sampled
requests follow the standard rule that leaves the output distributed exactly as the
target's: token d, drawn from q, is accepted with probability min(1, p(d) / q(d)); at the
first rejection the token is drawn from the residual max(p - q, 0), normalised, and
after k acceptances from p. An n-gram proposal is a point mass, q(d) = 1.

p is what the sampler would sample from: the target's logits after logit_bias and the
grammar's mask (both applied by `edit`, position by position, so a grammar sees the
tokens accepted before each), then temperature, top-k, top-p and min-p."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from replica.request import Request
from replica.sampler import SamplingBatch, filtered_probs
from wire.outputs import TokenLogprob


@dataclass
class Verified:
    token_ids: list[int]  # the accepted proposed tokens, then the target's own next token
    num_accepted: int
    logprobs: list[TokenLogprob] | None  # with params.logprobs: one per token


def verify(
    logits: torch.Tensor,
    proposal: list[int],
    proposal_probs: torch.Tensor | None,
    request: Request,
    edit: Callable[[torch.Tensor, int], None] | None = None,
    accept_token: Callable[[int], None] | None = None,
) -> Verified:
    """logits: [k + 1, V], raw, one row per position. edit(row_logits, position) edits one
    row in place; accept_token(token) tells the caller a proposed token was accepted (a
    grammar consumes it before the next row is edited)."""
    params = request.params
    k = len(proposal)
    if edit is None and params.greedy:
        chosen = logits.argmax(dim=-1).tolist()  # one pass over every row
        num_accepted = _common_prefix(chosen, proposal)
        tokens = proposal[:num_accepted] + [chosen[num_accepted]]
        return Verified(tokens, num_accepted, _logprobs(logits, tokens, params.logprobs))

    rows = logits.float()
    tokens: list[int] = []
    for i in range(k + 1):
        if edit is not None:
            edit(rows[i : i + 1], i)
        if params.greedy:
            token = int(rows[i].argmax())
            if i < k and token == proposal[i]:
                tokens.append(token)
                if accept_token is not None:
                    accept_token(token)
                continue
            tokens.append(token)
            break
        p = _target_probs(rows[i : i + 1], request)[0]
        if i == k:
            tokens.append(_draw(p, request.generator))
            break
        draft = proposal[i]
        q_draft = 1.0 if proposal_probs is None else float(proposal_probs[i, draft])
        if _uniform(request.generator) * q_draft < float(p[draft]):  # probability min(1, p/q)
            tokens.append(draft)
            if accept_token is not None:
                accept_token(draft)
            continue
        if proposal_probs is None:
            residual = p.clone()
            residual[draft] = 0
        else:
            residual = (p - proposal_probs[i].to(p.device)).clamp_min_(0)
        tokens.append(_draw(residual if float(residual.sum()) > 0 else p, request.generator))
        break
    return Verified(tokens, len(tokens) - 1, _logprobs(rows[: len(tokens)], tokens, params.logprobs))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _target_probs(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """The sampler's distribution for one row, normalised: temperature, then top-k / top-p /
    min-p."""
    p = request.params
    device = logits.device
    batch = SamplingBatch(
        temperature=None,
        top_k=torch.tensor([p.top_k], device=device) if p.top_k else None,
        top_p=torch.tensor([p.top_p], device=device) if p.top_p < 1 else None,
        min_p=torch.tensor([p.min_p], device=device) if p.min_p > 0 else None,
        generators=[request.generator],
        all_greedy=False,
        penalties=None,
        logprobs=[None],
    )
    return filtered_probs(logits / max(p.temperature, 1e-5), batch)


def _uniform(generator: torch.Generator | None) -> float:
    if generator is None:
        return float(torch.rand(1))
    return float(torch.rand(1, generator=generator, device=generator.device))


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse CDF over unnormalised weights, as the sampler draws (one uniform)."""
    cdf = weights.cumsum(dim=-1)
    target = torch.tensor([_uniform(generator) * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    return min(int(torch.searchsorted(cdf, target, right=True)), weights.shape[-1] - 1)


def _logprobs(logits: torch.Tensor, tokens: list[int], num_top: int | None) -> list[TokenLogprob] | None:
    """The emitted tokens' logprobs from the (edited) logits, as the sampler reports them."""
    if num_top is None:
        return None
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    top_values, top_ids = logprobs.topk(max(num_top, 1), dim=-1)
    out = []
    for row, token in enumerate(tokens):
        top = dict(zip(top_ids[row, :num_top].tolist(), top_values[row, :num_top].tolist(), strict=True))
        out.append(TokenLogprob(token, float(logprobs[row, token]), top))
    return out
