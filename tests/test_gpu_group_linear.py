"""Group-quantized linears on the GPU path (replica/gpu/group_linear.py): on a GPU, or on
CPU through the same code with the Triton kernel under TRITON_INTERPRET=1.

- The Triton kernel against the dequantized weight's product, every format kvserve keeps
  (4-bit with mins, 8-bit with and without), odd shapes, fp32 and bf16.
- 4-bit GPTQ and AWQ checkpoints load as GroupLinears (no dense weight kept), through the
  fused decoder and through transformers' modules, and the engine's greedy tokens in fp32
  equal HF `generate` on the weights it holds, with the Triton kernel and with the
  dequantizing candidate.
- On CUDA only: every candidate (Triton, torch's int4 GEMM, dequantize then cuBLAS) is
  timed at every bucket and agrees with the reference where it runs.
"""

import pytest
import torch
from conftest import hf_greedy, triton_device

DEVICE = triton_device()

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from bench.packed_checkpoint import PROJECTIONS, save_packed  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from replica.cpu.group_quant import quantize  # noqa: E402
from replica.cpu.layers import GroupQuantEmbedding  # noqa: E402
from replica.gpu import group_gemm  # noqa: E402
from replica.gpu.decoder import GPUFusedDecoder  # noqa: E402
from replica.gpu.group_linear import (  # noqa: E402
    DEQUANTIZED,
    TINYGEMM,
    TRITON,
    GroupLinear,
    group_linears,
    move_embeddings,
    time_group_linear,
)
from replica.weights_summary import WeightsSummary  # noqa: E402

CONFIG = LlamaConfig(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
)  # fmt: skip
GROUP = 32


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(["q4g32m", "q4g64m", "q4g128m", "q8g16", "q8g32", "q8g32m"]),
    rows=st.integers(1, 40),
    n=st.integers(1, 70),
    groups=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_the_dequantized_product(fmt, rows, n, groups, dtype, with_bias, seed):
    torch.manual_seed(seed)
    group = int(fmt.split("g")[1].rstrip("m"))
    k = group * groups * (2 if group == 16 else 1)  # 8-bit groups of 16 in pairs: k in 32s
    w = quantize(torch.randn(n, k), fmt)
    w = type(w)(*(None if t is None else t.to(DEVICE) for t in (w.qs, w.scales, w.mins)), w.bits, w.group)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    ours = group_gemm.group_gemm(x, w, bias)
    reference = group_gemm.mm_dequantized(x.float(), w, None if bias is None else bias.float())
    assert ours.dtype == dtype and ours.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    else:  # the weight and x rounded to bf16 (the interpreter's casts truncate), then y
        scale = reference.abs().amax().item() + 1
        assert (ours.float() - reference).abs().max().item() <= 0.03 * scale


@pytest.fixture(scope="module", params=[("gptq", True), ("awq", False)], ids=["gptq-sym", "awq-asym"])
def checkpoint(request, tmp_path_factory, tokenizer):
    method, symmetric = request.param
    directory = tmp_path_factory.mktemp(method) / "checkpoint"
    torch.manual_seed(0)
    save_packed(
        AutoModelForCausalLM.from_config(CONFIG).eval(), method, directory, tokenizer, symmetric, GROUP
    )
    return method, directory


def _held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 weights the engine's GroupLinears hold, by projection of transformers' model
    (the fused decoder's packed q/k/v and gate/up split again)."""
    decoder = getattr(model, model.base_model_prefix)
    out = {}
    for layer in range(CONFIG.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        if isinstance(decoder, GPUFusedDecoder):
            attention, mlp = decoder.attentions[layer], decoder.mlps[layer]
            q, k, v = attention.qkv.weight_blocks.dequantize().split(
                [attention.num_heads * attention.head_dim, *[attention.num_kv_heads * attention.head_dim] * 2]
            )
            gate, up = mlp.gate_up.weight_blocks.dequantize().chunk(2)
            held = (
                q,
                k,
                v,
                attention.o_proj.weight_blocks.dequantize(),
                gate,
                up,
                mlp.down.weight_blocks.dequantize(),
            )
        else:
            held = tuple(
                decoder.layers[layer].get_submodule(p).weight_blocks.dequantize() for p in PROJECTIONS
            )
        for projection, w in zip(PROJECTIONS, held, strict=True):
            out[f"{prefix}.{projection}"] = w.cpu()
    return out


@pytest.mark.parametrize("gpu_decoder", ["fused", "transformers"])
def test_a_4_bit_checkpoint_runs_its_integers(checkpoint, gpu_decoder):
    method, directory = checkpoint
    if method == "awq" and gpu_decoder == "transformers":
        pytest.skip("the same GroupLinears as GPTQ's through transformers' modules; AWQ's zeros run fused")
    llm = LLM(
        str(directory), dtype="float32", device=DEVICE, attention_backend="triton", gpu_decoder=gpu_decoder,
        block_size=4, num_kv_blocks=32, max_num_batched_tokens=8,  # prompts in chunks, beside decodes
    )  # fmt: skip
    model = llm.engine.runner.model
    assert llm.engine.runner.weights.quantization == method
    linears = [m for m in model.modules() if isinstance(m, GroupLinear)]
    per_layer = 4 if gpu_decoder == "fused" else 7  # q/k/v and gate/up packed, or not
    assert len(linears) == per_layer * CONFIG.num_hidden_layers
    assert all(m.qs.device.type == DEVICE for m in linears)
    dense = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert dense == ["lm_head"]  # the checkpoint's, tied to the embeddings; no dense copies
    head = model.get_output_embeddings().weight
    integers = sum(m.weight_blocks.nbytes() for m in linears)
    assert llm.engine.runner.weights.linear_bytes == integers + head.numel() * head.element_size()
    held = _held(model)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIG).eval()  # the same seed: the same embeddings
    with torch.no_grad():
        for name, w in held.items():
            hf.get_submodule(name).weight.copy_(w)
    prompts = [llm.engine.tokenizer.encode(p) for p in ("The weather today is", "Once upon a time, in a")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [hf_greedy(hf, prompt, 8, set()) for prompt in prompts]
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)] == expected
    # The dequantize-then-matmul candidate, where chosen, runs the same model.
    for m in linears:
        assert m.choice.kernel_for(1) == TRITON  # nothing timed here: the default
        m.choice = type(m.choice).forced(DEQUANTIZED)
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_gguf_embeddings_share_a_tied_lm_heads_integers():
    """A GGUF's token embeddings and its tied lm_head hold one copy of their blocks on the
    device, counted once."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG).eval()
    blocks = quantize(model.get_input_embeddings().weight.detach(), "q8g32")
    model.set_input_embeddings(GroupQuantEmbedding(blocks, torch.float32))
    model.get_output_embeddings().group_weight = blocks
    assert group_linears(model) == 1
    model.to(DEVICE)
    move_embeddings(model, torch.device(DEVICE))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(head, GroupLinear) and embed.weight_blocks.qs.data_ptr() == head.qs.data_ptr()
    ids = torch.tensor([[0, 7, 49151]], device=DEVICE)
    torch.testing.assert_close(embed(ids)[0].cpu(), blocks.dequantize()[[0, 7, 49151]])
    summary = WeightsSummary.of(model, "gguf")
    dense = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # the layers' own
    dense_bytes = sum(w.numel() * w.element_size() for w in dense)
    assert summary.linear_bytes == blocks.nbytes() + dense_bytes
    norms = sum(p.numel() * p.element_size() for p in model.parameters()) - dense_bytes
    assert summary.other_bytes == norms  # the embeddings' blocks are the lm_head's


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA only: the candidates are timed with CUDA events")
def test_every_candidate_is_timed_at_every_bucket_on_a_gpu(checkpoint):
    _, directory = checkpoint
    llm = LLM(str(directory), dtype="bfloat16", device="cuda", num_kv_blocks=64, max_num_batched_tokens=512)
    timings = llm.engine.runner.group_timings
    assert timings is not None and timings["buckets"][-1] == 512
    assert len(timings["shapes"]) == 4  # q/k/v, o, gate/up, down
    for shape, seconds in timings["shapes"].items():
        for candidate in (TRITON, DEQUANTIZED):
            assert len(seconds[candidate]) == len(timings["buckets"]), shape
            assert all(0 < s < float("inf") for s in seconds[candidate]), (shape, candidate, seconds)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA only: torch's int4 GEMM runs on CUDA")
def test_torch_int4_gemm_agrees_where_it_takes_the_format():
    """torch's packing and scales as group_gemm.pack_tinygemm gives them: a wrong nibble
    order or zero would read every weight wrongly, and the chooser would never run it."""
    torch.manual_seed(0)
    w = quantize(torch.randn(256, 512) * 0.05, "q4g64m")
    m = GroupLinear(w, None).cuda()
    assert group_gemm.tinygemm_runs(m.weight_blocks, torch.bfloat16, torch.device("cuda"))
    seconds = time_group_linear(m, (1, 8, 64), torch.bfloat16)
    assert all(0 < s < float("inf") for s in seconds[TINYGEMM]), seconds
