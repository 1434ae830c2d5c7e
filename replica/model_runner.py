"""Device work for one step: load the model, own the paged KV cache, pack the scheduled
tokens into one 1 x T forward, and return logits only for the rows that sample.

On CUDA, pure-decode steps replay captured CUDA graphs (cuda_graphs.py), and the KV cache
takes what `gpu_memory_utilization` leaves after the weights and a profiled worst step
(kv_sizing.py).

With tensor parallelism every rank runs a ModelRunner over its shard of the model
(replica/parallel/), given its `group`: all ranks run the same forward, whose
collectives join them, and only rank 0 gets logits. Sending each step to the other
ranks is the job of rank 0's TensorParallelRunner, which wraps this one.
"""

import logging

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from kvcache.host_tier import KVCopies
from replica import packed_checkpoints
from replica.attention import (
    AttentionMetadata,
    ForwardContext,
    choose_backend,
    effective_block_size,
    forward_context,
    installed_kernel_packages,
    load_backend,
    register_backend,
)
from replica.attention.select import CPU_KERNELS, cpu_kernels_built, triton_interpret
from replica.checkpoint_quantization import (
    attach_group_weights,
    attach_weight_scales,
    checkpoint_quantization,
    dense_copy,
)
from replica.config import EngineConfig
from replica.cpu import ops as cpu_ops
from replica.cpu.affinity import CorePlan
from replica.cpu.decoder import PACKABLE_DTYPES, optimize_for_cpu
from replica.cpu.kernel_choice import KernelChooser, sharing_rows
from replica.cpu.layers import PackedLinear
from replica.cpu.linear_kernels import FP32_SHARING_KERNELS, GROUP_SHARING_KERNELS
from replica.cuda_graphs import DecodeGraphRunner
from replica.devices import resolve_device, resolve_dtype
from replica.gguf_blocks import attach_gguf_weights
from replica.input_batch import Fill, pack_inputs, rows_to_keep
from replica.kv_calibration import calibrate_kv_scales
from replica.kv_offload import HostKVCache
from replica.kv_quant import KVScale, is_fp8, kv_cache_torch_dtype
from replica.kv_sizing import (
    KVCacheLayout,
    KVCaches,
    kv_blocks_for_memory,
    largest_step,
    measure_kv_blocks_on_gpu,
)
from replica.lora.batch import LoRABatch
from replica.lora.layers import wrap_targets
from replica.lora.weights import AdapterWeights
from replica.model_loader import ModelNotFoundError, gguf_source
from replica.parallel.group import TPGroup
from replica.parallel.sharding import num_kv_heads, shard_model
from replica.quantized_linear import KINDS as QUANTIZED_LINEAR_KINDS
from replica.quantized_linear import fp8_supported, quantize_linears
from replica.weights_summary import WeightsSummary

logger = logging.getLogger(__name__)


def _attention_backend_name(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype
) -> str:
    installed = installed_kernel_packages()
    if device.type == "cpu" and config.attention_backend in ("auto", CPU_KERNELS) and cpu_kernels_built():
        installed |= {CPU_KERNELS}
    name = choose_backend(
        config.attention_backend, device.type, dtype, installed, triton_interpret(), kv_dtype
    )
    if config.attention_backend == "auto":
        logger.info("attention backend: %s (auto, on %s)", name, device.type)
    return name


# Quantizations whose linears hold a file's group-quantized integers (the group kernels, CPU only).
GROUP_QUANTIZATIONS = ("gguf", *packed_checkpoints.METHODS)


def check_quantization(
    quantization: str, device: torch.device, dtype: torch.dtype, backend: str, group: TPGroup | None
) -> None:
    """Where each quantization runs: int8 on CPUs through kvserve's CPU kernels (float32 or
    bfloat16), int8 and fp8 on GPUs (replica/quantized_linear.py; fp8 on sm_89 and newer),
    a GGUF file's own blocks and 4-bit checkpoints' integers on CPUs and, on one rank, on
    GPUs (replica/gpu/group_linear.py, which the triton backend also runs on a CPU under
    the Triton interpreter)."""
    if quantization in GROUP_QUANTIZATIONS:
        if group is not None:
            raise ValueError(
                f"quantization={quantization!r} does not yet run with tensor parallelism: it runs "
                "on one rank, on a GPU or on CPU with kvserve's CPU kernels in float32 or bfloat16"
            )
        if device.type == "cuda" or backend == "triton":
            return
    if device.type == "cuda":
        if group is not None:
            raise ValueError(
                f"quantization={quantization!r} on GPUs does not yet work with tensor_parallel_size > 1"
            )
        if quantization == "fp8" and not fp8_supported(device):
            capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ValueError(
                f"quantization='fp8' needs a GPU with fp8 GEMMs (compute capability 8.9 or newer); "
                f"this {torch.cuda.get_device_name(device)} has {capability}: use quantization='int8'"
            )
        return
    if quantization == "fp8":
        raise ValueError(
            "quantization='fp8' runs on GPUs with fp8 GEMMs (compute capability 8.9 or newer): on "
            "CPUs torch's fp8 GEMM measured slower than float32 (bench/quantized_gemm.py), so use "
            "quantization='int8' there"
        )
    if not (backend == CPU_KERNELS and dtype in PACKABLE_DTYPES):
        raise ValueError(
            f"quantization={quantization!r} runs on CPU with kvserve's CPU kernels in float32 "
            f"or bfloat16; this engine has the {backend} attention backend on cpu in {dtype}"
        )


def resolve_quantization(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, backend: str, group: TPGroup | None
) -> str | None:
    """The quantization asked for ("none": none, a GGUF file dequantized), or else vLLM's
    default for a .gguf model file: its own blocks (quantization="gguf") where they run,
    and where they do not, the file dequantized into `dtype`, with the reason in the log.
    The bundled model, named by no path, stays dequantized: at a batch of 16 the served
    bf16 model is faster (bench/results/serving_peers_gguf_llama_server_*.json)."""
    if config.quantization == "none":
        return None
    if config.quantization is not None or not str(config.model or "").lower().endswith(".gguf"):
        return config.quantization
    try:
        check_quantization("gguf", device, dtype, backend, group)
        if config.cpu_kernels not in ("auto", "gemm.c"):
            raise ValueError(f"cpu_kernels={config.cpu_kernels!r} has no kernel for every GGUF block type")
    except ValueError as e:
        logger.info("%s is dequantized to %s, as its blocks do not run here: %s", config.model, dtype, e)
        return None
    return "gguf"


def _load_causal_lm(model_path, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    transformers_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attn_implementation
        )
    except ValueError as e:
        raise ModelNotFoundError(f"cannot load {model_path} as a causal LM: {e}") from e
    if not getattr(model, "_supports_attention_backend", False):
        raise ModelNotFoundError(f"{type(model).__name__} does not support custom attention backends")
    return model


def _transformers_decoder(decoder: torch.nn.Module):
    def run(input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor | None = None):
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return hidden if rows is None else hidden[:, rows]

    return run


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path, group: TPGroup | None = None):
        """group: this rank's tensor-parallel group (None: the whole model here)."""
        self.group = group
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        name = _attention_backend_name(config, self.device, self.dtype, self.kv_dtype)
        quantization = resolve_quantization(config, self.device, self.dtype, name, group)
        checkpoint = checkpoint_quantization(model_path)
        tokenizer_path = model_path
        if checkpoint:
            if quantization not in (None, checkpoint):
                raise ValueError(f"quantization={quantization!r}, but the checkpoint is {checkpoint}")
            if group is not None:
                raise ValueError("a pre-quantized checkpoint does not yet work with tensor_parallel_size > 1")
            quantization = checkpoint
        if quantization:
            check_quantization(quantization, self.device, self.dtype, name, group)
        source = model_path
        if checkpoint:
            model_path = dense_copy(model_path, checkpoint)
        self.backend = load_backend(name)
        # The engine's KV manager must use this, not config.block_size.
        self.block_size = effective_block_size(name, config.block_size)
        self.model = _load_causal_lm(model_path, self.dtype, register_backend(self.backend))
        if checkpoint in packed_checkpoints.METHODS:
            count = attach_group_weights(self.model, source, checkpoint)
            logger.info("%s checkpoint: %d linears in 4 bits", checkpoint, count)
        elif checkpoint:
            attach_weight_scales(self.model, model_path)
        if quantization == "gguf":
            source = gguf_source(model_path)
            if source is None:
                raise ValueError(f"quantization='gguf' needs a .gguf model; {model_path} is not one")
            kept = attach_gguf_weights(self.model, source)
            logger.info(
                "GGUF blocks run natively: %s", ", ".join(f"{n} {t}" for t, n in kept.items()) or "none"
            )
        hf = self.model.config
        # Before sharding, so that every rank computes the same scales from the whole model.
        self.kv_scales = (
            calibrate_kv_scales(self.model, tokenizer_path, self.kv_dtype)
            if is_fp8(self.kv_dtype)
            else [KVScale()] * hf.num_hidden_layers
        )
        # This rank's; shard before packing, on the host.
        if group is None:
            q_heads, kv_heads = hf.num_attention_heads, num_kv_heads(hf)
        else:
            shard = shard_model(self.model, group)
            q_heads, kv_heads = shard.num_q, shard.num_kv
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        # A group-quantized model on the CPU kernels keeps `group_weight` on its linears
        # for optimize_for_cpu; elsewhere its linears become GroupLinears.
        group_quantized = quantization in GROUP_QUANTIZATIONS and name != CPU_KERNELS
        fused = None
        if name == "triton" and group is None and config.gpu_decoder != "transformers":
            from replica.gpu.decoder import fuse_for_gpu  # imports triton, which only this backend needs

            fused = fuse_for_gpu(self.model)  # on the host: no unpacked copy on the device
        if config.gpu_decoder == "fused" and fused is None:
            raise ValueError(
                "gpu_decoder='fused' runs a Llama-family model on one rank with the triton attention "
                f"backend; this engine has the {name} backend"
                + (" and tensor parallelism" if group is not None else "")
                + ", and the log says why the model stayed transformers'"
            )
        if group_quantized:
            from replica.gpu import group_linear  # imports triton, which only this path needs

            count = group_linear.group_linears(self.model)
            logger.info("%d linears in their group-quantized integers", count)
        self.model.to(self.device).eval()
        if group_quantized:
            group_linear.move_embeddings(self.model, self.device)
        self.op_timings = None  # the fused GPU decoder's, where it measured them
        if fused is not None and self.device.type == "cuda":
            self.op_timings = fused.choose_ops(self.block_size, config.max_num_batched_tokens)
        self.group_timings = None  # group_linear.choose_group_kernels', where it measured them
        if group_quantized and self.device.type == "cuda":
            self.group_timings = group_linear.choose_group_kernels(
                self.model, config.max_num_batched_tokens, self.dtype
            )
        if quantization in QUANTIZED_LINEAR_KINDS and self.device.type == "cuda":
            quantize_linears(self.model, quantization)
        if name == CPU_KERNELS:
            chooser = KernelChooser(
                config.cpu_kernels, max_rows=config.max_num_batched_tokens, quantization=quantization
            )
            fused = optimize_for_cpu(
                self.model, chooser, max_logit_rows=config.max_num_seqs, lora=config.enable_lora
            )
            cpu_ops.FRESH_PREFILLS_BY_SDPA = chooser.fresh_prefills_by_sdpa(
                q_heads, kv_heads, head_dim, self.block_size, self.dtype
            )
            chooser.save()
            logger.info(chooser.describe())
            for where, why in chooser.kept_out.items():
                logger.warning("quantization='int8' keeps linear %s unquantized on this CPU: %s", where, why)
        # (input_ids [1, T], position_ids [1, T], rows) -> final hidden states [1, T, E] of
        # the packed rows `rows` ([R] indices; None: every row), [1, R, E]
        self.run_decoder = fused or _transformers_decoder(self.model.get_decoder())
        self.lm_head = self.model.get_output_embeddings()
        # Each target projection with max_loras slots for adapters' weights (replica/lora/).
        self.lora_layers = (
            wrap_targets(fused or self.model.get_decoder(), config.max_loras, config.max_lora_rank)
            if config.enable_lora
            else []
        )

        self.hf_config = hf
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        self.vocab_size = hf.vocab_size
        self.kv_layout = KVCacheLayout(
            self.backend, self.num_layers, self.block_size, kv_heads, head_dim, self.kv_dtype, self.device
        )
        self.kv_caches: KVCaches = []
        self.num_blocks = config.num_kv_blocks or self._size_kv_cache(config)
        if group is not None:  # every rank's cache must hold the blocks the scheduler hands out
            self.num_blocks = group.min(self.num_blocks, self.device)
        # One block more than the pool hands out: padded rows of graph batches write there.
        self.scratch_block = self.num_blocks
        self.kv_caches = self.kv_layout.allocate(self.num_blocks + 1)
        self.num_host_blocks = (
            kv_blocks_for_memory(config.kv_offloading_size, self.bytes_per_block)
            if config.kv_offloading_size
            else 0
        )
        if group is not None and self.num_host_blocks:
            self.num_host_blocks = group.min(self.num_host_blocks, self.device)
        self.host_kv = HostKVCache(self.kv_layout, self.num_host_blocks) if self.num_host_blocks else None
        self.weights = WeightsSummary.of(self.model, quantization)
        gib = self.bytes_per_block / 2**30
        logger.info(
            "weights: %s; KV cache: %s, %d blocks of %d tokens (%d tokens, %.2f GiB); "
            "host tier: %d blocks (%.2f GiB)",
            self.weights.describe(), str(self.kv_dtype).removeprefix("torch."), self.num_blocks,
            self.block_size, self.num_blocks * self.block_size, self.num_blocks * gib,
            self.num_host_blocks, self.num_host_blocks * gib,
        )  # fmt: skip
        # A request must fit the whole KV cache on its own, or it could never finish.
        limits = [config.max_model_len, getattr(hf, "max_position_embeddings", None)]
        self.max_model_len = min(x for x in [*limits, self.num_blocks * self.block_size] if x)

        # The cores each eager step may use (use_cores); None: the process's, unpinned.
        self.cores: CorePlan | None = None
        self.graphs: DecodeGraphRunner | None = None
        if config.enable_cuda_graphs and self.device.type == "cuda":
            if self.backend.graph_safe:
                self.graphs = self.build_graph_runner(min(config.max_num_seqs, config.cuda_graph_max_batch))
                self.graphs.capture()
                logger.info("captured CUDA graphs for decode batches %s", self.graphs.sizes)
            else:
                logger.info("CUDA graphs off: the %s attention backend cannot be captured", name)

    def rows_sharing_work(self, max_rows: int) -> int:
        """Up to how many rows (at most max_rows) kernels whose threads take work as they
        come free (the group kernels, and in an fp32 model linear_kernels.FP32_SHARING_KERNELS)
        run most of every step's linear time (kernel_choice.sharing_rows): a pinned replica
        runs those steps on every core, the serving processes' moments on one of them
        slowing mostly that core's share (replica/cpu/affinity.py)."""
        choices = [m.choice for m in self.model.modules() if isinstance(m, PackedLinear)]
        sharing = GROUP_SHARING_KERNELS + (FP32_SHARING_KERNELS if self.dtype == torch.float32 else ())
        return sharing_rows(choices, max_rows, sharing)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_layout.bytes_per_block

    def use_cores(self, plan: CorePlan) -> None:
        """For a serving replica that pins its threads: each eager step runs on the
        plan's cores for its size."""
        self.cores = plan

    async def check_alive(self) -> None:
        """The whole model is in this process: nothing else can be gone."""

    def build_graph_runner(self, max_batch: int) -> DecodeGraphRunner:
        """Padded decode over static buffers; the caller captures it (CUDA) or not (tests)."""
        return DecodeGraphRunner(
            self._forward,
            max_batch=max_batch,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            block_size=self.block_size,
            scratch_block=self.scratch_block,
            device=self.device,
            build_mask=self.backend.name == "torch",
            lora=bool(self.lora_layers),
        )

    def _size_kv_cache(self, config: EngineConfig) -> int:
        if self.device.type != "cuda":
            return kv_blocks_for_memory(config.kv_cache_memory_gb, self.bytes_per_block)
        return measure_kv_blocks_on_gpu(
            self.kv_layout, config.gpu_memory_utilization, lambda: self._profile_step(config)
        )

    @torch.inference_mode()
    def _profile_step(self, config: EngineConfig) -> None:
        """The largest step the scheduler can send (kv_sizing.largest_step), on a
        throwaway cache, then logits (and their softmax, standing in for the sampler)
        for up to max_num_seqs rows."""
        limits = [config.max_model_len, getattr(self.hf_config, "max_position_embeddings", None)]
        seq_len = min(x for x in [*limits, config.max_num_batched_tokens] if x)
        lens, tables = largest_step(config.max_num_batched_tokens, seq_len, self.block_size)
        self.kv_caches = self.kv_layout.allocate(sum(map(len, tables)))
        try:
            token_ids = [[0] * n for n in lens]
            hidden = self._forward_packed(token_ids, lens, tables)
            rows = min(config.max_num_seqs, hidden.shape[1])
            logits = self.lm_head(hidden[0, :rows])  # None on tensor-parallel ranks but the first
            if logits is not None:
                logits.float().softmax(dim=-1)
            torch.cuda.synchronize(self.device)
        finally:
            self.kv_caches = []

    @torch.inference_mode()
    def load_lora(self, slot: int, adapter: AdapterWeights | None) -> None:
        """Put an adapter's weights in `slot` of every target projection (None: clear it).
        Queued on the device's stream, so a step still running reads the old ones."""
        for layer in self.lora_layers:
            layer.set_slot(slot, adapter)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The decoder over one packed [1, T] batch -> hidden states [1, T, E], or [1, R, E]
        of the R packed rows `rows` (the others' last layer is cut short, see FusedDecoder)."""
        with forward_context(ForwardContext(self.kv_caches, meta, lora, self.kv_scales)):
            return self.run_decoder(input_ids, position_ids, rows)

    def _forward_packed(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        fill: Fill | None = None,
        rows: list[int] | None = None,
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """rows: the packed rows whose hidden states are wanted (None: all). lora_slots:
        each row's adapter slot (-1: none), or None where no row has an adapter."""
        packed = pack_inputs(
            token_ids, context_lens, block_tables, self.block_size, self.device, fill,
            decode_mask=self.backend.name == "torch",
        )  # fmt: skip
        if rows is not None:
            rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        lora = None
        if lora_slots is not None:
            token_slots = [slot for slot, tokens in zip(lora_slots, token_ids, strict=True) for _ in tokens]
            lora = LoRABatch(torch.tensor(token_slots, dtype=torch.long, device=self.device))
        return self._forward(packed.input_ids, packed.position_ids, packed.meta, rows, lora)

    def _share_fill(self, fill: Fill | None, fill_rows: list[int] | None) -> Fill | None:
        """Rank 0's device-held tokens, broadcast to the ranks that only know their rows."""
        if self.group.rank == 0:
            if fill is not None:
                self.group.broadcast(fill[1].contiguous())
            return fill
        if not fill_rows:
            return None
        tokens = torch.empty(len(fill_rows), dtype=torch.long, device=self.device)
        return fill_rows, self.group.broadcast(tokens)

    @torch.inference_mode()
    def execute(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
        fill: Fill | None = None,
        fill_rows: list[int] | None = None,
        prompt_rows: list[int] | None = None,
        lora_slots: list[int] | None = None,
        kv_copies: KVCopies | None = None,
    ) -> torch.Tensor | None:
        """One packed forward. Row i feeds token_ids[i] as the last tokens of a context of
        context_lens[i]; rows must be ordered decodes first. `fill` gives decode rows whose
        token is still on the device (async scheduling): (row indices, token ids on the
        device); their entries in token_ids are placeholders. Returns logits
        [len(sample_rows), V], in the model's dtype, for the last token of each row in
        sample_rows; None on tensor-parallel ranks other than 0, which are given the rows
        of `fill` as `fill_rows` and receive its tokens from rank 0.

        prompt_rows: packed token indices, ascending, whose logits are wanted too (prompt
        logprobs); their logits follow the sampling rows'. Such a step takes the eager
        path, whose row selection can pick any rows.

        lora_slots: each row's LoRA adapter slot (load_lora), -1 for the base model; None
        where no row has one.

        kv_copies: the host tier's block copies, run first (kvcache/host_tier.py)."""
        if kv_copies:
            self.host_kv.copy(kv_copies, self.kv_caches)
        if self.group is not None:
            fill = self._share_fill(fill, fill_rows)
        query_lens = [len(t) for t in token_ids]
        pure_decode = all(q == 1 for q in query_lens)
        graphs = self.graphs is not None and pure_decode and not prompt_rows
        if graphs and self.graphs.can_run(len(token_ids)):
            hidden = self.graphs.run([t[0] for t in token_ids], context_lens, block_tables, fill, lora_slots)
            hidden = hidden if len(sample_rows) == len(token_ids) else hidden[sample_rows]
        else:
            rows, order = rows_to_keep(query_lens, sample_rows, prompt_rows)
            if self.cores is not None:
                self.cores.pin_for_step(sum(query_lens))
            hidden = self._forward_packed(token_ids, context_lens, block_tables, fill, rows, lora_slots)[0]
            if order is not None:
                hidden = hidden[torch.tensor(order, dtype=torch.long, device=hidden.device)]
        if not sample_rows and not prompt_rows:
            return hidden.new_empty((0, self.vocab_size))
        return self.lm_head(hidden)
