"""The oracle for LoRA adapters: greedy output in fp32 equals HF + PEFT's `generate`
(the adapter active, unmerged) token for token, for one batch that mixes four adapters
(ranks 8 and 16, on every attention and MLP projection) and the base model, with
chunked prefill and preemption, on dense weights and on the bundled GGUF's own 4-bit
blocks; and the engine's own handling of adapters."""

import pytest
import torch
from conftest import hf_greedy, save_lora_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from replica.cpu import group_quant, linear_kernels
from replica.cpu.group_quant import GroupQuantWeight
from replica.lora.adapter_files import LoRAAdapterError
from replica.model_loader import bundled_gguf_path
from wire.lora_request import LoRARequest

ADAPTERS = {"a": 8, "b": 16, "c": 8, "d": 16}  # name -> rank
PROMPTS = [  # two per adapter, then two for the base model
    ("a", "The capital of France is"),
    ("a", "Once upon a time, in a land far away, there lived a wise old owl who"),
    ("b", "def fibonacci(n):"),
    ("b", "List the three primary colors of light, and explain why they are called primary:"),
    ("c", "Translate to French: I would like a cup of coffee, please."),
    ("c", "The quick brown fox jumps over the lazy dog. What did the fox do next?"),
    ("d", "Write a haiku about autumn leaves falling in the quiet evening"),
    ("d", "Hi"),
    (None, "The capital of France is"),
    (None, "In the beginning of the twentieth century, physics changed forever when"),
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    loras = {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        model = save_lora_adapter(model, root / name, rank, seed=i)
        loras[name] = LoRARequest(name, i + 1, str(root / name))
    return loras


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for _, p in PROMPTS]


@pytest.fixture(scope="module")
def expected(model_path, adapters, prompt_ids, tokenizer) -> list[list[int]]:
    """HF + PEFT, one prompt at a time, with its adapter set (or all disabled)."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model = None
    for name, lora in adapters.items():
        if model is None:
            model = PeftModel.from_pretrained(base, lora.lora_path, adapter_name=name)
        else:
            model.load_adapter(lora.lora_path, adapter_name=name)
    model.eval()
    eos = {tokenizer.eos_token_id}
    out = []
    for (name, _), ids in zip(PROMPTS, prompt_ids, strict=True):
        if name is None:
            with model.disable_adapter():
                out.append(hf_greedy(model, ids, MAX_NEW, eos))
        else:
            model.set_adapter(name)
            out.append(hf_greedy(model, ids, MAX_NEW, eos))
    return out


def _generate(llm: LLM, prompt_ids, adapters):
    loras = [adapters[name] if name else None for name, _ in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "attention_backend, max_loras",
    [
        ("cpu", 4),  # the fused CPU decoder: q/k/v and gate/up adapters on one GEMM each
        ("torch", 2),  # transformers' modules; two slots for four adapters: requests wait
    ],
)
def test_mixed_batch_matches_peft(model_path, adapters, prompt_ids, expected, attention_backend, max_loras):
    llm = LLM(
        str(model_path),
        dtype="float32",
        attention_backend=attention_backend,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras,
        max_num_batched_tokens=16,  # chunked prefill: most prompts take several steps
        num_kv_blocks=6,  # 10 requests of 2 blocks: running ones are preempted
    )
    assert expected[0] != expected[8], "adapter a changes the output for the same prompt"
    assert _generate(llm, prompt_ids, adapters) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == 6, "every block is back"


@pytest.mark.skipif(not group_quant.group_gemm_available(), reason="gemm_group.c needs AVX2, FMA and F16C")
def test_adapters_on_a_gguf_models_own_blocks_match_peft_on_its_dequantized_weights(
    adapters, prompt_ids, expected
):
    """The adapters wrap the bundled GGUF's 4-bit linears (decoder.c's loop steps aside
    for them), and on the exact kernel in fp32 the output is PEFT's on the weights
    transformers dequantized from the same file (`model_path`)."""
    llm = LLM(
        str(bundled_gguf_path()),
        dtype="float32",
        cpu_kernels="gemm.c",
        enable_lora=True,
        max_loras=4,
        max_cpu_loras=4,
        max_num_batched_tokens=16,
        num_kv_blocks=6,
    )
    runner = llm.engine.runner
    assert runner.weights.quantization == "gguf" and runner.run_decoder.native is None
    bases = [layer.base.layout(linear_kernels.GROUP_GEMM_C)[0] for layer in runner.lora_layers]
    assert len(bases) == 4 * runner.num_layers
    assert all(isinstance(w, GroupQuantWeight) for w in bases), "each adapter wraps a 4-bit weight"
    assert _generate(llm, prompt_ids, adapters) == expected
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_cache_is_per_adapter(model_path, adapters, tokenizer):
    llm = LLM(str(model_path), dtype="float32", enable_lora=True, max_loras=2)
    prompt = tokenizer("A long shared system prompt that fills a few blocks of the cache. " * 4).input_ids
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(lora):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(adapters["a"]) == 0
    assert cached(adapters["b"]) == 0, "KV computed under another adapter is not shared"
    assert cached(None) == 0, "nor the base model's"
    assert cached(adapters["a"]) > 0, "requests of one adapter share it"
    assert cached(None) > 0


def test_adapters_loaded_kept_and_refused(model_path, adapters, tmp_path):
    llm = LLM(str(model_path), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0)
    for name in ("a", "b", "c"):
        llm.generate(["Hi"], params, use_tqdm=False, lora_request=adapters[name])
    assert [lora.lora_name for lora in engine.list_loras()] == ["b", "c"], "the least recently used went"

    with pytest.raises(LoRAAdapterError, match="rank 16, over max_lora_rank=8"):
        LLM(str(model_path), dtype="float32", enable_lora=True, max_lora_rank=8).generate(
            ["Hi"], params, use_tqdm=False, lora_request=adapters["b"]
        )
    with pytest.raises(LoRAAdapterError, match="not found"):
        engine.add_request("Hi", params, lora_request=LoRARequest("gone", 9, str(tmp_path / "nowhere")))
    assert not engine.has_unfinished(), "a refused request leaves nothing behind"

    engine.add_request("Hi", SamplingParams(max_tokens=4, ignore_eos=True), "r", lora_request=adapters["c"])
    engine.step()
    assert not engine.remove_lora("c"), "an adapter in use stays"
    while engine.has_unfinished():
        engine.step()
    assert engine.remove_lora("c")
    assert [lora.lora_name for lora in engine.list_loras()] == ["b"]
    llm.generate(["Hi"], params, use_tqdm=False, lora_request=adapters["a"])
    engine.retain_loras(frozenset({adapters["a"].lora_int_id}))  # b is no longer registered
    assert [lora.lora_name for lora in engine.list_loras()] == ["a"]

    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        LLM(str(model_path), dtype="float32").engine.add_request("Hi", params, lora_request=adapters["a"])
