"""The contract between a replica and the processes that call it: the ingress (HTTP and
gRPC), the KV router, the coordinator and the metrics endpoint.

Everything that crosses that boundary is one of these dataclasses, so a renamed field
fails where it is read, with an AttributeError naming it, instead of as a missing dict
key in another process. The module imports nothing heavy: the ingress loads it without
torch or the engine.
"""

from dataclasses import dataclass, field

from wire.lora_request import LoRARequest
from wire.sampling_params import SamplingParams
from wire.spec_decode_stats import SpecDecodeStats


class QueueFullError(RuntimeError):
    """The replica's waiting queue is at `max_waiting`: the ingress answers 429."""


class EngineStepError(RuntimeError):
    """An engine step failed and every request on the replica was aborted: the ingress
    moves a request that already streamed tokens to another replica."""


@dataclass
class GenerateRequest:
    """One call of `LLMServer.generate`. The KV router reads the prompt and the sampling
    parameters from it to place the request."""

    prompt: list[int] | str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first (vLLM's priority scheduling)
    request_id: str | None = None
    # The output another replica already streamed, after which this one goes on (migration).
    resume_token_ids: list[int] | None = None
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class LogprobEntry:
    """One position's logprob, with its token's string: the replica decodes tokens, so
    that the tokenizer has one owner."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]
    rank: int | None = None  # 1 = the most likely token; set on prompt tokens' entries


@dataclass
class StreamChunk:
    """What one sample of a request produced since the replica's last send."""

    request_id: str
    replica_id: str
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None  # set on the sample's last chunk
    num_prompt_tokens: int
    num_output_tokens: int  # so far, this chunk included
    num_cached_tokens: int
    # With prompt_logprobs, once, on the sample's first chunk: None for the first token.
    prompt_logprobs: list[LogprobEntry | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ReplicaReport:
    """A replica's figures, pushed to the coordinator about every 100 ms and read by the
    KV router, the replica groups and the metrics endpoint."""

    node_id: str
    deployment: str  # which replica group (router/placement/replica_groups.py)
    device: str  # "cpu" or "cuda"
    tensor_parallel_size: int
    block_size: int
    max_model_len: int
    max_waiting: int | None
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_pending_blocks: int  # blocks admitted and waiting requests will still take
    num_preemptions: int
    cpu_affinity: list[int]  # the engine thread's cores
    torch_threads: int
    # A pinned CPU replica's steps of up to this many tokens run on every core, as bursts
    # do (affinity.CorePlan; the kernels its own timings chose decide); 0 otherwise.
    shared_rows: int = 0
    # What the weights are stored in (the quantization, else the model's dtype) and take
    # (tensor parallelism: rank 0's share), and what the KV cache holds.
    weight_dtype: str = ""
    weight_bytes: int = 0
    kv_cache_dtype: str = ""
    # LoRA: the adapters loaded here (least recently used first), those of running and of
    # waiting requests, and how many one step can serve (0: enable_lora is off).
    loras: list[str] = field(default_factory=list)
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    max_loras: int = 0
    # Speculative decoding: tokens proposed per step (0: no speculative_config, and no
    # vllm:spec_decode_* metrics), and the counters since the engine started.
    num_speculative_tokens: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # The newest cached block hashes, bounded; hashes are chained, so one stands for its prefix.
    cached_block_hashes: list[bytes] = field(default_factory=list)
    # The host KV tier (kv_offloading_size; 0 blocks: none): its size, its counters since
    # start (queries: blocks looked up past the device cache's hits; hits: blocks restored
    # from it) and its newest hashes, bounded like the device cache's.
    num_host_blocks: int = 0
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    num_offloaded_blocks: int = 0
    host_block_hashes: list[bytes] = field(default_factory=list)
    # How old the report was when last passed on: an age, not a time of day, so that
    # processes on nodes with different clocks agree on it.
    age_s: float = 0.0

    @property
    def accepting(self) -> bool:
        """False while its waiting queue is full: it would refuse another request."""
        return self.max_waiting is None or self.num_waiting < self.max_waiting
