"""The ingress's side of LoRA adapters: checking an adapter's files before it is
registered, the registry (the coordinator's, shared by every ingress replica), and
resolving a request's `model` to the adapter it names."""

import asyncio
import os
from dataclasses import dataclass, field

from ray.exceptions import RayActorError

from replica.lora.adapter_files import LoRAAdapterError, read_adapter
from router.generation import APIError
from router.placement.coordinator import LoRANameTaken, LoRARegistry, get_coordinator
from wire.lora_request import LoRARequest


@dataclass
class LoRASettings:
    """What the ingress needs of the engine's LoRA arguments; the ingress gets None
    where enable_lora is off."""

    max_lora_rank: int
    modules: dict[str, str] = field(default_factory=dict)  # start-up adapters: name -> path


class Adapters:
    """The ingress's side of LoRA adapters. It checks an adapter's files against the
    base model before registering it, so a bad adapter is a 400 and never reaches a
    replica, and resolves a request's `model` to its adapter on every request, so an
    unloaded adapter is unknown at once. The registry is the coordinator's, shared by
    every ingress replica (and read by the replicas); without a coordinator, a local one."""

    def __init__(
        self,
        settings: LoRASettings | None,
        base_name: str,
        base_config: dict,
        coordinator: tuple[str, str] | None,
    ):
        self.settings, self.base_name, self.base_config = settings, base_name, base_config
        self._address = coordinator
        self._coordinator = get_coordinator(coordinator) if coordinator and settings else None
        self._local = LoRARegistry()

    @property
    def enabled(self) -> bool:
        return self.settings is not None

    async def start(self) -> None:
        """Registers the start-up adapters (checked when the application was built)."""
        if self.settings is not None and self.settings.modules:
            await self._registry("seed_loras", self.settings.modules)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Checks and registers an adapter; APIError 400 when LoRA is off, the name is
        taken, or the files are not an adapter kvserve can serve on this base model."""
        settings = self._require_enabled()
        if not name:
            raise APIError(400, "lora_name must not be empty", "lora_name")
        if name == self.base_name:
            raise APIError(400, f"lora_name {name!r} is the base model's name", "lora_name")
        path = os.path.expanduser(path)
        try:
            await asyncio.to_thread(read_adapter, path, self.base_config, settings.max_lora_rank)
        except LoRAAdapterError as e:
            raise APIError(400, str(e), "lora_path") from None
        except Exception as e:  # files that are not what they claim: unreadable JSON, a truncated header
            raise APIError(400, f"cannot read a LoRA adapter at {path!r}: {e!r}", "lora_path") from None
        try:
            return await self._registry("register_lora", name, path)
        except Exception as e:
            if isinstance(e, LoRANameTaken) or isinstance(getattr(e, "cause", None), LoRANameTaken):
                message = f"the LoRA adapter {name!r} has already been loaded"
                raise APIError(400, message, "lora_name") from None
            raise

    async def unload(self, name: str) -> None:
        """APIError 404 when no adapter of that name is loaded."""
        self._require_enabled()
        if not await self._registry("unregister_lora", name):
            raise APIError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name", "not_found_error")

    async def all(self) -> list[LoRARequest]:
        return await self._registry("loras") if self.enabled else []

    async def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names; None for the base model, which an absent or empty
        model (proto3's unset string) means too, as in vLLM. Anything else is a 404."""
        if not model or model == self.base_name:
            return None
        lora = await self._registry("lora", model) if self.enabled else None
        if lora is None:
            also = " or one of its LoRA adapters (GET /v1/models)" if self.enabled else ""
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.base_name!r}{also}",
                "model",
                "not_found_error",
            )
        return lora

    def _require_enabled(self) -> LoRASettings:
        if self.settings is None:
            raise APIError(400, "LoRA adapters are not enabled: start the server with --enable-lora")
        return self.settings

    async def _registry(self, method: str, *args):
        """One call of the registry. A coordinator that died is looked up again, which
        recreates it, and is given the start-up adapters before the call is made again."""
        if self._coordinator is None:
            return getattr(self._local, method)(*args)
        try:
            return await getattr(self._coordinator, method).remote(*args)
        except RayActorError:
            self._coordinator = await asyncio.to_thread(get_coordinator, self._address)
            await self._coordinator.seed_loras.remote(self.settings.modules)
            return await getattr(self._coordinator, method).remote(*args)
