"""The per-row low-rank update of a batch that mixes adapters (Punica's BGMV): each
packed token t adds (x_t A_s^T) B_s^T of its own adapter's slot s, or nothing.

One target's adapters are stacked by slot, P slices (a fused q/k/v projection has 3,
one per projection) of rank R (max_lora_rank, lower ranks padded with zeros):
    a: [S, P*R, in]   slice p's A in rows p*R:(p+1)*R
    b: [S, P*R, out]  slice p's B transposed, in its own output columns (zeros in the
                      others), its scaling folded in
token_slots [T]: each token's slot, -1 for the base model.

On CPU (and as the reference) the update is two GEMMs over every slot's rows, with the
other slots' contributions set to zero between them: no loop over requests or adapters,
and exactly zero added to the base model's rows. On CUDA the Triton kernels gather each
token's own slot (triton_lora.py) in steps of few rows."""

import torch


def lora_delta_torch(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """x [T, in] -> the update [T, out]."""
    slots, width, _ = a.shape
    h = x @ a.reshape(slots * width, -1).T  # [T, S*P*R]
    others = token_slots[:, None] != torch.arange(slots, device=x.device)  # [T, S]
    h = h.view(-1, slots, width).masked_fill_(others[:, :, None], 0).view(-1, slots * width)
    return h @ b.reshape(slots * width, -1)


# On CUDA the Triton kernels (one program per token) win up to this many rows and the
# masked GEMMs past it (python -m bench.lora on an H200: bench/results/lora_nvidia_h200.json).
TRITON_MAX_ROWS = 128


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda" and x.shape[0] <= TRITON_MAX_ROWS:
        from replica.lora.triton_lora import lora_delta_triton  # Triton only where it runs

        return lora_delta_triton(x, a, b, token_slots)
    return lora_delta_torch(x, a, b, token_slots)
