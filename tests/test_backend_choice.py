"""Which attention backend runs, its block size, and KV sizing arithmetic: plain functions
of (device, dtype, installed packages), so every case runs on CPU."""

import logging

import pytest
import torch

from replica.attention import load_backend
from replica.attention.select import choose_backend, effective_block_size
from replica.config import EngineConfig
from replica.cuda_graphs import bucket_for, graph_batch_sizes, pad_decode_batch
from replica.kv_sizing import kv_blocks_for_gpu

ALL = frozenset({"triton", "flash_attn", "cpu"})
NONE = frozenset()
BF16, FP32 = torch.bfloat16, torch.float32
GiB = 2**30


@pytest.mark.parametrize(
    ("device", "dtype", "installed", "expected"),
    [
        ("cuda", BF16, ALL, "flash_attn"),
        ("cuda", BF16, frozenset({"triton"}), "triton"),
        ("cuda", BF16, frozenset({"flash_attn"}), "flash_attn"),
        ("cuda", BF16, NONE, "torch"),
        ("cuda", FP32, ALL, "triton"),  # flash-attn has no fp32 kernels
        ("cuda", FP32, frozenset({"flash_attn"}), "torch"),
        ("cpu", BF16, ALL, "cpu"),
        ("cpu", FP32, ALL, "cpu"),
        ("cpu", torch.float16, ALL, "torch"),  # the C kernels take fp32 and bf16 only
        ("cpu", FP32, NONE, "torch"),  # no C compiler: the kernels did not build
    ],
)
def test_auto_prefers_the_fastest_backend_that_runs(device, dtype, installed, expected):
    assert choose_backend("auto", device, dtype, installed) == expected


def test_explicit_choice_overrides_auto():
    assert choose_backend("torch", "cuda", BF16, ALL) == "torch"
    assert choose_backend("triton", "cuda", BF16, ALL) == "triton"
    assert choose_backend("flash_attn", "cuda", torch.float16, ALL) == "flash_attn"
    assert choose_backend("triton", "cpu", FP32, ALL, interpret=True) == "triton"


@pytest.mark.parametrize(
    ("name", "device", "dtype", "installed", "reason"),
    [
        ("flash_attn", "cuda", BF16, NONE, "'flash_attn' package is not installed"),
        ("triton", "cuda", BF16, NONE, "'triton' package is not installed"),
        ("flash_attn", "cpu", BF16, ALL, "only on CUDA"),
        ("flash_attn", "cuda", FP32, ALL, "only float16 and bfloat16"),
        ("triton", "cpu", FP32, ALL, "need a CUDA device"),
        ("cpu", "cuda", BF16, ALL, "only on the CPU"),
        ("cpu", "cpu", torch.float16, ALL, "only float32 and bfloat16"),
        ("cpu", "cpu", FP32, NONE, "could not be built"),
    ],
)
def test_unavailable_backend_says_why(name, device, dtype, installed, reason):
    with pytest.raises(ValueError, match=reason):
        choose_backend(name, device, dtype, installed)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        choose_backend("xformers", "cuda", BF16, ALL)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="xformers")


def test_auto_is_the_default_and_picks_the_c_kernels_on_cpu():
    config = EngineConfig()
    assert config.attention_backend == "auto"
    assert choose_backend(config.attention_backend, "cpu", BF16, ALL) == "cpu"


def test_flash_attn_picks_block_size_256_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="replica.attention.select"):
        assert effective_block_size("flash_attn", 16) == 256
    assert "block_size=256 instead of 16" in caplog.text
    assert effective_block_size("flash_attn", 512) == 512
    assert effective_block_size("triton", 16) == 16
    assert effective_block_size("torch", 4) == 4


def test_backends_declare_layout_and_graph_safety():
    torch_backend = load_backend("torch")
    assert torch_backend.kv_cache_shape(10, 16, 2, 64) == (10, 2, 16, 64)
    assert not torch_backend.graph_safe  # its decode mask comes from host lists
    from replica.attention.flash_attn_backend import kv_cache_shape

    assert kv_cache_shape(10, 256, 2, 64) == (10, 256, 2, 64)


def test_kv_blocks_fill_the_utilization_share():
    per_block = 2 * GiB // 1024  # 2 MiB
    # 80 GiB device, 90 %: 72 GiB; weights + peak step + context use 6 GiB; one scratch block.
    blocks = kv_blocks_for_gpu(80 * GiB, 0.9, 6 * GiB, per_block)
    assert blocks == (72 * GiB - 6 * GiB) // per_block - 1
    assert blocks * per_block + 6 * GiB <= 72 * GiB
    # Rounding: a budget that is not a multiple of the block size rounds down.
    assert kv_blocks_for_gpu(10 * per_block + 5, 1.0, 0, per_block) == 9


def test_kv_blocks_refuse_when_the_model_leaves_no_room():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        kv_blocks_for_gpu(16 * GiB, 0.5, 8 * GiB, 2**20)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_graph_buckets():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 32, 33, 48, 49)] == [1, 4, 8, 32, 48, 48, None]


def test_pad_rows_point_at_the_scratch_block():
    block_size, scratch = 4, 99
    rows, tables = pad_decode_batch(
        token_ids=[11, 12, 13],
        context_lens=[5, 1, 9],
        block_tables=[[3, 7], [4], [5, 6, 8]],
        bucket=4,
        block_size=block_size,
        scratch_block=scratch,
        lora_slots=[-1, 1, 0],
    )
    assert rows.tolist() == [
        [11, 4, 7 * 4 + 0, 5, -1],  # position 4 is slot 0 of the second block; no adapter
        [12, 0, 4 * 4 + 0, 1, 1],  # LoRA slot 1
        [13, 8, 8 * 4 + 0, 9, 0],
        [0, 0, scratch * 4, 1, -1],  # pad: token 0 at position 0, attends to one scratch slot
    ]
    assert tables.dtype == torch.int32
    assert tables.tolist() == [[3, 7, scratch], [4, scratch, scratch], [5, 6, 8], [scratch] * 3]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_batch([1, 2], [1, 1], [[0], [1]], 1, block_size, scratch)
