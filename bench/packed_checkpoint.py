"""A 4-bit GPTQ or AWQ checkpoint of a float model, laid out as AutoGPTQ's and AutoAWQ's
packers write them (round-to-nearest per group, no calibration: the layout is what is
tested and timed, not the quantizer). tests/test_packed_checkpoints.py and
tests/test_gpu_group_linear.py load them, and bench.quantized_gemm runs the 1B-shaped
model's on a GPU.

    python -m bench.packed_checkpoint MODEL_DIR OUT_DIR [--method awq] [--asymmetric]
"""

import argparse
import json
from pathlib import Path

import torch

from replica import packed_checkpoints

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool):
    """w [n, k] -> (q [n, k] 0..15, fp16 scales [n, k / group], zeros [n, k / group] 0..15)."""
    groups = w.float().view(w.shape[0], -1, group)
    if symmetric:
        scales = (groups.abs().amax(dim=2) / 7).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scales = ((high - low) / 15).half()
        zeros = (-low / scales.float()).round().clamp(0, 15).to(torch.int32)
    q = (groups / scales.float()[..., None]).round() + zeros[..., None]
    return q.clamp(0, 15).to(torch.int32).view_as(w), scales, zeros


def pack_nibbles(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, cols] nibbles -> int32 [rows, cols / 8]: word c's nibble i holds column
    8c + order[i] (the packers shift each into place and OR them)."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64, device=values.device)
    for i, column in enumerate(order):
        words |= values[:, column::8].to(torch.int64) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def save_packed(model, method: str, directory: Path, tokenizer, symmetric: bool, group: int = 128) -> dict:
    """`model`'s decoder projections as a `method` ("gptq" or "awq") checkpoint in
    `directory` (the rest of its weights as they are, a tied lm_head left to its
    embeddings), computed on the model's device; returns each projection's format
    dequantization (fp32 [n, k]) by module name."""
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    reference = {}
    for layer in range(model.config.num_hidden_layers):
        for projection in PROJECTIONS:
            name = f"model.layers.{layer}.{projection}"
            q, scales, zeros = quantize_groups(state.pop(f"{name}.weight"), group, symmetric)
            expand = lambda t: t.float().repeat_interleave(group, 1)  # noqa: E731
            reference[name] = (q.float() - expand(zeros)) * expand(scales)
            if method == "gptq":  # down k in the weight, across n in the zeros, zero - 1 stored
                state[f"{name}.qweight"] = pack_nibbles(q).t().contiguous()  # word (r, j): q[j, 8r..8r+7]
                state[f"{name}.qzeros"] = pack_nibbles((zeros - 1).t().contiguous())
                state[f"{name}.scales"] = scales.t().contiguous()
                state[f"{name}.g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // group
            else:  # awq: across n, in AWQ's nibble order
                order = packed_checkpoints.AWQ_ORDER
                state[f"{name}.qweight"] = pack_nibbles(q.t().contiguous(), order)
                state[f"{name}.qzeros"] = pack_nibbles(zeros.t().contiguous(), order)
                state[f"{name}.scales"] = scales.t().contiguous()
    directory.mkdir(parents=True)
    save_file({k: v.cpu().contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": symmetric,
         "checkpoint_format": "gptq"}
        if method == "gptq"
        else {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(directory)
    return reference


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    parser.add_argument("--asymmetric", action="store_true")
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    save_packed(model, args.method, args.out, tokenizer, not args.asymmetric, args.group)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
