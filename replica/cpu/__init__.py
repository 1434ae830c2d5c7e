"""CPU fast path: C kernels built on the machine that runs them (build.py; kernels.c, sampling.c,
attention.c, attention_paired.c, gemm.c, decoder.c), tensor wrappers (ops.py), the
transformers modules they replace (layers.py, decoder.py), and decoder.c's one call per
step (native_decoder.py)."""
