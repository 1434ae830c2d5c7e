"""Megatron-style sharding of a loaded transformers model, in place, for one rank.

- Attention: q, k and v keep this rank's heads (column split), o_proj its matching
  input columns (row split), followed by an all-reduce.
- MLP: gate and up keep a share of the intermediate columns, down the matching rows,
  followed by an all-reduce.
- Embedding and lm_head keep a share of the vocabulary; the embedding all-reduces its
  rows, lm_head gathers the logits on rank 0.

Heads are split by whole KV groups, so every rank keeps the plain GQA layout that the
attention kernels expect. With fewer KV heads than ranks, each KV head is replicated on
the ranks that share its query heads. Shares need not be equal: SmolLM2-135M's 3 KV
groups go 2 + 1 over 2 ranks.
"""

from dataclasses import dataclass

import torch
from torch import nn

from replica.parallel.group import TPGroup


class ShardingError(ValueError):
    pass


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads: query heads [q_start, q_start + num_q), KV heads likewise."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def even_sizes(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def split_heads(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadShard]:
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        shards, kv_start = [], 0
        for num_kv in even_sizes(num_kv_heads, world_size):
            shards.append(HeadShard(kv_start * group, num_kv * group, kv_start, num_kv))
            kv_start += num_kv
        return shards
    ranks_per_kv = world_size // num_kv_heads
    if world_size % num_kv_heads or group % ranks_per_kv:
        raise ShardingError(
            f"cannot split {num_heads} attention heads with {num_kv_heads} KV heads over "
            f"tensor_parallel_size={world_size}: with fewer KV heads than ranks, the size must be a "
            f"multiple of the KV heads ({num_kv_heads}) that divides the heads ({num_heads})"
        )
    num_q = group // ranks_per_kv
    return [HeadShard(rank * num_q, num_q, rank // ranks_per_kv, 1) for rank in range(world_size)]


def num_kv_heads(config) -> int:
    """The model's KV heads (configs without GQA leave the count out)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def check_shardable(config, world_size: int) -> list[HeadShard]:
    """Each rank's heads; raises ShardingError, naming the numbers, where `config`'s
    model cannot be split."""
    shards = split_heads(config.num_attention_heads, num_kv_heads(config), world_size)
    if config.intermediate_size < world_size or config.vocab_size < world_size:
        raise ShardingError(f"the model is too small for tensor_parallel_size={world_size}")
    return shards


class RowParallelLinear(nn.Linear):
    """This rank's input columns; the partial outputs are summed over ranks. The bias
    lives on rank 0 only, so that it is added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary; ids outside them look up zeros, and the
    sum over ranks is the full lookup."""

    def __init__(self, weight: torch.Tensor, start: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Module):
    """This rank's vocabulary slice of lm_head; logits are gathered on rank 0, the only
    rank that samples. Every slice has the same size (the last is padded with zero
    rows), as the gather needs; the padding's logits are cut off."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: TPGroup):
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [..., vocab] on rank 0; None elsewhere."""
        logits = self.group.gather(self.linear(hidden))
        return None if logits is None else logits[..., : self.vocab_size]


def _rows(weight: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return weight.detach()[start : start + size].clone()


def _columns(weight: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return weight.detach()[:, start : start + size].clone()


def _shard_column_linear(linear: nn.Linear, start: int, size: int) -> None:
    linear.weight = nn.Parameter(_rows(linear.weight, start, size), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias, start, size), requires_grad=False)
    linear.out_features = size


def _row_linear(linear: nn.Linear, start: int, size: int, group: TPGroup) -> RowParallelLinear:
    bias = linear.bias.detach().clone() if linear.bias is not None and group.rank == 0 else None
    return RowParallelLinear(_columns(linear.weight, start, size), bias, group)


def _shard_attention(attn: nn.Module, shard: HeadShard, group: TPGroup) -> None:
    head_dim = attn.head_dim
    _shard_column_linear(attn.q_proj, shard.q_start * head_dim, shard.num_q * head_dim)
    _shard_column_linear(attn.k_proj, shard.kv_start * head_dim, shard.num_kv * head_dim)
    _shard_column_linear(attn.v_proj, shard.kv_start * head_dim, shard.num_kv * head_dim)
    attn.o_proj = _row_linear(attn.o_proj, shard.q_start * head_dim, shard.num_q * head_dim, group)
    attn.num_key_value_groups = shard.num_q // shard.num_kv


def _shard_mlp(mlp: nn.Module, group: TPGroup) -> None:
    sizes = even_sizes(mlp.gate_proj.out_features, group.world_size)
    start, size = sum(sizes[: group.rank]), sizes[group.rank]
    _shard_column_linear(mlp.gate_proj, start, size)
    _shard_column_linear(mlp.up_proj, start, size)
    mlp.down_proj = _row_linear(mlp.down_proj, start, size, group)


def shard_model(model: nn.Module, group: TPGroup) -> HeadShard:
    """Keep only `group.rank`'s share of `model`'s weights. Returns its heads (the
    paged KV cache of this rank holds only its KV heads)."""
    config = model.config
    shard = check_shardable(config, group.world_size)[group.rank]
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    attention_parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp_parts = ("gate_proj", "up_proj", "down_proj")
    if layers is None or not all(
        all(isinstance(getattr(layer.self_attn, p, None), nn.Linear) for p in attention_parts)
        and all(isinstance(getattr(layer.mlp, p, None), nn.Linear) for p in mlp_parts)
        for layer in layers
    ):
        raise ShardingError(
            f"tensor parallelism supports decoders of q/k/v/o attention and gate/up/down MLPs "
            f"(the Llama family: Llama, Mistral, Qwen2, Qwen3); {type(model).__name__} is not one"
        )
    for layer in layers:
        _shard_attention(layer.self_attn, shard, group)
        _shard_mlp(layer.mlp, group)

    vocab_size = config.vocab_size
    per_rank = -(-vocab_size // group.world_size)  # equal slices; the last one padded
    start = per_rank * group.rank
    embedding = decoder.embed_tokens.weight.detach()
    decoder.embed_tokens = VocabParallelEmbedding(_rows(embedding, start, per_rank), start, group)
    head_weight = _rows(model.get_output_embeddings().weight, start, per_rank)
    if head_weight.shape[0] < per_rank:
        padding = head_weight.new_zeros(per_rank - head_weight.shape[0], head_weight.shape[1])
        head_weight = torch.cat([head_weight, padding])
    head = ParallelLMHead(head_weight, vocab_size, group)
    name = next(n for n, m in model.named_children() if m is model.get_output_embeddings())
    setattr(model, name, head)
    return shard
