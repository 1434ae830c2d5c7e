"""Which adapter a request runs with; crosses from the ingress to the replica."""

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter's name (what clients pass as `model`), an id unique
    to this registration of it, and the folder holding its PEFT files."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def block_hash_root(self) -> bytes:
        """The parent of its requests' first block hash: KV computed under one adapter is
        never another's (or the base model's), and is shared among its own requests. The
        path is part of it, so a name loaded again from other files starts afresh."""
        return hashlib.sha256(f"lora\0{self.lora_name}\0{self.lora_path}".encode()).digest()[:16]
