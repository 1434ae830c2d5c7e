"""Pre-quantized checkpoints: what config.json's `quantization_config` says, and whether
kvserve runs it.

kvserve runs compressed-tensors checkpoints (the format llm-compressor writes and vLLM
loads) whose linears hold 8-bit weights, symmetric, one scale per output row (or one per
tensor):
- int8 in the int-quantized (or naive-quantized) format: llm-compressor's W8A8-INT8
  scheme, run as quantization="int8" (its W8A16 scheme packs the int8 weights into
  int32s, pack-quantized, which is refused for now);
- fp8 (e4m3) in the float-quantized format: its FP8 and FP8_DYNAMIC schemes, run as
  quantization="fp8" (on GPUs that have fp8 GEMMs).
Such a checkpoint is converted once, as a GGUF file is (model_loader.py): a dense float32
copy that transformers loads, beside the checkpoint's scales, which the quantized
linears get back (`weight_scale` on each linear), so the 8-bit kernels multiply the
checkpoint's own weights: float32 holds q * scale closely enough that q comes back from
w / scale. Activations are quantized per token at run time, whatever the checkpoint
says about them (a static input scale is not used).

4-bit GPTQ, AWQ and compressed-tensors W4A16 (pack-quantized) checkpoints run on CPUs in
4 bits (packed_checkpoints.py): the dense copy gives transformers the model, and each
linear gets the checkpoint's integers back as `group_weight`. Any other format
(bitsandbytes, other bit widths, W8A16) is refused with an error that names it."""

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from replica import packed_checkpoints
from replica.model_loader import ModelNotFoundError, cache_root

SCALES_FILE = "kvserve_weight_scales.safetensors"  # "<linear>.weight_scale" -> fp32 [rows]
# format -> (the weights' type as config_groups states it, the engine's quantization)
FORMATS = {
    "int-quantized": ("int", "int8"),
    "naive-quantized": ("int", "int8"),
    "float-quantized": ("float", "fp8"),
}


def checkpoint_quantization(model_dir: Path) -> str | None:
    """The engine's quantization for the checkpoint in model_dir ("int8" or "fp8"; "gptq",
    "awq" or "w4a16" for a 4-bit one, packed_checkpoints.py), or None for a float one.
    Raises ModelNotFoundError for a quantized one kvserve cannot run."""
    config = _quantization_config(model_dir)
    if config is None:
        return None
    method = config.get("quant_method")
    try:
        packed = packed_checkpoints.method_of(config)
    except ValueError as e:
        raise ModelNotFoundError(f"{model_dir} is a {method} checkpoint kvserve cannot run: {e}") from None
    if packed:
        return packed
    if method != "compressed-tensors":
        detail = f", {config['bits']}-bit" if "bits" in config else ""
        raise ModelNotFoundError(
            f"{model_dir} is quantized with {method!r}{detail}, which kvserve cannot run: it runs "
            "compressed-tensors int8, fp8 and W4A16 checkpoints and 4-bit GPTQ and AWQ ones, and "
            "quantizes a float checkpoint itself with quantization='int8' or 'fp8'"
        )
    why = _unsupported(config)
    if why:
        raise ModelNotFoundError(f"{model_dir} is a compressed-tensors checkpoint kvserve cannot run: {why}")
    return FORMATS[config["format"]][1]


def _quantization_config(model_dir: Path) -> dict | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("quantization_config")


def _unsupported(config: dict) -> str | None:
    """Why kvserve cannot run this compressed-tensors config, or None."""
    if config.get("kv_cache_scheme"):
        return "its KV cache is quantized (kv_cache_scheme), which kvserve does not support yet"
    fmt = config.get("format")
    if fmt not in FORMATS:
        return f"format {fmt!r} (kvserve runs {', '.join(FORMATS)})"
    kind = FORMATS[fmt][0]
    groups = config.get("config_groups") or {}
    if not groups:
        return "no config_groups"
    for name, group in groups.items():
        if group.get("format") not in (None, fmt):
            return f"{name} has format {group['format']!r}"
        weights = group.get("weights") or {}
        scheme = (
            weights.get("type"),
            weights.get("num_bits"),
            weights.get("symmetric"),
            weights.get("strategy"),
        )
        if scheme not in ((kind, 8, True, "channel"), (kind, 8, True, "tensor")):
            return (
                f"{name}'s weights are {weights.get('num_bits')}-bit {weights.get('type')}, "
                f"{'symmetric' if weights.get('symmetric') else 'asymmetric'}, per {weights.get('strategy')} "
                f"(a {fmt} checkpoint kvserve runs has 8-bit {kind} weights, symmetric, per channel or "
                "per tensor)"
            )
    return None


def dense_copy(model_dir: Path, quantization: str) -> Path:
    """A directory transformers loads as a float32 model, with SCALES_FILE beside the
    weights, made once per checkpoint under the kvserve cache."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} has no safetensors weights")
    stamp = ":".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    key = hashlib.sha256(stamp.encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{Path(model_dir).name}-{quantization}-{key}"
    if (target / SCALES_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _write_dense(Path(model_dir), files, tmp)
        try:
            tmp.rename(target)  # atomic: concurrent converters race, one wins
        except OSError:
            if not (target / SCALES_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_dense(model_dir: Path, files: list[Path], out: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            tensors.update({name: reader.get_tensor(name) for name in reader.keys()})  # noqa: SIM118
    dense, scales = {}, {}
    method = packed_checkpoints.method_of(
        json.loads((model_dir / "config.json").read_text())["quantization_config"]
    )
    if method:  # 4-bit linears: dequantized here; the engine reads their integers from model_dir
        config = packed_checkpoints.quantization_config(model_dir)
        for prefix, parts in packed_checkpoints.linear_tensors(tensors, method).items():
            dense[f"{prefix}.weight"] = packed_checkpoints.dequantized(
                *packed_checkpoints.integers_scales_zeros(method, parts, config)
            )
            for suffix in parts:
                tensors.pop(f"{prefix}.{suffix}")
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{prefix}.weight_scale" in tensors:
            scale = tensors[f"{prefix}.weight_scale"].float().reshape(-1)
            rows = tensor.shape[0]
            scale = scale.expand(rows) if scale.numel() == 1 else scale  # per tensor: every row alike
            dense[name] = tensor.float() * scale[:, None]
            scales[f"{prefix}.weight_scale"] = scale.contiguous()
        elif not name.endswith(("_scale", "_zero_point", ".input_global_scale", ".weight_global_scale")):
            dense[name] = tensor.float() if tensor.is_floating_point() else tensor
    save_file(dense, str(out / "model.safetensors"))
    save_file(scales, str(out / SCALES_FILE))
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in model_dir.iterdir():  # tokenizer, chat template, generation config
        if (
            extra.is_file()
            and extra.name != "config.json"
            and not extra.name.endswith((".safetensors", ".index.json"))
        ):
            shutil.copy(extra, out / extra.name)


def attach_group_weights(model, model_dir: Path, method: str) -> int:
    """Gives each linear of `model` that the 4-bit checkpoint in model_dir packs its
    integers, as `group_weight` (PackedLinear multiplies them). Returns how many."""
    from safetensors import safe_open

    tensors: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as reader:
            tensors.update({name: reader.get_tensor(name) for name in reader.keys()})  # noqa: SIM118
    config = packed_checkpoints.quantization_config(model_dir)
    linears = packed_checkpoints.linear_tensors(tensors, method)
    for prefix, parts in linears.items():
        weight = packed_checkpoints.to_group_weight(
            *packed_checkpoints.integers_scales_zeros(method, parts, config)
        )
        model.get_submodule(prefix).group_weight = weight
    return len(linears)


def attach_weight_scales(model, dense_dir: Path) -> None:
    """Gives each linear of `model` quantized in the checkpoint its scales, as
    `weight_scale` (PackedLinear quantizes with them)."""
    from safetensors.torch import load_file

    for name, scale in load_file(str(Path(dense_dir) / SCALES_FILE)).items():
        module = model.get_submodule(name.removesuffix(".weight_scale"))
        module.weight_scale = scale
