"""Which adapter each of a step's max_loras slots holds (CPU bookkeeping for the
scheduler; the runner holds the weights). A slot is taken when an adapter's first
request starts running and stays with that adapter, loaded, until another adapter
needs a slot that no running request uses."""

from wire.lora_request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int):
        self.adapters: list[LoRARequest | None] = [None] * max_loras
        self.users = [0] * max_loras  # running requests per slot
        self._loads: dict[int, LoRARequest] = {}  # slots whose weights the runner must write

    def slot_of(self, lora: LoRARequest) -> int | None:
        return next((s for s, held in enumerate(self.adapters) if held == lora), None)

    def can_take(self, lora: LoRARequest) -> bool:
        """Whether a request of `lora` can run now: its adapter holds a slot, or a slot is
        free of running requests."""
        return self.slot_of(lora) is not None or 0 in self.users

    def acquire(self, lora: LoRARequest) -> int:
        """The slot a newly running request of `lora` uses; can_take must hold. An empty
        slot is taken before one whose idle adapter could be used again."""
        slot = self.slot_of(lora)
        if slot is None:
            idle = [s for s, users in enumerate(self.users) if users == 0]
            slot = next((s for s in idle if self.adapters[s] is None), idle[0])
            self.adapters[slot] = lora
            self._loads[slot] = lora
        self.users[slot] += 1
        return slot

    def release(self, lora: LoRARequest) -> None:
        """A request of `lora` stopped running (finished or preempted)."""
        self.users[self.slot_of(lora)] -= 1

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """(slot, adapter) pairs taken since the last call, to write before the step runs."""
        loads, self._loads = list(self._loads.items()), {}
        return loads

    def running(self) -> list[LoRARequest]:
        return [lora for lora, users in zip(self.adapters, self.users, strict=True) if lora and users]
