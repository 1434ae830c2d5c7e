"""Per-layer scales for an fp8 KV cache, from one forward pass over a built-in text at
load (vLLM's calculate_kv_scales, done once rather than on the first batch).

Unscaled, a layer whose values are small (the first layer's V, whose median is near
e4m3's smallest normal, 2^-6) loses them to subnormals. Each layer's scale maps its
largest key or value on this text to 1/HEADROOM of the format's range, so those keep
their 3 mantissa bits and a later input up to HEADROOM times larger still fits unclipped.
The text is kvserve's own, and no held-out text a benchmark reports is in it.
"""

import torch
from transformers import AttentionInterface, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from replica.kv_quant import FP8_MAX, KVScale

HEADROOM = 4.0
CALIBRATION_KEY = "kvserve_kv_calibration"
CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when movable type made
books cheap enough for merchants and students to own. Within fifty years, presses were
running in more than two hundred cities across Europe.

User: Can you write a Python function that returns the n-th Fibonacci number?
Assistant: Sure. Here is an iterative version:

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. Leaves are
green because chlorophyll absorbs red and blue light and reflects the green. In autumn,
as chlorophyll breaks down, the yellow and orange pigments beneath it show through.

Q: What is 17 multiplied by 23? A: 391. Q: Name three rivers in Africa. A: The Nile, the
Congo and the Niger. {"city": "Lisbon", "population": 545000, "coastal": true}
"""


def calibrate_kv_scales(model: torch.nn.Module, tokenizer_path, kv_dtype: torch.dtype) -> list[KVScale]:
    """One scale pair per decoder layer, from the largest |key| (after the rotary
    embedding) and |value| the unsharded model produces on CALIBRATION_TEXT."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    device = next(model.parameters()).device
    input_ids = torch.tensor([tokenizer.encode(CALIBRATION_TEXT)], device=device)
    amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        amax[module.layer_idx] = (key.abs().amax().float(), value.abs().amax().float())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CALIBRATION_KEY, record)
    serving = model.config._attn_implementation
    model.set_attn_implementation(CALIBRATION_KEY)
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(serving)
    limit = FP8_MAX[kv_dtype]
    tiny = torch.finfo(torch.float32).tiny  # a layer of all-zero keys still gets a finite scale
    return [
        KVScale(max(k.item(), tiny) * HEADROOM / limit, max(v.item(), tiny) * HEADROOM / limit)
        for k, v in (amax[i] for i in range(len(amax)))
    ]
