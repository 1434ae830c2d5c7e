"""The GPU path: padded CUDA-graph decode batches, the flash-attn backend's plumbing, and
KV sizing. The padded path runs eagerly on CPU with the torch backend and with the Triton
kernels under TRITON_INTERPRET=1 (same buffers, same padding, no capture); the flash-attn
backend runs on CPU against torch stand-ins for its two kernels, written from
flash-attn's documented semantics. Tests that need real graphs, kernels or GPU memory
skip without CUDA."""

import copy
import gc
import importlib.util
import os

import torch

# conftest.py asks for the Triton interpreter on machines without CUDA; on a GPU machine
# Triton compiles for CUDA and cannot run on a CPU device.
TRITON_RUNS_ON_CPU = (
    importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
)

import pytest  # noqa: E402
from conftest import hf_greedy, save_lora_adapter  # noqa: E402
from test_attention_reference import dense_reference  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from replica.attention import ForwardContext, build_metadata, forward_context  # noqa: E402
from replica.attention import flash_attn_backend as fa  # noqa: E402
from replica.attention.torch_backend import kv_cache_shape, torch_paged_attention  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.model_runner import ModelRunner  # noqa: E402
from wire.lora_request import LoRARequest  # noqa: E402
from wire.sampling_params import StructuredOutputs  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = LlamaConfig(
    vocab_size=49152,  # the bundled tokenizer's
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def _prefill_then_decode_both_ways(runner: ModelRunner, graphs) -> None:
    """Prefill three ragged sequences, then run the same decode step eagerly and through
    the padded graph path: same logits, same real KV, pad rows only in the scratch block."""
    g = torch.Generator().manual_seed(0)
    lens, block_size = [5, 9, 3], runner.block_size
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-(n + 1) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    prompts = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in lens]
    runner.graphs = None
    runner.execute(prompts, lens, tables, sample_rows=[0, 1, 2])

    step = dict(token_ids=[[1], [2], [3]], context_lens=[n + 1 for n in lens], block_tables=tables)
    eager = runner.execute(**step, sample_rows=[0, 1, 2])
    eager_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.graphs = graphs
    padded = runner.execute(**step, sample_rows=[0, 1, 2])
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
    scratch = runner.scratch_block
    for (k, v), (k0, v0) in zip(runner.kv_caches, eager_kv, strict=True):
        torch.testing.assert_close(k[:scratch], k0[:scratch], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[:scratch], v0[:scratch], atol=1e-5, rtol=1e-5)
        assert k[scratch].abs().sum() > 0  # the pad row wrote there


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                not TRITON_RUNS_ON_CPU,
                reason="needs triton and TRITON_INTERPRET=1 set before it was imported (not so on a GPU)",
            ),
        ),
    ],
)
def test_padded_decode_matches_eager_on_cpu(tiny_model, backend):
    path, _ = tiny_model
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=32,
        max_model_len=64,
        attention_backend=backend,
    )
    runner = ModelRunner(config, path)
    assert runner.backend.name == backend
    assert runner.graphs is None  # graphs are ignored on CPU
    graphs = runner.build_graph_runner(max_batch=8)  # 3 rows pad to bucket 4
    _prefill_then_decode_both_ways(runner, graphs)
    assert not graphs.graphs  # ran eagerly, nothing captured


def test_engine_with_padded_decode_matches_hf(tiny_model, tokenizer):
    """Greedy output through the engine, with decode batches > 4 falling back to eager and
    smaller ones padded; every block comes back, the scratch block never leaves."""
    path, model = tiny_model
    prompts = [tokenizer(p).input_ids for p in ["Hi", "The sky is", "One two three four five", "x", "ab"]]
    lengths = [3, 6, 9, 12, 15]
    expected = [hf_greedy(model, p, n, set()) for p, n in zip(prompts, lengths, strict=True)]

    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=40)
    runner = llm.engine.runner
    runner.graphs = runner.build_graph_runner(max_batch=4)
    padded_steps = []
    run = runner.graphs.run
    runner.graphs.run = lambda *args: padded_steps.append(len(args[0])) or run(*args)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert set(padded_steps) == {1, 2, 3, 4}  # 5 running decodes took the eager path
    stats = llm.engine.stats()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks == 40


class _Layer(torch.nn.Module):
    layer_idx = 0


def _fake_with_kvcache(
    q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, causal=False
):
    """flash_attn_with_kvcache, paged, no new k/v: q [B, 1, H, D] attends to the first
    cache_seqlens[b] tokens of its pages."""
    assert causal and block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    out = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        keys = k_cache[block_table[b].long()].flatten(0, 1)[:n]
        values = v_cache[block_table[b].long()].flatten(0, 1)[:n]
        out.append(dense_reference(q[b], keys, values, softmax_scale))
    return torch.stack(out)


def _fake_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    block_table=None,
):
    """flash_attn_varlen_func with a block table: sequence b's queries are the last ones of
    its cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (bottom-right causal alignment)."""
    assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert qe - qs <= max_seqlen_q and n <= max_seqlen_k
        keys = k[block_table[b].long()].flatten(0, 1)[:n]
        values = v[block_table[b].long()].flatten(0, 1)[:n]
        out[qs:qe] = dense_reference(q[qs:qe], keys, values, softmax_scale)
    return out


def test_flash_attn_backend_plumbing_matches_torch(monkeypatch):
    monkeypatch.setattr(fa, "flash_attn_with_kvcache", _fake_with_kvcache)
    monkeypatch.setattr(fa, "flash_attn_varlen_func", _fake_varlen)
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, block_size = 6, 2, 16, 4
    seqs = [(5, 1), (17, 1), (0, 9), (12, 7)]  # (cached, new): decodes, fresh prefill, prefix-hit chunk
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    k_torch = torch.zeros(kv_cache_shape(num_blocks, block_size, kv_heads, d))
    v_torch = torch.zeros_like(k_torch)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, q, k_new, v_new = [], [], [], []
    for cached, new in seqs:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        k = torch.randn(cached + new, kv_heads, d, generator=g)
        v = torch.randn(cached + new, kv_heads, d, generator=g)
        for pos in range(cached):
            k_torch[table[pos // block_size], :, pos % block_size] = k[pos]
            v_torch[table[pos // block_size], :, pos % block_size] = v[pos]
        tables.append(table)
        q.append(torch.randn(new, heads, d, generator=g))
        k_new.append(k[cached:])
        v_new.append(v[cached:])
    k_flash = k_torch.transpose(1, 2).contiguous()  # [N, bs, Hkv, D]
    v_flash = v_torch.transpose(1, 2).contiguous()
    meta = build_metadata(
        tables, [c + n for c, n in seqs], [n for _, n in seqs], block_size, torch.device("cpu")
    )
    args = [torch.cat(x).transpose(0, 1)[None] for x in (q, k_new, v_new)]

    outs = []
    for attention, caches in (
        (torch_paged_attention, (k_torch, v_torch)),
        (fa.flash_attn_paged_attention, (k_flash, v_flash)),
    ):
        with forward_context(ForwardContext([caches], meta)):
            outs.append(attention(_Layer(), *args, None, scaling=d**-0.5)[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_flash.transpose(1, 2), k_torch)
    torch.testing.assert_close(v_flash.transpose(1, 2), v_torch)


@needs_cuda
def test_engine_auto_backend_with_graphs_matches_hf_on_cuda(tiny_model, tokenizer):
    path, model = tiny_model
    prompts = [tokenizer(p).input_ids for p in ["Hi", "The sky is", "One two three four five", "x", "ab"]]
    expected = [hf_greedy(model, p, 12, set()) for p in prompts]
    llm = LLM(str(path), dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=256)
    runner = llm.engine.runner
    assert runner.backend.name != "torch", "auto should pick a kernel backend on CUDA"
    assert runner.graphs is not None and runner.graphs.graphs  # captured at startup
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    stats = llm.engine.stats()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks


@needs_cuda
def test_graph_replay_matches_eager_on_cuda(tiny_model):
    path, _ = tiny_model
    config = EngineConfig(
        model=str(path), dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=256
    )
    runner = ModelRunner(config, path)
    graphs = runner.graphs
    assert graphs is not None and 4 in graphs.graphs
    _prefill_then_decode_both_ways(runner, graphs)


@needs_cuda
def test_kv_cache_fills_gpu_memory_sensibly(tiny_model):
    path, _ = tiny_model
    gc.collect()  # engines of earlier tests, their caches and graph pools
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    utilization = 0.5
    config = EngineConfig(
        model=str(path), device="cuda", gpu_memory_utilization=utilization, enable_cuda_graphs=False
    )
    runner = ModelRunner(config, path)
    free_after, _ = torch.cuda.mem_get_info()
    kv_bytes = (runner.num_blocks + 1) * runner.bytes_per_block
    allowed = total * utilization - (total - free_before)  # what was left of the share before loading
    assert total - free_after <= total * utilization  # never past the share
    assert kv_bytes >= 0.9 * allowed  # a tiny model leaves nearly all of it to the KV cache
    del runner
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(),
                reason="CI runs the CPU variant; on a GPU machine the device check's minutes go to CUDA",
            ),
        ),
        pytest.param("cuda", marks=needs_cuda),
    ],
)
def test_async_scheduling_matches_sync_with_sampling_penalties_and_a_grammar(tiny_model, device):
    """Async scheduling (on by default on CUDA, forced here on CPU) against the synchronous
    engine, on one batch mixing greedy, seeded sampling, penalties, logprobs, logit bias and
    a grammar (whose mask needs the previous token, so its steps run synchronously): the
    same tokens, text and finish reasons, and every block back."""
    path, _ = tiny_model
    prompts = ["Hi", "The sky is", "One two three four five", "x", "Answer yes or no:"]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            logprobs=2,
            ignore_eos=True,
        ),
        SamplingParams(
            max_tokens=12, temperature=1.0, top_k=5, seed=11, frequency_penalty=0.4, logit_bias={5: 3.0}
        ),
        SamplingParams(
            max_tokens=12, temperature=0, structured_outputs=StructuredOutputs(choice=["yes", "no"])
        ),
    ]
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(
            str(path),
            dtype="float32",
            device=device,
            num_kv_blocks=64,
            max_model_len=256,
            async_scheduling=async_scheduling,
        )
        assert llm.engine.async_scheduling is async_scheduling
        outputs.append(
            [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        stats = llm.engine.stats()
        assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
    assert outputs[1] == outputs[0]
    assert [len(tokens) for tokens, _, _ in outputs[0][:3]] == [12, 12, 12]
    assert outputs[0][4][1] in ("yes", "no") and outputs[0][4][2] == "stop"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_lora_batch_matches_peft(tiny_model, tmp_path, tokenizer, device):
    """LoRA on the device's path (on CUDA: the Triton BGMV kernels, async scheduling,
    decode steps as CUDA graphs with each row's adapter slot; on CPU the same padded path
    eagerly): one batch mixing two adapters and the base model gives HF + PEFT's greedy
    tokens (fp32, PEFT on CPU)."""
    from peft import PeftModel

    path, _ = tiny_model
    loras = []
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i, rank in enumerate((8, 4)):
        base = save_lora_adapter(base, tmp_path / str(i), rank, seed=i)
        loras.append(LoRARequest(f"adapter-{i}", i + 1, str(tmp_path / str(i))))
    prompts = [tokenizer(p).input_ids for p in ["Hi", "The sky is", "One two three four five", "x", "ab"]]
    row_loras = [loras[0], loras[1], None, loras[1], None]

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), loras[0].lora_path, adapter_name="0"
    )
    model.load_adapter(loras[1].lora_path, adapter_name="1")
    expected = []
    for prompt, lora in zip(prompts, row_loras, strict=True):
        if lora is None:
            with model.disable_adapter():
                expected.append(hf_greedy(model, prompt, 12, set()))
        else:
            model.set_adapter(str(lora.lora_int_id - 1))
            expected.append(hf_greedy(model, prompt, 12, set()))
    assert expected[1] != hf_greedy(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), prompts[1], 12, set()
    )

    llm = LLM(
        str(path),
        dtype="float32",
        device=device,
        num_kv_blocks=64,
        max_model_len=256,
        enable_lora=True,
        max_loras=2,
    )
    runner = llm.engine.runner
    if device == "cpu":  # the padded graph path, run eagerly, as CUDA replays it
        runner.graphs = runner.build_graph_runner(max_batch=8)
    padded = []
    run = runner.graphs.run
    runner.graphs.run = lambda *args: padded.append(args[-1]) or run(*args)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=row_loras)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [0, 1, -1, 1, -1] in padded, "decode steps with adapter rows ran the graph path"
    stats = llm.engine.stats()
    assert stats.kv.num_free_blocks == stats.kv.num_total_blocks


@needs_cuda
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_matches_plain_decoding_on_cuda(tiny_model, tokenizer, method, tmp_path):
    """Verification steps run eagerly beside graph-replayed decode steps of the requests
    that opt out, and async scheduling pauses while a step may speculate: greedy output
    equals the engine's without speculation, and every block comes back. The draft model
    is the target itself, so every proposed token is accepted. The n-gram run's model
    has all but 8 rows of lm_head zeroed: its greedy output draws on at most 9 tokens, so
    its last token recurs within 10 steps and a 1-gram lookup must propose, where a
    random model's unrepeating output would never be proposed for."""
    path, model = tiny_model
    if method == "ngram":
        path = tmp_path / "few-token-llama"
        few_token = copy.deepcopy(model)
        with torch.no_grad():
            few_token.lm_head.weight[8:] = 0
        few_token.save_pretrained(path)
        tokenizer.save_pretrained(path)
    prompts = ["one two three one two three one two", "Hi", "a b c d a b c d a b", "x y x y x"]
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative=i != 1)
        for i in range(len(prompts))
    ]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        spec["model"] = str(path)
    outputs = []
    for speculative_config in (None, spec):
        llm = LLM(
            str(path),
            dtype="float32",
            device="cuda",
            num_kv_blocks=64,
            max_model_len=256,
            speculative_config=speculative_config,
        )
        outputs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        stats = llm.engine.stats()
        assert stats.kv.num_free_blocks == stats.kv.num_total_blocks
    assert outputs[1] == outputs[0]
    assert stats.spec_decode.num_drafts > 0
    if method == "draft_model":
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
