"""The per-step state every attention layer reads.

transformers calls our attention function from inside each decoder layer and passes
only the layer's own tensors, so the KV cache and the step's metadata travel through
this module-level slot, set by the model runner around each forward pass.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from replica.attention.metadata import AttentionMetadata
from replica.kv_quant import UNIT_SCALE, KVScale
from replica.lora.batch import LoRABatch


@dataclass
class ForwardContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), layout set by the backend
    metadata: AttentionMetadata
    lora: LoRABatch | None = None  # which adapter each packed token uses (replica/lora/)
    # Per layer, what an fp8 cache's keys and values are divided by (replica/kv_quant.py);
    # None: every layer's is 1.
    kv_scales: list[KVScale] | None = None

    def kv_scale(self, layer: int) -> KVScale:
        return self.kv_scales[layer] if self.kv_scales is not None else UNIT_SCALE


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("paged attention called outside a kvserve forward pass")
    return _current
