"""Offline API: `LLM(model).generate(prompts, params)`, as in vLLM."""

from collections.abc import Sequence

from tqdm.auto import tqdm

from replica.config import EngineConfig
from replica.engine import Engine
from replica.outputs import RequestOutput
from replica.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")

        request_ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise

        results: dict[str, RequestOutput] = {}
        generated = 0
        with tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    generated += len(delta.new_token_ids)
                    if delta.finished:
                        results[delta.request_id] = delta.output
                        bar.update(1)
                bar.set_postfix(tokens=generated, refresh=False)
        return [results[i] for i in request_ids]

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

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)


def chat_prompt_ids(tokenizer, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
    """The prompt token ids for a conversation, by default ready for the assistant's turn."""
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use a plain prompt")
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts
