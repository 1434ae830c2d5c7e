"""The engine: scheduler (CPU bookkeeping) + model runner (device) + sampler +
detokenizer. `step()` runs one iteration of continuous batching."""

import itertools
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from kvcache import KVCacheManager, KVStats
from replica.config import EngineConfig
from replica.detokenizer import IncrementalDetokenizer
from replica.model_loader import resolve_model
from replica.model_runner import ModelRunner
from replica.outputs import CompletionOutput, RequestOutput
from replica.request import FinishReason, Request, TokenLogprob
from replica.sampler import SamplingBatch, sample
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler


class QueueFullError(RuntimeError):
    """The waiting queue is at max_waiting; the caller should retry elsewhere or later."""


@dataclass
class EngineStats:
    kv: KVStats
    num_running: int
    num_waiting: int
    num_pending_blocks: int
    num_preemptions: int


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.runner = ModelRunner(config, self.model_path)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.scheduling_policy
        )
        hf = self.runner.hf_config
        # A request must fit the whole KV cache on its own, or it could never finish.
        limits = [config.max_model_len, getattr(hf, "max_position_embeddings", None)]
        limits.append(self.runner.num_blocks * config.block_size)
        self.max_model_len = min(x for x in limits if x)
        self.eos_token_ids = _eos_ids(self.runner.model.generation_config, self.tokenizer)
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._ids = itertools.count()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, token_ids = None, list(prompt)
        self._check_prompt(token_ids)
        waiting = len(self.scheduler.waiting)
        if self.config.max_waiting is not None and waiting >= self.config.max_waiting:
            raise QueueFullError(f"{waiting} requests are already waiting (max_waiting)")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=min(params.max_tokens or room, room),
            eos_token_ids=self.eos_token_ids,
            prompt=text,
        )
        self._requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop)
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
            self._generators[request_id] = generator
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.scheduler.finish(request, FinishReason.ABORT)
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        # The runner wants decode rows (one new token) first.
        items = sorted(plan.scheduled, key=lambda s: s.num_new_tokens != 1)
        sample_rows = [i for i, s in enumerate(items) if s.samples]
        logits = self.runner.execute(
            token_ids=[s.new_token_ids for s in items],
            context_lens=[s.context_len for s in items],
            block_tables=[self.kv.block_ids(s.request.request_id) for s in items],
            sample_rows=sample_rows,
        )
        self.scheduler.advance(plan)
        if not sample_rows:
            return []

        requests = [items[i].request for i in sample_rows]
        batch = SamplingBatch.from_requests(
            requests,
            [self._generators.get(r.request_id) for r in requests],
            logits.shape[-1],
            logits.device,
        )
        sampled = sample(logits, batch)
        return [
            self._append_token(r, token, logprob)
            for r, token, logprob in zip(requests, sampled.token_ids, sampled.logprobs, strict=True)
        ]

    def stats(self) -> EngineStats:
        return EngineStats(
            kv=self.kv.stats(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_pending_blocks=self.scheduler.num_pending_blocks(),
            num_preemptions=self.scheduler.num_preemptions,
        )

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        request.token_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        detokenizer = self._detokenizers[request.request_id]
        update = detokenizer.add_token(token)
        new_text = update.new_text

        hit_eos = token in request.eos_token_ids and not request.params.ignore_eos
        reason = None
        if update.stopped or hit_eos or token in request.params.stop_token_ids:
            reason = FinishReason.STOP
        elif request.num_output_tokens >= request.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            new_text += detokenizer.flush()
            self.scheduler.finish(request, reason)
            self._forget(request.request_id)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    text=detokenizer.emitted_text,
                    token_ids=list(request.output_token_ids),
                    finish_reason=reason.value if reason else None,
                    logprobs=list(request.logprobs) if request.logprobs is not None else None,
                )
            ],
            finished=reason is not None,
            new_text=new_text,
            new_token_ids=[token],
            num_cached_tokens=request.num_cached_tokens,
        )

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

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        self._generators.pop(request_id, None)


def _eos_ids(generation_config, tokenizer) -> frozenset[int]:
    ids = set()
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
