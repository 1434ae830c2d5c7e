"""The engine's input side: a request as a caller gives it (a prompt, its sampling
parameters, a priority, an adapter, output already produced elsewhere) checked against
the model and the config, then turned into the Requests the scheduler runs, each with
what it owns: its detokenizer, its seeded generator, its grammar matcher. With n > 1 the
samples are requests of their own (sample_group.py)."""

import itertools
from dataclasses import replace

import torch

from replica.config import EngineConfig
from replica.constraints import GrammarCompiler
from replica.detokenizer import IncrementalDetokenizer
from replica.request import Request
from wire.lora_request import LoRARequest
from wire.messages import QueueFullError
from wire.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, runner):
        """runner: the model's (its vocabulary, context window, device and generation
        config)."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_model_len
        self.device = runner.device
        self.eos_token_ids = _eos_token_ids(runner.model.generation_config, tokenizer)
        # Built by the first constrained request; the engine masks logits with it.
        self.grammars: GrammarCompiler | None = None
        self._ids = itertools.count()

    def check_admission(self, num_waiting: int, priority: int) -> None:
        """Refuses a request the queue has no room for (max_waiting), and as vLLM a non-zero
        priority under a scheduling policy that would ignore it."""
        if self.config.max_waiting is not None and num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"{num_waiting} requests are already waiting (max_waiting)")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"got priority {priority}, but priority scheduling is not enabled "
                "(scheduling_policy is not 'priority')"
            )

    def check_prompt(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as token ids) and token ids, once they and the
        parameters' logit_bias fit the model."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but the context window is "
                f"{self.max_model_len} tokens (including at least one generated token)"
            )
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        return text, token_ids

    def next_id(self) -> str:
        """An id for a request whose caller gives none."""
        return str(next(self._ids))

    def requests(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: list[int] = (),
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> list[Request]:
        """The request, or with n > 1 its samples, the first of which the engine schedules
        at once (sample_group.py)."""
        if params.n == 1:
            if resume_token_ids:  # its prompt logprobs went out with its first chunk, elsewhere
                params = replace(params, prompt_logprobs=None)
            request = self._new_request(request_id, text, token_ids, params, priority=priority, lora=lora)
            if resume_token_ids:
                self._resume(request, list(resume_token_ids))
            return [request]
        if resume_token_ids:
            raise ValueError("only a request with n = 1 can be resumed")
        return [
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
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        matcher = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                self.grammars = GrammarCompiler(self.tokenizer)
            matcher = self.grammars.matcher(params.structured_outputs)
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
        vocab = self.vocab_size
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
                torch.rand(1, generator=request.generator, device=self.device)
        request.token_ids += output_ids


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """One of n samples: seeded samples draw from seed + index, as in vLLM. The prompt's
    logprobs are the first sample's: the others, deferred, take its cached prefix."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _eos_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """The model's end-of-sequence tokens: its generation config's and its tokenizer's."""
    ids = set()
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
