"""What a proposer hands the engine for one request."""

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    token_ids: list[int]  # may be empty: nothing to propose
    # [len(token_ids), V] float32: the distribution q each token was drawn from; None for a
    # point mass (n-gram lookups, and greedy requests' drafts), which verification reads as
    # q(token) = 1.
    probs: torch.Tensor | None = None
