"""Offline API: `LLM(model).generate(prompts, params)`, as in vLLM."""

from collections.abc import Sequence

from tqdm.auto import tqdm

from replica.chat_template import Message, chat_prompt_ids, default_chat_template, load_chat_template
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model_files import sampling_defaults
from wire.lora_request import LoRARequest
from wire.outputs import RequestOutput, merge_samples
from wire.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        chat_template: str | None = None,
        generation_config: str = "auto",
        **engine_args,
    ):
        """chat_template: instead of the model's, as in load_chat_template.
        generation_config: "auto" makes the sampling fields of the model's
        generation_config.json the parameters of a call that passes none, as vLLM's LLM
        does and as the server does for the fields a request leaves unset; "none" keeps
        SamplingParams' own."""
        if generation_config not in ("auto", "none"):
            raise ValueError(f'generation_config must be "auto" or "none", not {generation_config!r}')
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **engine_args))
        self.chat_template = load_chat_template(default_chat_template(model, chat_template))
        auto = generation_config == "auto"
        self._sampling_defaults = sampling_defaults(self.engine.model_path) if auto else {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams runs with (a new one each time, as in vLLM)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """priority: one per prompt, for an engine with scheduling_policy="priority"
        (lower values first), as in vLLM. lora_request: the adapter every prompt runs
        with, or one per prompt (None: the base model), for an engine with enable_lora."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")

        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")

        request_ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priorities, loras, strict=True):
                request_ids.append(self.engine.add_request(prompt, p, priority=rank, lora_request=lora))
        except Exception:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise

        samples: dict[str, list[RequestOutput]] = {i: [] for i in request_ids}
        generated = 0
        total = sum(p.n for p in params)
        with tqdm(total=total, desc="generate", unit="sample", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    generated += len(delta.new_token_ids)
                    if delta.finished:
                        samples[delta.request_id].append(delta.output)
                        bar.update(1)
                bar.set_postfix(tokens=generated, refresh=False)
        return [merge_samples(samples[i]) for i in request_ids]

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; uses the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, tools=tools, chat_template=self.chat_template)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts
