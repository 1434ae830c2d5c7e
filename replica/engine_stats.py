"""What the engine reports of itself: its KV cache, its queues, its LoRA adapters and its
speculative decoding's counters. A serving replica reads it for its load report
(replica/server/deployment.py) while the engine steps on, so it holds copies."""

from dataclasses import dataclass

from kvcache import KVStats
from replica.scheduler import Scheduler
from replica.spec_decode.speculator import Speculator
from wire.lora_request import LoRARequest
from wire.spec_decode_stats import SpecDecodeStats


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

    @classmethod
    def of(
        cls, scheduler: Scheduler, loras: list[LoRARequest], speculator: Speculator | None
    ) -> "EngineStats":
        """loras: the adapters loaded, least recently used first."""
        return cls(
            kv=scheduler.kv.stats(),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_pending_blocks=scheduler.num_pending_blocks(),
            num_preemptions=scheduler.num_preemptions,
            loras=[lora.lora_name for lora in loras],
            running_loras=_names(r.lora for r in scheduler.running),
            waiting_loras=_names(r.lora for r in scheduler.waiting),
            spec_decode=speculator.stats_snapshot() if speculator is not None else SpecDecodeStats(),
        )


def _names(loras) -> list[str]:
    return sorted({lora.lora_name for lora in loras if lora is not None})
