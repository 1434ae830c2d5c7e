"""An adapter's PEFT files (adapter_config.json + adapter_model.safetensors), read and
checked against the base model's config without torch: the ingress refuses a bad adapter
with a 400 before any replica loads it, and the replica reads the same spec.

Supported: LoRA (not DoRA) on the attention and MLP projections of a Llama-family model,
without trained biases or extra saved modules, at a rank no higher than max_lora_rank."""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter kvserve cannot serve: the message says why (the ingress answers 400)."""


@dataclass(frozen=True)
class AdapterSpec:
    path: Path
    rank: int
    scaling: float  # lora_alpha / rank (or / sqrt(rank) with rsLoRA)
    targets: frozenset[str]  # of TARGETS
    # "layer.target" -> (A's key, B's key) in the safetensors file
    keys: dict[str, tuple[str, str]]


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of a base model's config."""
    text = config.get("text_config") or config
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, text.get("num_key_value_heads", heads) * head_dim
    mlp = text["intermediate_size"]
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, mlp),
        "up_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
    }


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def read_adapter(path: str | Path, base_config: dict, max_lora_rank: int) -> AdapterSpec:
    """The adapter at `path` (a local folder), checked against `base_config` (the base
    model's config.json). Raises LoRAAdapterError saying what is wrong."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise LoRAAdapterError(f"no LoRA adapter at {str(path)!r}: {CONFIG_FILE} not found")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        kind = config.get("peft_type", "LORA")
    except (ValueError, AttributeError) as e:
        raise LoRAAdapterError(f"adapter {str(path)!r}: {CONFIG_FILE} is not a PEFT config ({e!r})") from None
    if kind != "LORA":
        raise LoRAAdapterError(f"adapter {str(path)!r} is a {kind} adapter; only LoRA is supported")
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (ValueError, KeyError, TypeError) as e:
        raise LoRAAdapterError(f"adapter {str(path)!r}: {CONFIG_FILE} is not a LoRA config ({e!r})") from None
    if rank < 1:
        raise LoRAAdapterError(f"adapter {str(path)!r} has rank {rank}")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"adapter {str(path)!r} uses DoRA, which kvserve does not serve")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"adapter {str(path)!r} trains biases (bias={config['bias']!r}); not supported"
        )
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"adapter {str(path)!r} saves whole modules ({config['modules_to_save']}); not supported"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAAdapterError(f"adapter {str(path)!r} has per-module ranks or alphas; not supported")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"adapter {str(path)!r} has rank {rank}, over max_lora_rank={max_lora_rank}")
    if not (path / WEIGHTS_FILE).is_file():
        raise LoRAAdapterError(f"adapter {str(path)!r} has no {WEIGHTS_FILE} (only safetensors is read)")
    try:
        shapes = safetensors_shapes(path / WEIGHTS_FILE)
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise LoRAAdapterError(
            f"adapter {str(path)!r}: {WEIGHTS_FILE} is not a safetensors file ({e!r})"
        ) from None
    keys, shapes = _pair_keys(path, shapes)
    _check_shapes(path, keys, shapes, rank, base_config)
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    targets = frozenset(name.split(".")[1] for name in keys)
    return AdapterSpec(path, rank, scaling, targets, keys)


def _pair_keys(path: Path, shapes: dict[str, list[int]]) -> tuple[dict[str, tuple[str, str]], dict]:
    found: dict[str, dict[str, str]] = {}
    for key in shapes:
        match = _KEY.search(key)
        if match is None:
            raise LoRAAdapterError(
                f"adapter {str(path)!r} has weights for {key!r}; kvserve serves LoRA on {', '.join(TARGETS)}"
            )
        layer, target, which = match.groups()
        if target not in TARGETS:
            raise LoRAAdapterError(
                f"adapter {str(path)!r} targets {target!r}; kvserve serves LoRA on {', '.join(TARGETS)}"
            )
        found.setdefault(f"{layer}.{target}", {})[which] = key
    if not found:
        raise LoRAAdapterError(f"adapter {str(path)!r} has no LoRA weights")
    keys = {}
    for name, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {str(path)!r}: layer {name} has lora_A or lora_B but not both")
        keys[name] = (pair["A"], pair["B"])
    return keys, shapes


def _check_shapes(path: Path, keys: dict, shapes: dict, rank: int, base_config: dict) -> None:
    expected = projection_shapes(base_config)
    num_layers = (base_config.get("text_config") or base_config)["num_hidden_layers"]
    for name, (a_key, b_key) in keys.items():
        layer, target = name.split(".")
        if int(layer) >= num_layers:
            raise LoRAAdapterError(
                f"adapter {str(path)!r} has layer {layer}; the base model has {num_layers}: "
                "it was trained for another base model"
            )
        in_features, out_features = expected[target]
        if shapes[a_key] != [rank, in_features] or shapes[b_key] != [out_features, rank]:
            raise LoRAAdapterError(
                f"adapter {str(path)!r} does not fit the base model: {target} of layer {layer} has "
                f"lora_A {shapes[a_key]} and lora_B {shapes[b_key]}, the base model needs "
                f"[{rank}, {in_features}] and [{out_features}, {rank}]"
            )
