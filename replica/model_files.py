"""What the ingress reads of a model: its tokenizer, two limits from its config, and the
sampling defaults of its generation config, which the offline API (replica/llm.py) reads
too. One of replica's torch-free helpers that the ingress may import (docs/architecture.md).

Read without torch: transformers' auto classes import every model config module, and
those import torch, which would load it into every ingress replica only to tokenize. A
tokenizer class that the model's tokenizer_config.json names loads on its own; only a
model that names none goes through AutoTokenizer."""

import json
from dataclasses import dataclass
from pathlib import Path

import transformers


def load_tokenizer(path: Path):
    config_file = path / "tokenizer_config.json"
    name = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    tokenizer_class = getattr(transformers, name, None) if name else None
    if tokenizer_class is None:
        tokenizer_class = transformers.AutoTokenizer
    return tokenizer_class.from_pretrained(path)


@dataclass
class ModelLimits:
    max_position_embeddings: int | None  # the context length the model was trained for
    vocab_size: int | None  # the embedding's rows, which may exceed the tokenizer's size


def model_limits(path: Path) -> ModelLimits:
    """From config.json; a multimodal model keeps its language model's in text_config."""
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or {}
    return ModelLimits(
        config.get("max_position_embeddings") or text.get("max_position_embeddings"),
        config.get("vocab_size") or text.get("vocab_size"),
    )


# The fields of a generation_config.json that serve as a request's sampling defaults, the
# ones vLLM's `--generation-config auto` reads.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(path: Path) -> dict:
    """The model's recommended sampling, from its generation_config.json; what a request
    sets itself wins. A model without the file, or without these fields, gives none."""
    config_file = path / "generation_config.json"
    if not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    return {name: config[name] for name in SAMPLING_DEFAULT_FIELDS if config.get(name) is not None}
