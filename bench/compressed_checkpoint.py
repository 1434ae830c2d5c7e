"""A compressed-tensors checkpoint (the format llm-compressor writes and vLLM loads),
made with the compressed-tensors package itself: a preset scheme (W8A8 by default:
int8 weights per output channel, symmetric; int8 activations per token, dynamic), weight
scales from each row's min and max (llm-compressor's default observer), lm_head left in
float as llm-compressor's recipes leave it. tests/test_quantized_checkpoints.py makes
its checkpoints with it, and so do the benchmarks' peer runs.

    python -m bench.compressed_checkpoint --out /tmp/smollm2-w8a8   # the bundled model
"""

import argparse
from pathlib import Path


def save_compressed(model, directory, tokenizer, scheme: str = "W8A8", ignore=("lm_head",)) -> dict:
    """Quantizes `model` with compressed-tensors' preset `scheme` (weight scales from
    each row's min and max, as llm-compressor's default observer sets them), compresses
    it in the format compressed-tensors infers, and saves it as llm-compressor does.
    Returns the quantized linears' weights as stored, by module name (none where the
    format packs them into another tensor)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=list(ignore)
    )
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            args = module.quantization_scheme.weights
            w = module.weight.detach()
            low, high = (w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True))
            if args.strategy == "tensor":
                low, high = w.amin().reshape(1), w.amax().reshape(1)
            elif args.strategy == "group":
                grouped = w.reshape(w.shape[0], -1, args.group_size)
                low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    quantized = {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if getattr(module, "quantization_scheme", None) is not None and hasattr(module, "weight")
    }
    model.save_pretrained(directory)
    compressor.update_config(directory)
    tokenizer.save_pretrained(directory)
    return quantized


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--scheme", default="W8A8")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replica.model_loader import resolve_model

    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    save_compressed(model, args.out, AutoTokenizer.from_pretrained(path), args.scheme)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
