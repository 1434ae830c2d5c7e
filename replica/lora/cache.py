"""The adapters a replica keeps in host memory, up to max_cpu_loras, the least recently
used dropped first. An adapter that a request still uses is never dropped: it can go
past the limit until that request ends."""

from collections import OrderedDict

from replica.lora.weights import AdapterWeights
from wire.lora_request import LoRARequest


class AdapterCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._loaded: OrderedDict[LoRARequest, AdapterWeights] = OrderedDict()  # oldest use first

    def __contains__(self, lora: LoRARequest) -> bool:
        return lora in self._loaded

    def get(self, lora: LoRARequest) -> AdapterWeights:
        self._loaded.move_to_end(lora)
        return self._loaded[lora]

    def put(self, lora: LoRARequest, weights: AdapterWeights, in_use: set[LoRARequest]) -> None:
        self._loaded[lora] = weights
        self._loaded.move_to_end(lora)
        idle = [held for held in self._loaded if held not in in_use and held != lora]
        while len(self._loaded) > self.capacity and idle:
            del self._loaded[idle.pop(0)]

    def remove(self, lora: LoRARequest) -> None:
        self._loaded.pop(lora, None)

    def adapters(self) -> list[LoRARequest]:
        """Least recently used first."""
        return list(self._loaded)
