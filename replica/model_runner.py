"""Device work for one step: load the model, own the paged KV cache, pack the scheduled
tokens into one 1 x T forward, and return logits only for the rows that sample."""

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from replica.attention import (
    ForwardContext,
    build_metadata,
    forward_context,
    kv_cache_shape,
    register_backend,
)
from replica.config import EngineConfig
from replica.model_loader import ModelNotFoundError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == "auto" else _DTYPES[dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        self.block_size = config.block_size
        attn_impl = register_backend(config.attention_backend)
        transformers_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation=attn_impl
            )
        except ValueError as e:
            raise ModelNotFoundError(f"cannot load {model_path} as a causal LM: {e}") from e
        if not getattr(self.model, "_supports_attention_backend", False):
            raise ModelNotFoundError(
                f"{type(self.model).__name__} does not support custom attention backends"
            )
        self.model.to(self.device).eval()
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()

        hf = self.model.config
        self.hf_config = hf
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.vocab_size = hf.vocab_size
        self.num_blocks = config.num_kv_blocks or self._blocks_for_budget(config.kv_cache_memory_gb)
        self.kv_caches = self._allocate_kv_cache()

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def _blocks_for_budget(self, gigabytes: float) -> int:
        return max(1, int(gigabytes * 2**30) // self.bytes_per_block)

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # zeros: on CPU the pages stay unmapped until first written.
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]

    @torch.inference_mode()
    def execute(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
    ) -> torch.Tensor:
        """One packed forward. Row i feeds token_ids[i] as the last tokens of a context of
        context_lens[i]; rows must be ordered decodes first. Returns float logits
        [len(sample_rows), V] for the last token of each row in sample_rows."""
        query_lens = [len(t) for t in token_ids]
        flat = [t for row in token_ids for t in row]
        positions = [p for ctx, q in zip(context_lens, query_lens, strict=True) for p in range(ctx - q, ctx)]
        meta = build_metadata(block_tables, context_lens, query_lens, self.block_size, self.device)
        input_ids = torch.tensor([flat], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(self.kv_caches, meta)):
            hidden = self.decoder(
                input_ids=input_ids, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        if not sample_rows:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        ends = torch.tensor(query_lens).cumsum(0) - 1
        last_rows = ends[torch.tensor(sample_rows, dtype=torch.long)].to(self.device)
        return self.lm_head(hidden[0, last_rows]).float()
