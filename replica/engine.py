"""The engine: scheduler (CPU bookkeeping) + model runner (device) + sampler +
detokenizer. `step()` runs one iteration of continuous batching and returns, for each
request that produced a token, only what is new (outputs.RequestDelta)."""

import itertools
import logging
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoTokenizer

from kvcache import KVCacheManager, KVStats
from replica.config import EngineConfig
from replica.constraints import GrammarCompiler, apply_logit_bias
from replica.cpu.affinity import CorePlan
from replica.detokenizer import IncrementalDetokenizer
from replica.lora.adapter_files import LoRAAdapterError, read_adapter
from replica.lora.cache import AdapterCache
from replica.lora.weights import AdapterWeights, load_adapter_weights
from replica.model_loader import resolve_model
from replica.model_runner import ModelRunner
from replica.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs, plan_prompt_rows
from replica.request import PENDING, FinishReason, Request
from replica.sample_group import SampleGroup
from replica.sampler import SamplerOutput, sample, torch_argmax
from replica.sampling_state import SamplingState
from replica.scheduler import ScheduledRequest, Scheduler
from replica.spec_decode.speculator import Speculator, proposal_rows
from replica.spec_decode.verify import Verified
from wire.lora_request import LoRARequest

# The errors cross to the ingress (wire.py); EngineStepError is imported for the callers
# that know it as replica.engine.EngineStepError.
from wire.messages import EngineStepError, QueueFullError  # noqa: F401
from wire.outputs import RequestDelta, TokenLogprob
from wire.sampling_params import SamplingParams
from wire.spec_decode_stats import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    kv: KVStats
    num_running: int
    num_waiting: int
    num_pending_blocks: int
    num_preemptions: int
    # LoRA: adapters loaded (least recently used first), of running and of waiting requests
    loras: list[str]
    running_loras: list[str]
    waiting_loras: list[str]
    # Speculative decoding's counters since start (all zero without speculative_config)
    spec_decode: SpecDecodeStats


@dataclass
class _InFlight:
    """A launched step: the requests that sample, in row order, and their tokens, which
    stay on the device until the step is completed."""

    requests: list[Request]
    sampled: SamplerOutput | None
    prompt_logprobs: PromptLogprobs | None = None
    # Speculating requests' verified tokens, already on the host (such steps run in step).
    verified: list[tuple[Request, Verified]] = field(default_factory=list)


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
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        # LoRA adapters loaded in host memory (replica/lora/); None with enable_lora off.
        self.loras = AdapterCache(config.max_cpu_loras or config.max_loras) if config.enable_lora else None
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = _eos_ids(self.runner.model.generation_config, self.tokenizer)
        self._requests: dict[str, Request] = {}
        self.sampling = SamplingState(config.max_num_seqs, self.runner.vocab_size, self.runner.device)
        # The backend's sampling kernels where it has them (the CPU one reads bf16 logits).
        self._argmax = self.runner.backend.argmax or torch_argmax
        self._temperature_sample = self.runner.backend.temperature_sample
        # Overlap host work with the device's: worth it where they are separate (CUDA).
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.device.type == "cuda"
        )
        self._in_flight: _InFlight | None = None
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built by the first constrained request
        self._groups: dict[str, SampleGroup] = {}  # n > 1, by the caller's id
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
        waiting = len(self.scheduler.waiting)
        if self.config.max_waiting is not None and waiting >= self.config.max_waiting:
            raise QueueFullError(f"{waiting} requests are already waiting (max_waiting)")
        self._check_priority(priority)
        if lora_request is not None:
            self.add_lora(lora_request)
        return self._add(
            prompt, params or SamplingParams(), request_id, resume_token_ids or [], priority, lora_request
        )

    def read_lora(self, lora: LoRARequest) -> AdapterWeights:
        """An adapter's weights, read from its files and checked against this model. Touches
        no engine state, so a server runs it off the engine's thread, then add_lora."""
        if self.loras is None:
            raise LoRAAdapterError("LoRA adapters are off: start the engine with enable_lora=True")
        spec = read_adapter(lora.lora_path, self.runner.hf_config.to_dict(), self.config.max_lora_rank)
        return load_adapter_weights(spec, self.runner.dtype)

    def add_lora(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Keep an adapter loaded (read_lora's weights, or read now), dropping the least
        recently used idle one past max_cpu_loras. Raises LoRAAdapterError if it cannot
        be served."""
        if self.loras is None:
            raise LoRAAdapterError("LoRA adapters are off: start the engine with enable_lora=True")
        if lora in self.loras:
            self.loras.get(lora)  # now the most recently used
            return
        self.loras.put(lora, weights or self.read_lora(lora), self._loras_in_use())

    def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter that no request uses; False if it is not loaded or in use."""
        return self._drop_loras(lambda lora: lora.lora_name == lora_name)

    def retain_loras(self, lora_int_ids: frozenset[int]) -> None:
        """Drop the loaded adapters whose ids are not among these, once no request uses them."""
        self._drop_loras(lambda lora: lora.lora_int_id not in lora_int_ids)

    def _drop_loras(self, which) -> bool:
        if self.loras is None:
            return False
        in_use = self._loras_in_use()
        dropped = [lora for lora in self.loras.adapters() if which(lora) and lora not in in_use]
        for lora in dropped:
            self.loras.remove(lora)
        return bool(dropped)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded, least recently used first."""
        return [] if self.loras is None else self.loras.adapters()

    def _loras_in_use(self) -> set[LoRARequest]:
        requests = [*self._requests.values(), *(r for g in self._groups.values() for r in g.deferred)]
        return {r.lora for r in requests if r.lora is not None}

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
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, token_ids = None, list(prompt)
        self._check_prompt(token_ids)
        self._check_logit_bias(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests or request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            if resume_token_ids:  # its prompt logprobs went out with its first chunk, elsewhere
                params = replace(params, prompt_logprobs=None)
            request = self._new_request(request_id, text, token_ids, params, priority=priority, lora=lora)
            if resume_token_ids:
                self._resume(request, list(resume_token_ids))
            self._admit(request)
            return request_id
        if resume_token_ids:
            raise ValueError("only a request with n = 1 can be resumed")
        samples = [
            self._new_request(
                f"{request_id}#{i}",
                text,
                token_ids,
                _sample_params(params, i),
                group_id=request_id,
                index=i,
                priority=priority,
                lora=lora,
            )
            for i in range(params.n)
        ]
        self._groups[request_id] = SampleGroup.of(request_id, samples)
        self._admit(samples[0])
        return request_id

    def _new_request(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        group_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> Request:
        room = self.max_model_len - len(token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        matcher = None
        if params.structured_outputs is not None:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer)
            matcher = self._grammars.matcher(params.structured_outputs)
        # A grammar decides where constrained output ends: stop strings would cut it short.
        stop = params.stop if matcher is None else []
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=min(params.max_tokens or room, room),
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, stop),
            generator=generator,
            matcher=matcher,
            group_id=group_id,
            index=index,
            priority=priority,
            lora=lora,
        )

    def _resume(self, request: Request, output_ids: list[int]) -> None:
        """Replay output sampled elsewhere through everything that follows a request's
        tokens: its detokenizer (the text already sent, and what a stop string holds
        back), its grammar, and its seeded generator (one draw per token sampled at a
        temperature). It is then where a preempted request is: its KV is recomputed."""
        vocab = self.runner.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in output_ids):
            raise ValueError(f"resume_token_ids must be integers in [0, {vocab})")
        if len(output_ids) >= request.max_tokens:
            raise ValueError(
                f"resume_token_ids has {len(output_ids)} tokens; max_tokens is {request.max_tokens}"
            )
        draws = request.generator is not None and not request.params.greedy
        for token in output_ids:
            if request.detokenizer.add_token(token).stopped or request.is_stop_token(token):
                raise ValueError("resume_token_ids already end the request (a stop string or token)")
            if request.matcher is not None and not request.matcher.consume_token(token):
                raise ValueError(f"resume_token_ids: the grammar rejects token {token}")
            if draws:
                torch.rand(1, generator=request.generator, device=self.runner.device)
        request.token_ids += output_ids

    def _admit(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request)

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
        self.kv.reset_prefix_cache(before.prefix_cache_queries, before.prefix_cache_hits)

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
        """One iteration: schedule and run a forward pass, sample, and return what the
        requests produced. With async scheduling, the step returns what the *previous*
        launch sampled: it launches its own work first and reads the previous tokens while
        the device runs it, so the device never waits for the host between steps."""
        # A grammar masks a request's logits after consuming its previous token, so while a
        # running request is constrained the step reads the tokens in flight first. A waiting
        # one has none in flight, and it is running by the step that launches its second.
        # A proposal starts from a request's newest token, so a step that may speculate
        # runs in step too.
        in_step = any(r.constrained for r in self.scheduler.running) or (
            self.speculator is not None and self.speculator.may_speculate()
        )
        if self.async_scheduling and not in_step:
            launched = self._launch()
            previous, self._in_flight = self._in_flight, launched
            return self._complete(previous) if previous is not None else []
        # In step: a grammar must see a request's previous token before masking its next.
        outputs = self._complete(self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        launched = self._launch()
        return outputs + (self._complete(launched) if launched is not None else [])

    def _launch(self) -> _InFlight | None:
        if self.speculator is not None:
            self.speculator.propose()
        plan = self.scheduler.schedule()
        for request in plan.preempted:
            self.sampling.remove(request.request_id)
            if self.speculator is not None:
                self.speculator.drop(request.request_id)
        if not plan.scheduled:
            return None
        # The runner wants decode rows (one new token) first.
        items = sorted(plan.scheduled, key=lambda s: s.num_new_tokens != 1)
        token_ids = [s.new_token_ids for s in items]
        sample_rows = [i for i, s in enumerate(items) if s.produces_token]
        # A decode row whose input is the previous launch's sampled token (async only)
        # reads it on the device: (its row here, its row in the previous SamplerOutput).
        pending = [(i, s.request.pending_row) for i, s in enumerate(items) if token_ids[i] == [PENDING]]
        fill = None
        if pending:
            rows, sources = zip(*pending, strict=True)
            device = self.runner.device
            previous = self._in_flight.sampled.token_ids
            fill = (list(rows), previous[torch.tensor(sources, device=device)])
        prompt = plan_prompt_rows(items)
        # A speculating row's logits are wanted at each proposed token's position too.
        spec_rows = proposal_rows(items)
        extra_rows = sorted([*(prompt.rows if prompt is not None else []), *spec_rows])
        for slot, lora in plan.lora_loads:
            self.runner.load_lora(slot, self.loras.get(lora))
        logits = self.runner.execute(
            token_ids=token_ids,
            context_lens=[s.context_len for s in items],
            block_tables=[self.kv.block_ids(s.request.request_id) for s in items],
            sample_rows=sample_rows,
            fill=fill,
            prompt_rows=extra_rows or None,
            lora_slots=self._lora_slots(items),
        )
        self.scheduler.advance(plan)
        prompt_logprobs = None
        extra_logits = logits[len(sample_rows) :]  # the extra rows' logits follow the sampling rows'
        logits = logits[: len(sample_rows)]
        if prompt is not None:
            prompt_logprobs = compute_prompt_logprobs(_rows_of(extra_logits, extra_rows, prompt.rows), prompt)
        verified = []
        if spec_rows:
            spec_logits = _rows_of(extra_logits, extra_rows, spec_rows)
            verified = self.speculator.verify(items, sample_rows, logits, spec_logits, self._grammars)
            keep = [j for j, i in enumerate(sample_rows) if not items[i].num_spec_tokens]
            sample_rows = [sample_rows[j] for j in keep]
            logits = logits[keep]
        requests = [items[i].request for i in sample_rows]
        if not requests:
            return _InFlight([], None, prompt_logprobs, verified)
        if any(r.edits_logits for r in requests):
            self._edit_logits(logits, requests)
        sampled = sample(logits, self.sampling.batch(requests), self._argmax, self._temperature_sample)
        self.sampling.record(requests, sampled.token_ids)
        for row, request in enumerate(requests):  # placeholders until the tokens are read
            request.token_ids.append(PENDING)
            request.num_pending += 1
            request.pending_row = row
        return _InFlight(requests, sampled, prompt_logprobs, verified)

    def _lora_slots(self, items: list[ScheduledRequest]) -> list[int] | None:
        """Each row's adapter slot (-1: the base model), or None if no row has one."""
        if not any(s.request.lora is not None for s in items):
            return None
        slot_of = self.scheduler.lora_slots.slot_of
        return [-1 if s.request.lora is None else slot_of(s.request.lora) for s in items]

    def _complete(self, launched: _InFlight) -> list[RequestDelta]:
        if launched.prompt_logprobs is not None:  # before the tokens: a first delta carries them
            launched.prompt_logprobs.resolve()
        outputs = [self._append_verified(r, v) for r, v in launched.verified if not r.is_finished]
        if launched.sampled is None:
            return outputs
        tokens, logprobs = launched.sampled.resolve()
        return outputs + [
            self._append_token(r, token, logprob)
            for r, token, logprob in zip(launched.requests, tokens, logprobs, strict=True)
            # Finished (stop, length or abort) while this token was in flight: it is dropped.
            if not r.is_finished
        ]

    def _append_verified(self, request: Request, verified: Verified) -> RequestDelta:
        """Append a verified proposal's tokens one by one, as sampled ones, up to the first
        that finishes the request; one delta carries them all."""
        deltas = []
        for i, token in enumerate(verified.token_ids):
            request.token_ids.append(PENDING)
            request.num_pending += 1
            logprob = verified.logprobs[i] if verified.logprobs is not None else None
            deltas.append(self._append_token(request, token, logprob))
            if request.is_finished:
                break
        return _merge_deltas(deltas)

    @torch.inference_mode()  # the logits are inference tensors
    def _edit_logits(self, logits: torch.Tensor, requests: list[Request]) -> None:
        biased = [(row, r.params.logit_bias) for row, r in enumerate(requests) if r.params.logit_bias]
        if biased:
            apply_logit_bias(logits, *map(list, zip(*biased, strict=True)))
        constrained = [(row, r.matcher) for row, r in enumerate(requests) if r.matcher is not None]
        if constrained:
            self._grammars.mask(logits, *map(list, zip(*constrained, strict=True)))

    def stats(self) -> EngineStats:
        return EngineStats(
            kv=self.kv.stats(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_pending_blocks=self.scheduler.num_pending_blocks(),
            num_preemptions=self.scheduler.num_preemptions,
            loras=[lora.lora_name for lora in self.list_loras()],
            running_loras=_names(r.lora for r in self.scheduler.running),
            waiting_loras=_names(r.lora for r in self.scheduler.waiting),
            spec_decode=self._spec_stats(),
        )

    def _spec_stats(self) -> SpecDecodeStats:
        """A copy: the stats cross to other threads while the engine steps."""
        if self.speculator is None:
            return SpecDecodeStats()
        stats = self.speculator.stats
        return replace(stats, accepted_per_pos=list(stats.accepted_per_pos))

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestDelta:
        """Fill the request's oldest placeholder with its sampled token, then detokenize
        and check the stop conditions."""
        request.token_ids[len(request.token_ids) - request.num_pending] = token
        request.num_pending -= 1
        if logprob is not None:
            request.logprobs.append(logprob)
        update = request.detokenizer.add_token(token)
        new_text = update.new_text
        first = request.num_output_tokens == request.num_pending + 1
        if first and request.group_id is not None:  # its prefill is done: the prompt is cached
            for sample in self._groups[request.group_id].release_deferred():
                self._admit(sample)

        grammar_done = request.matcher is not None and self._advance_grammar(request, token)
        reason = None
        if update.stopped or request.is_stop_token(token) or grammar_done:
            reason = FinishReason.STOP
        elif request.num_output_tokens - request.num_pending >= request.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            new_text += request.detokenizer.flush()
            self._finish(request, reason)
        return RequestDelta(
            request_id=request.caller_id,
            new_token_ids=[token],
            new_text=new_text,
            new_logprobs=None if logprob is None else [logprob],
            finish_reason=reason.value if reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens - request.num_pending,
            num_cached_tokens=request.num_cached_tokens,
            output=request.output() if reason else None,
            index=request.index,
            prompt_logprobs=request.prompt_logprobs if first else None,
        )

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feed the grammar its token; True once it is complete, which ends the request
        (even with ignore_eos: nothing more would be allowed)."""
        if not request.matcher.consume_token(token):
            logger.warning("grammar rejected token %d: %s", token, request.matcher.get_error())
            return True
        return request.matcher.is_stopped()

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.runner.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but the context window is "
                f"{self.max_model_len} tokens (including at least one generated token)"
            )

    def _check_priority(self, priority: int) -> None:
        """As vLLM: a non-zero priority under a policy that would ignore it is refused."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"got priority {priority}, but priority scheduling is not enabled "
                "(scheduling_policy is not 'priority')"
            )

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")

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

    # What a serving replica (replica/server/deployment.py) asks of the engine's runner and KV
    # cache, so that it depends on the engine alone.

    @property
    def device_type(self) -> str:
        """Where the model runs: "cpu" or "cuda"."""
        return self.runner.device.type

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


def _rows_of(extra_logits: torch.Tensor, extra_rows: list[int], rows: list[int]) -> torch.Tensor:
    """The logits of `rows`, a subset of the step's extra rows (ascending)."""
    if len(rows) == len(extra_rows):
        return extra_logits
    position = {row: j for j, row in enumerate(extra_rows)}
    return extra_logits[torch.tensor([position[r] for r in rows], device=extra_logits.device)]


def _merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """One delta for several tokens appended in a row."""
    logprobs = None if deltas[0].new_logprobs is None else [lp for d in deltas for lp in d.new_logprobs]
    return replace(
        deltas[-1],
        new_token_ids=[t for d in deltas for t in d.new_token_ids],
        new_text="".join(d.new_text for d in deltas),
        new_logprobs=logprobs,
        prompt_logprobs=deltas[0].prompt_logprobs,
    )


def _names(loras) -> list[str]:
    return sorted({lora.lora_name for lora in loras if lora is not None})


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """One of n samples: seeded samples draw from seed + index, as in vLLM. The prompt's
    logprobs are the first sample's: the others, deferred, take its cached prefix."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _eos_ids(generation_config, tokenizer) -> frozenset[int]:
    ids = set()
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
