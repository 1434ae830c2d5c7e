"""8-bit linears on GPUs (quantization="int8" or "fp8" on CUDA), through torch's own
scaled-GEMM entry points, as vLLM's dynamic W8A8 schemes run:

- weights quantized at load, symmetric, one fp32 scale per output row (or the scales a
  pre-quantized checkpoint gives);
- activations quantized per token at every call, symmetric and dynamic;
- int8: `torch._int_mm` (int32 sums, cuBLASLt), then both scales on the sums;
- fp8 (e4m3): `torch._scaled_mm` with row-wise scales (sm_89 and newer).

On CPUs, kvserve's int8 runs through replica/cpu/int8.py instead: torch's CPU `_int_mm`
and `_scaled_mm` are reference loops there (bench/quantized_gemm.py measures them), so
the engine does not use this module on a CPU. Its tests do, since the arithmetic is the
same on either device."""

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT8_MAX = 127
KINDS = ("int8", "fp8")
# cuBLASLt's int8 GEMM takes more than 16 rows, and its fp8 GEMM whole tiles of 16: a call
# with fewer rows is padded with zeros to MIN_ROWS, and every call to a multiple of ROW_ALIGN.
MIN_ROWS = 32
ROW_ALIGN = 16


def fp8_supported(device: torch.device) -> bool:
    """fp8 GEMMs need Ada (sm_89) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor, kind: str, scale: torch.Tensor | None = None):
    """x [rows, k] -> (q [rows, k] int8 or e4m3, fp32 scale [rows]), x ~ scale[:, None] * q:
    symmetric, each row's largest |x| at the format's largest value (an all-zero row gets
    scale 0 and q 0), or with the given scales (a pre-quantized checkpoint's)."""
    x = x.float()
    limit = INT8_MAX if kind == "int8" else FP8_MAX
    if scale is None:
        scale = x.abs().amax(dim=1) / limit
    scale = scale.float()
    q = x / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    if kind == "int8":
        # A checkpoint's weights may hold -128; dynamic ones never reach it.
        return q.round().clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8), scale
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _padded_rows(rows: int) -> int:
    return max(MIN_ROWS, -(-rows // ROW_ALIGN) * ROW_ALIGN)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held in 8 bits: each call quantizes x per token and multiplies
    in 8 bits, with sums in int32 (int8) or fp32 (fp8), scaled back to x's dtype."""

    def __init__(self, linear: nn.Linear, kind: str, weight_scale: torch.Tensor | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.in_features, self.out_features = kind, linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if weight_scale is not None:  # a checkpoint's, kept on the host until now
            weight_scale = weight_scale.to(weight.device)
        q, scale = quantize_rows(weight, kind, weight_scale)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        padded = _padded_rows(rows)
        if padded != rows:
            flat = nn.functional.pad(flat, (0, 0, 0, padded - rows))
        q, scale = quantize_rows(flat, self.kind)
        if self.kind == "int8":
            sums = torch._int_mm(q, self.weight.t())
            y = (sums.float() * scale[:, None] * self.weight_scale[None, :]).to(x.dtype)
        else:
            # Row-wise scaling writes bf16 only.
            y = torch._scaled_mm(
                q,
                self.weight.t(),
                scale_a=scale[:, None],
                scale_b=self.weight_scale[None, :],
                out_dtype=torch.bfloat16,
            ).to(x.dtype)
        y = y[:rows]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


def quantize_linears(model: nn.Module, kind: str) -> int:
    """Replaces every nn.Linear of the decoder (transformers' or replica/gpu/decoder.py's,
    whose packed projections sit outside any `layers`) and lm_head with a QuantizedLinear,
    in place, on the device each one is on; a linear with `weight_scale` (a pre-quantized
    checkpoint's, checkpoint_quantization.attach_weight_scales) keeps those scales. The
    embeddings and norms stay as they are. Returns how many were replaced."""
    decoder = getattr(model, model.base_model_prefix)
    in_decoder = {id(m) for m in decoder.modules()}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and (id(module) in in_decoder or module is model.get_output_embeddings())
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(linear, kind, getattr(linear, "weight_scale", None)))
    return len(targets)
