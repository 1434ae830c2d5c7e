"""read_adapter on adapters saved by PEFT itself (a tiny random Llama): the spec it reads
(rank, scaling, targets, the tensors' keys), the weights loaded from it against PEFT's
own forward pass, and each adapter kvserve refuses, with a message naming why. Then the
host cache of loaded adapters: least recently used dropped first, never one in use."""

import json
import warnings
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from replica.lora.adapter_files import (
    CONFIG_FILE,
    TARGETS,
    WEIGHTS_FILE,
    LoRAAdapterError,
    read_adapter,
    safetensors_shapes,
)
from replica.lora.cache import AdapterCache
from replica.lora.weights import AdapterWeights, load_adapter_weights
from wire.lora_request import LoRARequest

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
BASE_CONFIG = LlamaConfig(**BASE).to_dict()
MAX_RANK = 16


def _peft_model(**lora) -> peft.PeftModel:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BASE))
    config = peft.LoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": list(TARGETS)} | lora, init_lora_weights=False
    )
    with warnings.catch_warnings():  # e.g. "Setting save_embedding_layers to True"
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, config)


def save_adapter(path: Path, safe_serialization: bool = True, **lora) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _peft_model(**lora).save_pretrained(path, safe_serialization=safe_serialization)
    return path


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return save_adapter(tmp_path_factory.mktemp("adapter"))


def _refused(path, match: str, base_config=BASE_CONFIG, max_lora_rank=MAX_RANK) -> str:
    with pytest.raises(LoRAAdapterError, match=match) as error:
        read_adapter(path, base_config, max_lora_rank)
    assert str(path) in str(error.value)  # it names the adapter
    return str(error.value)


def test_spec_of_a_peft_adapter(adapter):
    spec = read_adapter(adapter, BASE_CONFIG, MAX_RANK)
    assert spec.path == adapter
    assert spec.rank == 4
    assert spec.scaling == pytest.approx(8 / 4)
    assert spec.targets == frozenset(TARGETS)
    assert set(spec.keys) == {f"{layer}.{t}" for layer in range(2) for t in TARGETS}
    shapes = safetensors_shapes(adapter / WEIGHTS_FILE)
    assert len(shapes) == 2 * len(spec.keys)
    a_key, b_key = spec.keys["1.down_proj"]
    assert shapes[a_key] == [4, 128] and shapes[b_key] == [64, 4]
    a_key, b_key = spec.keys["0.k_proj"]
    assert shapes[a_key] == [4, 64] and shapes[b_key] == [32, 4]  # 2 KV heads of 16
    # The same at the rank limit, and from a str path.
    assert read_adapter(str(adapter), BASE_CONFIG, max_lora_rank=4).rank == 4


def test_spec_with_rslora_and_some_targets(tmp_path):
    spec = read_adapter(save_adapter(tmp_path, use_rslora=True), BASE_CONFIG, MAX_RANK)
    assert spec.scaling == pytest.approx(8 / 4**0.5)
    path = save_adapter(
        tmp_path / "some", target_modules=["q_proj", "v_proj", "down_proj"], r=8, lora_alpha=4
    )
    spec = read_adapter(path, BASE_CONFIG, MAX_RANK)
    assert spec.rank == 8 and spec.scaling == pytest.approx(0.5)
    assert spec.targets == {"q_proj", "v_proj", "down_proj"}
    assert len(spec.keys) == 6


def test_spec_against_a_multimodal_config(adapter):
    """A base model whose text part sits under text_config."""
    spec = read_adapter(adapter, {"model_type": "llava", "text_config": BASE_CONFIG}, MAX_RANK)
    assert spec.targets == frozenset(TARGETS)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_loaded_weights_reproduce_peft(tmp_path, use_rslora):
    """x A^T (B * scaling)^T, from the loaded weights, is what PEFT's LoRA layer adds."""
    model = _peft_model(use_rslora=use_rslora)
    model.save_pretrained(tmp_path)
    weights = load_adapter_weights(read_adapter(tmp_path, BASE_CONFIG, MAX_RANK), torch.float32)
    assert weights.rank == 4 and len(weights.pairs) == 2 * len(TARGETS)
    layer = model.base_model.model.model.layers[1]
    x = torch.randn(3, 64)
    for target, module in (("q_proj", layer.self_attn.q_proj), ("up_proj", layer.mlp.up_proj)):
        a, b = weights.pairs[1, target]
        with torch.no_grad():
            delta = module(x) - module.base_layer(x)
        torch.testing.assert_close(x @ a.T @ b.T, delta, rtol=1e-4, atol=1e-5)


def test_missing_adapter(tmp_path):
    message = _refused(tmp_path / "nowhere", "not found")
    assert CONFIG_FILE in message
    _refused(tmp_path, "not found")  # a folder without an adapter


def test_rank_over_max_lora_rank(adapter):
    message = _refused(adapter, "rank 4", max_lora_rank=2)
    assert "max_lora_rank=2" in message


def test_adapter_for_another_base_model(adapter):
    wider = LlamaConfig(**BASE | {"hidden_size": 128}).to_dict()
    message = _refused(adapter, "does not fit the base model", base_config=wider)
    assert "the base model needs [4, 128]" in message
    fewer = LlamaConfig(**BASE | {"num_hidden_layers": 1}).to_dict()
    message = _refused(adapter, "has layer 1; the base model has 1", base_config=fewer)
    assert "another base model" in message
    narrower = LlamaConfig(**BASE | {"intermediate_size": 96}).to_dict()
    _refused(adapter, "does not fit the base model", base_config=narrower)


@pytest.mark.parametrize("extra", ["lm_head", "embed_tokens"])
def test_unsupported_targets(tmp_path, extra):
    path = save_adapter(tmp_path, target_modules=[*TARGETS, extra])
    message = _refused(path, "kvserve serves LoRA on")
    assert extra in message


def test_dora(tmp_path):
    _refused(save_adapter(tmp_path, use_dora=True), "DoRA")


def test_modules_to_save(tmp_path):
    message = _refused(save_adapter(tmp_path, modules_to_save=["lm_head"]), "saves whole modules")
    assert "lm_head" in message


def test_trained_biases(tmp_path):
    _refused(save_adapter(tmp_path, bias="lora_only"), "trains biases")
    _refused(save_adapter(tmp_path / "lora_bias", lora_bias=True), "lora_B.bias")


def test_per_module_ranks(tmp_path):
    _refused(save_adapter(tmp_path, rank_pattern={"q_proj": 2}), "per-module ranks")
    _refused(save_adapter(tmp_path / "alpha", alpha_pattern={"q_proj": 2}), "per-module ranks or alphas")


def test_bin_only_adapter(tmp_path):
    path = save_adapter(tmp_path, safe_serialization=False)
    assert not (path / WEIGHTS_FILE).exists()
    _refused(path, f"no {WEIGHTS_FILE}")


def test_other_peft_types(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(**BASE))
    config = peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(model, config).save_pretrained(tmp_path)
    _refused(tmp_path, "IA3 adapter; only LoRA")


def test_hand_made_files(tmp_path, adapter):
    """Files no PEFT writes, but a broken upload could: an unknown projection, lora_A
    without lora_B, no weights at all."""

    def write(name: str, tensors: dict) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / CONFIG_FILE).write_text((adapter / CONFIG_FILE).read_text())
        save_file(tensors, path / WEIGHTS_FILE)
        return path

    prefix = "base_model.model.model.layers.0.self_attn"
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    path = write("unknown", {f"{prefix}.rotary.lora_A.weight": a, f"{prefix}.rotary.lora_B.weight": b})
    _refused(path, "targets 'rotary'")
    _refused(write("half", {f"{prefix}.q_proj.lora_A.weight": a}), "lora_A or lora_B but not both")
    _refused(write("empty", {}), "no LoRA weights")
    config = json.loads((adapter / CONFIG_FILE).read_text())
    assert config["r"] == 4  # what the files above claim


@pytest.mark.parametrize(
    "config_text, weights, match",
    [
        ("{", None, "not a PEFT config"),
        ("{}", None, "not a LoRA config"),
        ('{"r": 0}', None, "has rank 0"),
        (None, b"", "not a safetensors file"),
        (None, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", "not a safetensors file"),
    ],
)
def test_malformed_files(tmp_path, adapter, config_text, weights, match):
    """A broken upload is refused with a message that names it, not a parser's error."""
    (tmp_path / CONFIG_FILE).write_text(config_text or (adapter / CONFIG_FILE).read_text())
    (tmp_path / WEIGHTS_FILE).write_bytes(
        (adapter / WEIGHTS_FILE).read_bytes() if weights is None else weights
    )
    _refused(tmp_path, match)


# --- AdapterCache ---

ADAPTERS = [LoRARequest(f"adapter-{i}", i + 1, f"/adapters/{i}") for i in range(5)]


def _weights(i: int) -> AdapterWeights:
    return AdapterWeights(rank=i + 1, pairs={})


def test_cache_drops_the_least_recently_used():
    a, b, c, d, e = ADAPTERS
    cache = AdapterCache(capacity=3)
    for i, lora in enumerate((a, b, c)):
        cache.put(lora, _weights(i), in_use=set())
    assert cache.adapters() == [a, b, c]
    assert cache.get(a).rank == 1  # a used again: now the most recent
    assert cache.adapters() == [b, c, a]
    cache.put(d, _weights(3), in_use=set())
    assert cache.adapters() == [c, a, d]
    assert b not in cache and a in cache
    cache.put(c, _weights(2), in_use=set())  # put again: most recent, nothing dropped
    assert cache.adapters() == [a, d, c]
    cache.remove(d)
    cache.remove(e)  # not there: nothing happens
    assert cache.adapters() == [a, c]
    with pytest.raises(KeyError):
        cache.get(e)


def test_cache_keeps_adapters_in_use_past_capacity():
    a, b, c, d, e = ADAPTERS
    cache = AdapterCache(capacity=2)
    cache.put(a, _weights(0), in_use=set())
    cache.put(b, _weights(1), in_use={a})
    cache.put(c, _weights(2), in_use={a, b})  # all in use: over capacity for now
    assert cache.adapters() == [a, b, c]
    cache.put(d, _weights(3), in_use={b})  # a and c idle: the oldest go first, down to 2
    assert cache.adapters() == [b, d]
    cache.put(e, _weights(4), in_use={b, d})
    assert cache.adapters() == [b, d, e]
    cache.put(a, _weights(0), in_use=set())  # all idle again: back to capacity, newest kept
    assert cache.adapters() == [e, a]


def test_cache_keeps_the_adapter_it_was_given():
    """Even at capacity 1 with the other adapter in use, the one just put stays."""
    a, b = ADAPTERS[:2]
    cache = AdapterCache(capacity=1)
    cache.put(a, _weights(0), in_use=set())
    cache.put(b, _weights(1), in_use={a})
    assert cache.adapters() == [a, b]
    assert cache.get(b).rank == 2
