"""Vectorised sampling over one step's logits.

One [B, V] pass handles every row: penalties, temperature, top-k / top-p / min-p, then
inverse-CDF sampling: one uniform draw per row, looked up in the row's cumulative
probabilities. That samples exactly from p, lets seeded rows draw from their own
generator without a per-row sampler, and costs one random number per row, where the
Gumbel-max trick needs one per vocabulary entry (on CPU, drawing [B, V] exponentials
costs a large share of a decode step). Greedy rows take the argmax of
the (penalised) logits.

Top-k / top-p / min-p keep a prefix of the tokens ranked by probability. Sorting every
row's vocabulary to find it costs more than a small model's whole decode step on CPU, and
the kept prefix is usually a handful of tokens (a model's generation config, such as
temperature 0.2 with top_p 0.9, is what served requests get by default). So on CPU each
filtered row looks among its most likely tokens first (CANDIDATES, one topk each), and
only a row whose kept tokens may reach past them sorts its whole vocabulary. The CPU
engine's fused kernel (`fused_sample`, replica/cpu/sampling.c) does the same in one call
for every row; these torch ops serve where it is not built and on GPUs.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from wire.outputs import TokenLogprob

# How many of a filtered row's most likely tokens are ranked, in turn, before its whole
# vocabulary is: the first holds the nucleus of a peaked distribution, the second that of
# most others; a topk of either size costs a few percent of a full sort.
CANDIDATES = (32, 1024)


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step (sampling_state.py gathers them)."""

    temperature: torch.Tensor | None  # [B] float, 0 for greedy rows; None when all are greedy
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


@dataclass
class Penalties:
    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1]
    output_counts: torch.Tensor  # [B, V] occurrences in the output so far
    seen: torch.Tensor  # [B, V] bool, in prompt or output (for the repetition penalty)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Repetition penalty as in HF / CTRL: shrink positive logits, grow negative ones.
        penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, penalised, logits)
        logits = logits - self.frequency * self.output_counts
        return logits - self.presence * (self.output_counts > 0).float()


@dataclass
class SamplerOutput:
    """Sampled tokens, still on the logits' device: with async scheduling the next step is
    launched before they are read, and its decode rows take their inputs from here."""

    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None = None  # [B] the chosen tokens' raw logprobs
    top_logprobs: torch.Tensor | None = None  # [B, k]
    top_ids: torch.Tensor | None = None  # [B, k]
    num_logprobs: list[int | None] = field(default_factory=list)  # k each row asked for

    def resolve(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """Bring the tokens (and logprobs) to the host; this waits for the step to finish."""
        tokens = self.token_ids.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprobs is not None:
            chosen, values, ids = self.logprobs.tolist(), self.top_logprobs.tolist(), self.top_ids.tolist()
            for row, n in enumerate(self.num_logprobs):
                if n is not None:
                    top = dict(zip(ids[row][:n], values[row][:n], strict=True))
                    logprobs[row] = TokenLogprob(tokens[row], chosen[row], top)
        return tokens, logprobs


# (logits [B, V], temperatures [B] with 0 for greedy rows, draws [B, 1] in [0, 1), then
# the batch's top_k, top_p and min_p, each None where no row sets it) -> tokens [B]
FusedSample = Callable[..., torch.Tensor]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
    fused_sample: FusedSample | None = None,
) -> SamplerOutput:
    """logits: [B, V] in the model's dtype. `argmax` may be a faster kernel than torch's
    (the CPU one reads bf16 directly); greedy rows without penalties never widen to fp32.
    `fused_sample`, a kernel that draws every row's token in one call (temperature and
    filters), samples in place of the torch ops below, after penalties where a row has
    them."""
    plain = batch.penalties is None and batch.max_logprobs < 0
    if batch.all_greedy and plain:
        return SamplerOutput(argmax(logits))
    if fused_sample is not None and plain:
        return SamplerOutput(_fused(fused_sample, logits, batch))
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)

    if batch.all_greedy:
        tokens = argmax(logits)
    elif fused_sample is not None:
        tokens = _fused(fused_sample, logits, batch)
    else:
        scaled = logits / batch.temperature.clamp_min(1e-5)[:, None]
        draws = _uniforms(logits, batch.generators)
        greedy = batch.temperature == 0
        if logits.device.type == "cpu":
            tokens = _sample_filtered(scaled, batch, draws)
            if greedy.any():
                tokens = torch.where(greedy, argmax(logits), tokens)
        else:
            # The candidates split rows by what they hold, which would make the host wait
            # for the step; a GPU sorts a vocabulary quickly, and async scheduling needs a
            # step whose tokens stay on the device.
            tokens = _inverse_cdf(_filtered_probs(scaled, batch), draws)
            tokens = torch.where(greedy, argmax(logits), tokens)

    if raw_logprobs is None:
        return SamplerOutput(tokens)
    top_values, top_ids = raw_logprobs.topk(max(batch.max_logprobs, 1), dim=-1)
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    return SamplerOutput(tokens, chosen, top_values, top_ids, batch.logprobs)


def _fused(fused_sample: FusedSample, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    draws = _uniforms(logits, batch.generators)
    return fused_sample(logits, batch.temperature, draws, batch.top_k, batch.top_p, batch.min_p)


def _sample_filtered(logits: torch.Tensor, batch: SamplingBatch, draws: torch.Tensor) -> torch.Tensor:
    """Tokens [B] drawn from the distribution _filtered_probs gives each row. Rows without
    a filter draw in vocabulary order, as the fused kernel's do, so a seeded row
    draws the same whatever its neighbours ask for; filtered rows draw by rank among their
    kept tokens."""
    filtered = _filtered_rows(batch, logits)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    plain = ~filtered
    if plain.any():
        tokens[plain] = _inverse_cdf(logits[plain].softmax(dim=-1), draws[plain])
    rows = filtered.nonzero()[:, 0]
    probs = (logits if len(rows) == logits.shape[0] else logits[rows]).softmax(dim=-1)
    for k in CANDIDATES:
        if len(rows) == 0:
            return tokens
        top_probs, ids = probs.topk(min(k, logits.shape[-1]), dim=-1)
        weights, covered = _kept(top_probs, _batch_rows(batch, rows), logits.shape[-1])
        ranks = _inverse_cdf(weights, draws[rows]).clamp_max_((weights > 0).sum(dim=-1) - 1)
        tokens[rows[covered]] = ids.gather(1, ranks[:, None])[covered, 0]
        rows, probs = rows[~covered], probs[~covered]
    if len(rows):
        probs = _filtered_probs(logits[rows], _batch_rows(batch, rows))
        tokens[rows] = _inverse_cdf(probs, draws[rows])
    return tokens


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V]: each row's distribution after its filters, normalised and whole, as
    verification needs it: from the row's candidates where they hold its kept tokens, else
    by sorting its vocabulary (_filtered_probs)."""
    probs = logits.softmax(dim=-1)
    vocab_size = logits.shape[-1]
    rows = _filtered_rows(batch, logits).nonzero()[:, 0]
    for k in CANDIDATES:
        if len(rows) == 0:
            return probs
        top_probs, ids = probs[rows].topk(min(k, vocab_size), dim=-1)
        weights, covered = _kept(top_probs, _batch_rows(batch, rows), vocab_size)
        weights = weights[covered] / weights[covered].sum(dim=-1, keepdim=True)
        probs[rows[covered]] = (
            torch.zeros_like(weights[:, :1]).expand(-1, vocab_size).scatter(1, ids[covered], weights)
        )
        rows = rows[~covered]
    if len(rows):
        kept = _filtered_probs(logits[rows], _batch_rows(batch, rows))
        probs[rows] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


def _filtered_rows(batch: SamplingBatch, logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows whose top-k, top-p or min-p removes anything."""
    vocab_size = logits.shape[-1]
    filtered = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if batch.top_k is not None:
        filtered |= batch.top_k < vocab_size
    if batch.top_p is not None:
        filtered |= batch.top_p < 1
    if batch.min_p is not None:
        filtered |= batch.min_p > 0
    return filtered


def _batch_rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The filters of some rows (what _kept and _filtered_probs read)."""

    def pick(column: torch.Tensor | None) -> torch.Tensor | None:
        return None if column is None else column[rows]

    return replace(batch, top_k=pick(batch.top_k), top_p=pick(batch.top_p), min_p=pick(batch.min_p))


def _kept(
    top_probs: torch.Tensor, batch: SamplingBatch, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_probs: [B, k], each row's k largest probabilities, by rank. Returns them where
    the filters keep them (0 where not), and [B] whether the row keeps no token beyond
    them (then these weights, normalised, are _filtered_probs' row).

    The kept tokens are a prefix by rank. A token past the k-th is dropped when the row's
    top_k is at most k, when the k candidates already hold top_p of the mass (every later
    token's mass before it is at least that), or when the k-th candidate is already below
    min_p of the top token (every later one is at most as likely)."""
    rows, k = top_probs.shape
    keep = torch.ones_like(top_probs, dtype=torch.bool)
    covered = torch.full((rows,), k == vocab_size, dtype=torch.bool, device=top_probs.device)
    if batch.top_k is not None:
        keep &= torch.arange(k, device=top_probs.device)[None, :] < batch.top_k[:, None]
        covered |= batch.top_k <= k
    if batch.top_p is not None:
        mass = top_probs.cumsum(dim=-1)
        keep &= mass - top_probs < batch.top_p[:, None]
        covered |= mass[:, -1] >= batch.top_p
    if batch.min_p is not None:
        threshold = batch.min_p * top_probs[:, 0]
        keep &= top_probs >= threshold[:, None]
        covered |= top_probs[:, -1] < threshold
    return top_probs.masked_fill(~keep, 0.0), covered


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


def _uniforms(like: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """[B, 1] draws in [0, 1); seeded rows from their own generator."""
    draws = torch.rand(like.shape[0], 1, device=like.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            draws[row] = torch.rand(1, generator=generator, device=like.device)
    return draws


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds draw x total: a token with
    probability 0 adds nothing to the sum, so it is never the first to exceed it."""
    cdf = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True)[:, 0]
    return tokens.clamp_max_(probs.shape[-1] - 1)  # float rounding at the very top
