"""Engine arguments, one flat dataclass so the CLI, the offline API and Serve share them."""

from dataclasses import dataclass, field, fields

from replica.spec_decode.config import SpeculativeConfig

# fcfs and priority are vLLM's; static (a batch at a time) is only the benchmarks' baseline.
SCHEDULING_POLICIES = ("fcfs", "priority", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
GPU_DECODERS = ("auto", "fused", "transformers")
CPU_KERNEL_CHOICES = ("auto", "gemm.c", "onednn", "torch")
# vLLM's names: int8 or fp8 (e4m3) weights, activations quantized per token; int8 on CPUs
# (replica/cpu/int8.py) and GPUs, fp8 on GPUs (replica/quantized_linear.py).
QUANTIZATIONS = (None, "none", "int8", "fp8", "gguf", "gptq", "awq", "w4a16")
# vLLM's names (replica/kv_quant.py); "auto" keeps K and V in the model's dtype.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class EngineConfig:
    """A field's metadata holds its command-line help and choices: the CLI's engine flags
    are made from these fields (deployments/engine_flags.py)."""

    # None: the bundled SmolLM2-135M-Instruct; else a path or hub id.
    model: str | None = field(
        default=None,
        metadata={
            "help": "hub id (org/name), local HF directory or .gguf file (default: the bundled SmolLM2)"
        },
    )
    revision: str | None = field(default=None, metadata={"help": "of a hub id: branch, tag or commit"})
    dtype: str = field(
        default="auto",
        metadata={"help": "auto: bfloat16 on GPUs and AVX512-BF16/AMX CPUs, else float32", "choices": DTYPES},
    )
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    # Ignored when num_kv_blocks is set.
    kv_cache_memory_gb: float = field(
        default=1.0,
        metadata={"help": "the KV cache's size off CUDA, in GB (on CUDA it takes the GPU memory left)"},
    )
    # On CUDA the KV cache takes what is left of this share of GPU memory after the weights
    # and a profiled worst-case step; ignored when num_kv_blocks is set.
    gpu_memory_utilization: float = 0.9
    # A second KV tier in host memory (kvcache/host_tier.py), vLLM's argument: prefix blocks
    # the device cache evicts are kept there and copied back on a hit instead of recomputed.
    kv_offloading_size: float = field(
        default=0.0,
        metadata={
            "help": "GiB of host memory for a second KV tier: evicted prefix blocks are kept there and "
            "copied back on a prefix hit instead of recomputed (default 0: none)"
        },
    )
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # default: the model's, clipped to the KV capacity
    # Devices one replica's model is split over (replica/parallel/): rank 0 in the replica's
    # process, the others in Ray actors of its placement group. NCCL on GPUs, gloo on CPU.
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "devices (GPUs, or CPU processes) each replica's model is split over"}
    )
    enable_prefix_caching: bool = True
    # static, the benchmarks' baseline, is left out of the flag's choices.
    scheduling_policy: str = field(
        default="fcfs",
        metadata={
            "help": "fcfs (default): in arrival order; priority: by each request's `priority`, lower first",
            "choices": ("fcfs", "priority"),
        },
    )
    # auto: flash_attn > triton > torch on CUDA (each if installed); on CPU, kvserve's C
    # kernels (cpu) where they build, else torch.
    attention_backend: str = "auto"
    # Pure-decode steps of up to cuda_graph_max_batch sequences replay captured CUDA graphs
    # (kernel backends on CUDA only; ignored on CPU and with the torch backend).
    enable_cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    # With the Triton backend, a Llama-family decoder runs as replica/gpu/decoder.py's fused
    # one ("auto" or "fused"; about ten launches a layer instead of forty), or as
    # transformers' modules ("transformers", for A/B runs). Ignored by the other backends.
    gpu_decoder: str = "auto"
    seed: int = 0
    # Launch step N+1 before reading step N's sampled tokens (vLLM's async scheduling,
    # SGLang's overlap scheduler). None: on for CUDA, off on CPU, where host and "device"
    # share the cores and there is nothing to overlap.
    async_scheduling: bool | None = None
    # Requests allowed to wait for admission; past it add_request raises QueueFullError.
    # None (offline default): unbounded, since a batch job hands over all its rows at once.
    max_waiting: int | None = None
    # On CPU, the serving replica pins its threads to these cores and runs one torch
    # thread per core (replica/cpu/affinity.py). "auto": every core but the first, which
    # is left to Serve's proxy, the ingress and Ray, except in steps of 512 tokens or more
    # (bursts of prefill), which use every core. None: no pinning, one thread (Ray's
    # default for an actor without CPUs). Ignored on GPUs and by the offline LLM.
    cpu_cores: str | list[int] | None = None
    # On CPU, which kernel multiplies each linear at each row count, and whether SDPA or
    # the C kernel attends fresh prefills. "auto": whichever measured fastest on this
    # machine (replica/cpu/kernel_choice.py; timings cached in ~/.cache/kvserve/kernels).
    # "gemm.c", "onednn" or "torch" force one, for A/B runs.
    cpu_kernels: str = field(
        default="auto",
        metadata={
            "help": "on CPU: auto picks each linear's kernel per row count by measurement on this machine "
            "(cached in ~/.cache/kvserve/kernels); a name forces it, for A/B runs",
            "choices": CPU_KERNEL_CHOICES,
        },
    )
    # Weight quantization at load, vLLM's argument. "int8" (CPUs and GPUs) or "fp8" (e4m3,
    # GPUs of compute capability 8.9 or newer): each decoder linear's weight in 8 bits with
    # one scale per output row, its activations quantized per token at each step, and
    # lm_head's alike. The embeddings stay in `dtype`. "gguf" (CPUs, a .gguf model): the
    # file's own 4- to 8-bit blocks, embeddings included (replica/gguf_blocks.py); a .gguf
    # model file gets it by default where it runs, as in vLLM ("none": dequantized).
    quantization: str | None = field(
        default=None,
        metadata={
            "help": "int8 (CPUs and GPUs) or fp8 (GPUs of compute capability 8.9+): each decoder linear's "
            "weight in 8 bits, its activations quantized per token; gguf (CPUs, a .gguf model): the "
            "file's own quantized blocks, the default for a .gguf file where they run (none: dequantized); "
            "gptq, awq, w4a16: a 4-bit checkpoint's (read from its config)",
            "choices": QUANTIZATIONS,
        },
    )
    # The KV cache's element type, vLLM's argument (replica/kv_quant.py). "auto": the model's
    # dtype. "fp8" (e4m3, as "fp8_e4m3") or "fp8_e5m2": one byte per element, each layer's
    # keys and values divided by a scale, so the same memory holds twice bf16's blocks.
    # "bfloat16": two bytes, beside a float32 model too.
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "the KV cache's element type; fp8 (e4m3) or fp8_e5m2 holds twice bf16's tokens in "
            "the same memory (default auto: the model's dtype)",
            "choices": KV_CACHE_DTYPES,
        },
    )
    # LoRA adapters (replica/lora/), vLLM's arguments: max_loras adapters in one step,
    # each of rank <= max_lora_rank; max_cpu_loras adapters kept loaded (None: max_loras),
    # the least recently used one dropped past it.
    enable_lora: bool = field(
        default=False,
        metadata={"help": "serve LoRA adapters beside the model (implied by --lora-modules)"},
    )
    max_loras: int = field(default=1, metadata={"help": "most adapters in one engine step"})
    max_lora_rank: int = field(default=16, metadata={"help": "highest adapter rank accepted"})
    max_cpu_loras: int | None = field(
        default=None,
        metadata={
            "help": "adapters a replica keeps loaded, least recently used dropped past it "
            "(default: --max-loras)"
        },
    )
    # Speculative decoding (replica/spec_decode/), vLLM's argument: a dict such as
    # {"method": "ngram", "num_speculative_tokens": 4} or {"method": "draft_model",
    # "model": ..., "num_speculative_tokens": 4}, its JSON text, or None for none.
    speculative_config: SpeculativeConfig | dict | str | None = field(
        default=None,
        metadata={
            "help": 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
            'or \'{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 4}\''
        },
    )

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config does not yet work with tensor_parallel_size > 1")
        positive = (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "cuda_graph_max_batch",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora does not yet work with tensor_parallel_size > 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps prefix blocks: it needs enable_prefix_caching")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.gpu_decoder not in GPU_DECODERS:
            raise ValueError(f"gpu_decoder must be one of {GPU_DECODERS}, got {self.gpu_decoder!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        if self.cpu_cores is not None and self.cpu_cores != "auto":
            cores = self.cpu_cores
            if not (isinstance(cores, list) and cores and all(isinstance(c, int) and c >= 0 for c in cores)):
                raise ValueError(f'cpu_cores must be "auto" or a list of core numbers, got {cores!r}')
        if self.cpu_kernels not in CPU_KERNEL_CHOICES:
            raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_CHOICES}, got {self.cpu_kernels!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)
