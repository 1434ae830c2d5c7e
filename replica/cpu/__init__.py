"""CPU fast path: C kernels built on the machine that runs them (build.py, kernels.c,
gemm.c),
tensor wrappers (ops.py) and the transformers modules they replace (layers.py)."""
