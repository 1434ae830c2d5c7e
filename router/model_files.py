"""What the ingress reads of a model: its tokenizer and two limits from its config.

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
