"""`speculative_config`, vLLM's engine argument: how proposals are made and when
speculation pauses. Given as a dict (or JSON on the CLI) and read into this dataclass."""

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of the request's tokens looked up earlier in
    # its prompt and output; the tokens that followed the latest match are proposed.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # draft_model: a path or hub id of a model with the target's vocabulary.
    model: str | None = None
    # No speculation in a step with more running requests than this: past it a step is
    # no longer bound by reading the weights, and verifying rejected tokens costs time
    # (bench/spec_step_cost.py measures where).
    disable_by_batch_size: int = 8
    # A request whose acceptance over its last `acceptance_window` proposed tokens falls
    # below min_acceptance_rate stops speculating for `backoff_steps` steps, then tries again.
    # The defaults follow bench/spec_step_cost.py: what verifying costs over a decode step.
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        positive = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
        positive += ("disable_by_batch_size", "acceptance_window", "backoff_steps")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(
                f"speculative_config: min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config: method "draft_model" needs "model" (a path or hub id)')
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: method "ngram" takes no "model"')

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """A dict, its JSON text (the CLI's), or None for no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        value = dict(value)
        if value.get("method") is None and value.get("model"):
            value["method"] = "draft_model"  # vLLM infers it from a draft model's presence
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in value]
        if missing:
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**value)
