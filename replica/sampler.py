"""Vectorised sampling over one step's logits.

One [B, V] pass handles every row: penalties, temperature, top-k / top-p / min-p, then
the Gumbel-max trick (argmax of p / Exp(1) noise), which samples exactly from p and
lets seeded rows draw their noise from their own generator without a per-row sampler.
Greedy rows take the argmax of the (penalised) logits.
"""

from dataclasses import dataclass

import torch

from replica.request import Request, TokenLogprob


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step, built from the requests that sample."""

    temperature: torch.Tensor  # [B] float, 0 for greedy rows
    top_k: torch.Tensor | None  # [B] long, V where disabled
    top_p: torch.Tensor | None  # [B] float
    min_p: torch.Tensor | None  # [B] float
    generators: list[torch.Generator | None]
    all_greedy: bool
    penalties: "Penalties | None"
    logprobs: list[int | None]  # top-n alternatives each row wants, None for no logprobs

    @property
    def max_logprobs(self) -> int:
        return max((n for n in self.logprobs if n is not None), default=-1)

    @classmethod
    def from_requests(
        cls,
        requests: list[Request],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        params = [r.params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        need_top_k = any(p.top_k and not p.greedy for p in params)
        need_top_p = any(p.top_p < 1 and not p.greedy for p in params)
        need_min_p = any(p.min_p > 0 and not p.greedy for p in params)
        return cls(
            temperature=temperature.to(device),
            top_k=_row_tensor([p.top_k or vocab_size for p in params], torch.long, device)
            if need_top_k
            else None,
            top_p=_row_tensor([p.top_p for p in params], torch.float32, device) if need_top_p else None,
            min_p=_row_tensor([p.min_p for p in params], torch.float32, device) if need_min_p else None,
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            penalties=Penalties.from_requests(requests, vocab_size, device)
            if any(p.has_penalties for p in params)
            else None,
            logprobs=[p.logprobs for p in params],
        )


@dataclass
class Penalties:
    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1]
    output_counts: torch.Tensor  # [B, V] occurrences in the output so far
    seen: torch.Tensor  # [B, V] bool, in prompt or output (for the repetition penalty)

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device) -> "Penalties":
        b = len(requests)
        counts = torch.zeros(b, vocab_size + 1, dtype=torch.float32)
        seen = torch.zeros(b, vocab_size + 1, dtype=torch.bool)
        outputs = _padded([r.output_token_ids for r in requests], pad=vocab_size)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
        prompts = _padded([r.prompt_token_ids for r in requests], pad=vocab_size)
        seen.scatter_(1, prompts, True)
        seen |= counts > 0
        params = [r.params for r in requests]
        return cls(
            presence=_row_tensor([p.presence_penalty for p in params], torch.float32, device)[:, None],
            frequency=_row_tensor([p.frequency_penalty for p in params], torch.float32, device)[:, None],
            repetition=_row_tensor([p.repetition_penalty for p in params], torch.float32, device)[:, None],
            output_counts=counts[:, :vocab_size].to(device),
            seen=seen[:, :vocab_size].to(device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Repetition penalty as in HF / CTRL: shrink positive logits, grow negative ones.
        penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, penalised, logits)
        logits = logits - self.frequency * self.output_counts
        return logits - self.presence * (self.output_counts > 0).float()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)

    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        temperature = batch.temperature.clamp_min(1e-5)[:, None]
        probs = _filtered_probs(logits / temperature, batch)
        noise = _exponential_noise(probs, batch.generators)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(batch.temperature == 0, greedy_tokens, sampled)

    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(token_list)
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_values, top_ids = raw_logprobs.topk(max(batch.max_logprobs, 1), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for row, n in enumerate(batch.logprobs):
            if n is None:
                continue
            top = dict(zip(top_ids[row][:n], top_values[row][:n], strict=True))
            logprobs[row] = TokenLogprob(token_list[row], chosen[row], top)
    return SamplerOutput(token_list, logprobs)


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.top_k is not None or batch.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if batch.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            drop |= ranks[None, :] >= batch.top_k[:, None]
        if batch.top_p is not None:
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= batch.top_p[:, None]  # always keeps the top token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        threshold = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise.clamp_min_(1e-20)  # an exact 0 draw would divide by zero


def _row_tensor(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
