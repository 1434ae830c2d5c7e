"""The engine's adapters: read from their files and checked against the model, kept in
host memory while requests use them (cache.py: least recently used dropped first), and
written into the runner's slots when a step's scheduler gives an adapter one (slots.py).

Which adapters requests use is the engine's to say (in_use): a request still waiting
for its first step, or a sample deferred in its group, holds its adapter too."""

from collections.abc import Callable

from replica.config import EngineConfig
from replica.lora.adapter_files import read_adapter
from replica.lora.cache import AdapterCache
from replica.lora.slots import LoRASlots
from replica.lora.weights import AdapterWeights, load_adapter_weights
from replica.scheduler import ScheduledRequest
from wire.lora_request import LoRARequest


class LoRAManager:
    def __init__(self, config: EngineConfig, runner, slots: LoRASlots):
        """runner: the base model's, whose config an adapter's shapes must fit and whose
        slots hold the adapters a step runs with; slots: the scheduler's account of them."""
        self.cache = AdapterCache(config.max_cpu_loras or config.max_loras)
        self.max_rank = config.max_lora_rank
        self.runner = runner
        self.slots = slots

    def read(self, lora: LoRARequest) -> AdapterWeights:
        """An adapter's weights, read from its files and checked against the model. Touches
        no engine state, so a server runs it off the engine's thread."""
        spec = read_adapter(lora.lora_path, self.runner.hf_config.to_dict(), self.max_rank)
        return load_adapter_weights(spec, self.runner.dtype)

    def add(self, lora: LoRARequest, weights: AdapterWeights | None, in_use: set[LoRARequest]) -> None:
        """Keep an adapter loaded (weights read before, or read now), dropping the least
        recently used idle one past capacity."""
        if lora in self.cache:
            self.cache.get(lora)  # now the most recently used
            return
        self.cache.put(lora, weights or self.read(lora), in_use)

    def remove(self, lora_name: str, in_use: set[LoRARequest]) -> bool:
        """Drop an adapter that no request uses; False if it is not loaded or in use."""
        return self._drop(lambda lora: lora.lora_name == lora_name, in_use)

    def retain(self, lora_int_ids: frozenset[int], in_use: set[LoRARequest]) -> None:
        """Drop the loaded adapters whose ids are not among these, once no request uses them."""
        self._drop(lambda lora: lora.lora_int_id not in lora_int_ids, in_use)

    def _drop(self, which: Callable[[LoRARequest], bool], in_use: set[LoRARequest]) -> bool:
        dropped = [lora for lora in self.cache.adapters() if which(lora) and lora not in in_use]
        for lora in dropped:
            self.cache.remove(lora)
        return bool(dropped)

    def adapters(self) -> list[LoRARequest]:
        """The adapters loaded, least recently used first."""
        return self.cache.adapters()

    def load_slots(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Write the adapters a step's scheduling gave a slot into the runner's slots."""
        for slot, lora in loads:
            self.runner.load_lora(slot, self.cache.get(lora))

    def row_slots(self, items: list[ScheduledRequest]) -> list[int] | None:
        """Each row's adapter slot (-1: the base model), or None if no row has one."""
        if not any(s.request.lora is not None for s in items):
            return None
        slot_of = self.slots.slot_of
        return [-1 if s.request.lora is None else slot_of(s.request.lora) for s in items]
