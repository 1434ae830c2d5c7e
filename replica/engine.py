"""The engine: scheduler (CPU bookkeeping) + model runner (device) + sampler, between an
input processor (a caller's request checked and turned into Requests) and an output
processor (sampled tokens put into their requests, detokenized, stop-checked).
`step()` runs one iteration of continuous batching and returns, for each request that
produced a token, only what is new (outputs.RequestDelta)."""

from dataclasses import replace

import torch
from transformers import AutoTokenizer

from kvcache import KVCacheManager
from replica.config import EngineConfig
from replica.constraints import edit_logits
from replica.cpu.affinity import BURST_MIN_TOKENS, CorePlan
from replica.engine_stats import EngineStats
from replica.input_processor import InputProcessor
from replica.lora.adapter_files import LoRAAdapterError
from replica.lora.manager import LoRAManager
from replica.lora.weights import AdapterWeights
from replica.model_loader import resolve_model
from replica.model_runner import ModelRunner
from replica.output_processor import InFlight, OutputProcessor
from replica.prompt_logprobs import compute_prompt_logprobs
from replica.request import PENDING, FinishReason, Request
from replica.sample_group import SampleGroup
from replica.sampler import sample, torch_argmax
from replica.sampling_state import SamplingState
from replica.scheduler import Scheduler
from replica.spec_decode.speculator import Speculator
from replica.step_rows import StepRows
from wire.lora_request import LoRARequest

# The errors cross to the ingress (wire.py); EngineStepError is imported for the callers
# that know it as replica.engine.EngineStepError.
from wire.messages import EngineStepError, QueueFullError  # noqa: F401
from wire.outputs import RequestDelta
from wire.sampling_params import SamplingParams


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model(config.model, config.revision)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(config, self.model_path)
        else:
            from replica.parallel.tp_runner import TensorParallelRunner  # Ray, only where needed

            self.runner = TensorParallelRunner(config, self.model_path)
        # The attention backend may change the block size (flash-attn pages are multiples of
        # 256); everything downstream (KV manager, stats, routing) uses the runner's.
        self.config = config = replace(config, block_size=self.runner.block_size)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            num_host_blocks=self.runner.num_host_blocks,
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        # LoRA adapters (replica/lora/); None with enable_lora off.
        self.loras = (
            LoRAManager(config, self.runner, self.scheduler.lora_slots) if config.enable_lora else None
        )
        self.max_model_len = self.runner.max_model_len
        self.input_processor = InputProcessor(config, self.tokenizer, self.runner)
        self.eos_token_ids = self.input_processor.eos_token_ids
        self.output_processor = OutputProcessor(self._finish, self._release_samples)
        self._requests: dict[str, Request] = {}
        self._groups: dict[str, SampleGroup] = {}  # n > 1, by the caller's id
        self.sampling = SamplingState(config.max_num_seqs, self.runner.vocab_size, self.runner.device)
        # The backend's sampling kernels where it has them (the CPU one reads bf16 logits).
        self._argmax = self.runner.backend.argmax or torch_argmax
        self._fused_sample = self.runner.backend.fused_sample
        # Overlap host work with the device's: worth it where they are separate (CUDA).
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self._in_flight: InFlight | None = None
        self.speculator = (  # speculative decoding (replica/spec_decode/), with a speculative_config
            Speculator(config, self.scheduler, self.runner.vocab_size, self.runner.num_blocks)
            if config.speculative_config is not None
            else None
        )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """resume_token_ids: output a request already produced elsewhere (a replica that
        died mid-stream); the request continues after it as if it had sampled it here.
        priority: under the priority scheduling policy, lower values are served first; as
        in vLLM, a request attribute rather than a sampling parameter. lora_request: the
        adapter to run with, loaded here first if it is not yet (add_lora)."""
        self.input_processor.check_admission(len(self.scheduler.waiting), priority)
        if lora_request is not None:
            self.add_lora(lora_request)
        return self._add(
            prompt, params or SamplingParams(), request_id, resume_token_ids or [], priority, lora_request
        )

    def _add(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None,
        resume_token_ids: list[int] = (),
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> str:
        """With n > 1 the samples are requests of their own, in a SampleGroup: only the
        first is scheduled at once, the others once its prefill has cached the prompt."""
        text, token_ids = self.input_processor.check_prompt(prompt, params)
        request_id = request_id if request_id is not None else self.input_processor.next_id()
        if request_id in self._requests or request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = self.input_processor.requests(
            request_id, text, token_ids, params, resume_token_ids, priority, lora
        )
        if len(samples) > 1:
            self._groups[request_id] = SampleGroup.of(request_id, samples)
        self._admit(samples[0])
        return request_id

    def _admit(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def _release_samples(self, group_id: str) -> None:
        """A group's first sample has its first token: its prefill has cached the prompt."""
        for deferred in self._groups[group_id].release_deferred():
            self._admit(deferred)

    def read_lora(self, lora: LoRARequest) -> AdapterWeights:
        """An adapter's weights, read from its files and checked against this model. Touches
        no engine state, so a server runs it off the engine's thread, then add_lora."""
        return self._lora_manager().read(lora)

    def add_lora(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Keep an adapter loaded (read_lora's weights, or read now), dropping the least
        recently used idle one past max_cpu_loras. Raises LoRAAdapterError if it cannot
        be served."""
        self._lora_manager().add(lora, weights, self._loras_in_use())

    def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter that no request uses; False if it is not loaded or in use."""
        return self.loras is not None and self.loras.remove(lora_name, self._loras_in_use())

    def retain_loras(self, lora_int_ids: frozenset[int]) -> None:
        """Drop the loaded adapters whose ids are not among these, once no request uses them."""
        if self.loras is not None:
            self.loras.retain(lora_int_ids, self._loras_in_use())

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded, least recently used first."""
        return [] if self.loras is None else self.loras.adapters()

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise LoRAAdapterError("LoRA adapters are off: start the engine with enable_lora=True")
        return self.loras

    def _loras_in_use(self) -> set[LoRARequest]:
        requests = [*self._requests.values(), *(r for g in self._groups.values() for r in g.deferred)]
        return {r.lora for r in requests if r.lora is not None}

    def warm_up(self, num_tokens: int = 256) -> None:
        """Run a prefill of about num_tokens over two dummy requests and a few decode
        steps, greedy and sampled, so that a server's first request does not pay for
        lazy initialisation (CUDA context, Triton JIT; on CPU it changes little). Then
        forget them: the prefix cache is emptied and its counters are left as they were."""
        if self.has_unfinished():
            raise RuntimeError("warm_up runs while no request is in the engine")
        before = self.kv.stats()
        prompt_len = max(1, min(num_tokens // 2, self.max_model_len - 4))
        vocab = self.runner.vocab_size
        for i, temperature in enumerate((0.0, 1.0)):
            prompt = [(i * prompt_len + t) % vocab for t in range(prompt_len)]
            params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
            self._add(prompt, params, f"kvserve-warm-up-{i}")  # past max_waiting, which may be 0
        while self.has_unfinished():
            self.step()
        self.kv.reset_prefix_cache(before)

    def abort(self, request_id: str) -> bool:
        """request_id: the caller's; with n > 1 it aborts every sample."""
        group = self._groups.get(request_id)
        ids = group.unfinished if group is not None else {request_id}
        requests = [self._requests[i] for i in list(ids) if i in self._requests]
        for request in requests:  # the group goes with its last sample
            self._finish(request, FinishReason.ABORT)
        return bool(requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """One iteration: schedule, run a forward pass, sample, and update the requests
        with what they produced. With async scheduling, the step returns what the
        *previous* launch sampled: it launches its own work first and reads the previous
        tokens while the device runs it, so the device never waits for the host between
        steps."""
        overlap = self.async_scheduling and not self._needs_previous_tokens()
        outputs = []
        if not overlap and self._in_flight is not None:
            outputs, self._in_flight = self.output_processor.update(self._in_flight), None
        rows = self._schedule()
        launched = self._sample(rows, self._execute(rows)) if rows is not None else None
        done, self._in_flight = (self._in_flight, launched) if overlap else (launched, None)
        return outputs + (self.output_processor.update(done) if done is not None else [])

    def _needs_previous_tokens(self) -> bool:
        """Whether this step reads the tokens in flight before launching its own. A grammar
        masks a request's logits after consuming its previous token, so while a running
        request is constrained it does. A waiting one has none in flight, and it is running
        by the step that launches its second. A proposal starts from a request's newest
        token, so a step that may speculate does too."""
        return any(r.constrained for r in self.scheduler.running) or (
            self.speculator is not None and self.speculator.may_speculate()
        )

    def _schedule(self) -> StepRows | None:
        """Proposals first, which the scheduler schedules with their requests; a preempted
        request gives back its sampling slot and its proposer's state."""
        if self.speculator is not None:
            self.speculator.propose()
        plan = self.scheduler.schedule()
        for request in plan.preempted:
            self.sampling.remove(request.request_id)
            if self.speculator is not None:
                self.speculator.drop(request.request_id)
        return StepRows.of(plan) if plan.scheduled else None

    def _execute(self, rows: StepRows) -> torch.Tensor:
        """The forward pass: the logits of the sampling rows, then of the extra rows."""
        if rows.plan.lora_loads:
            self.loras.load_slots(rows.plan.lora_loads)
        logits = self.runner.execute(
            token_ids=rows.token_ids,
            context_lens=[s.context_len for s in rows.items],
            block_tables=[self.kv.block_ids(s.request.request_id) for s in rows.items],
            sample_rows=rows.sample_rows,
            fill=rows.fill(self._in_flight, self.runner.device),
            prompt_rows=rows.extra_rows or None,
            lora_slots=self.loras.row_slots(rows.items) if self.loras is not None else None,
            kv_copies=self.kv.take_copies(),
        )
        self.scheduler.advance(rows.plan)
        return logits

    def _sample(self, rows: StepRows, logits: torch.Tensor) -> InFlight:
        """Sample the step's tokens, left on the device until the step is updated; verify
        the speculating rows' proposals; compute the prompt logprobs asked for."""
        items, sample_rows = rows.items, rows.sample_rows
        prompt_logprobs = None
        extra_logits = logits[len(sample_rows) :]
        logits = logits[: len(sample_rows)]
        if rows.prompt is not None:
            prompt_logprobs = compute_prompt_logprobs(
                rows.logits_of(extra_logits, rows.prompt.rows), rows.prompt
            )
        verified = []
        if rows.spec_rows:
            spec_logits = rows.logits_of(extra_logits, rows.spec_rows)
            grammars = self.input_processor.grammars
            verified = self.speculator.verify(items, sample_rows, logits, spec_logits, grammars)
            keep = [j for j, i in enumerate(sample_rows) if not items[i].num_spec_tokens]
            sample_rows = [sample_rows[j] for j in keep]
            logits = logits[keep]
        requests = [items[i].request for i in sample_rows]
        if not requests:
            return InFlight([], None, prompt_logprobs, verified)
        if any(r.edits_logits for r in requests):
            edit_logits(logits, requests, self.input_processor.grammars)
        sampled = sample(logits, self.sampling.batch(requests), self._argmax, self._fused_sample)
        self.sampling.record(requests, sampled.token_ids)
        for row, request in enumerate(requests):  # placeholders until the tokens are read
            request.token_ids.append(PENDING)
            request.num_pending += 1
            request.pending_row = row
        return InFlight(requests, sampled, prompt_logprobs, verified)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish(request, reason)
        self.sampling.remove(request.request_id)
        self._requests.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.drop(request.request_id)
        group = self._groups.get(request.group_id) if request.group_id is not None else None
        if group is not None and group.finish(request):
            del self._groups[request.group_id]
        if request.num_pending:  # tokens still in flight past the end: never part of the output
            del request.token_ids[len(request.token_ids) - request.num_pending :]
            request.num_pending = 0

    def stats(self) -> EngineStats:
        return EngineStats.of(self.scheduler, self.list_loras(), self.speculator)

    # What a serving replica (replica/server/deployment.py) asks of the engine's runner and KV
    # cache, so that it depends on the engine alone.

    @property
    def device_type(self) -> str:
        """Where the model runs: "cpu" or "cuda"."""
        return self.runner.device.type

    def rows_sharing_work(self) -> int:
        """Up to how many tokens a step runs mostly on kernels whose threads take work as
        they come free (ModelRunner.rows_sharing_work), counted up to a burst's size
        (affinity.BURST_MIN_TOKENS); 0 with tensor parallelism."""
        runner = self.runner
        if not isinstance(runner, ModelRunner):
            return 0
        return runner.rows_sharing_work(BURST_MIN_TOKENS - 1)

    def pin_to_cores(self, plan: CorePlan) -> None:
        """Run each eager step on the plan's cores (the caller pins the process itself)."""
        self.runner.use_cores(plan)
        if self.speculator is not None:
            self.speculator.use_cores(plan)

    async def check_alive(self) -> None:
        """Raises when a part of the engine outside this process (a tensor-parallel
        worker) is gone: its steps fail from then on."""
        await self.runner.check_alive()

    def cached_prefix_summary(self, limit: int) -> list[bytes]:
        """The newest cached block hashes, at most `limit`; see KVCacheManager."""
        return self.kv.cached_prefix_summary(limit)

    def host_prefix_summary(self, limit: int) -> list[bytes]:
        """The same for the host KV tier (none without kv_offloading_size)."""
        return self.kv.host_prefix_summary(limit)
