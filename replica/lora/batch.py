"""Which adapter slot each packed token of a step uses: set by the model runner in the
forward context (replica/attention/context.py), read by every LoRALinear."""

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] long: each packed token's slot, -1 for the base model

    def select(self, rows: torch.Tensor) -> "LoRABatch":
        """The slots of the packed rows a decoder keeps for its last layer's MLP."""
        return LoRABatch(self.token_slots[rows])
