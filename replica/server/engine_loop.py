"""The engine's own thread: it steps back to back while there is work, as vLLM's engine
core does, and never waits for the caller to collect a step's outputs.

The engine is synchronous and not thread-safe, so every other call into it (add, abort,
stats) is queued here and runs between two steps. Outputs leave through a callback that
must not block (the Serve replica hands them to its event loop)."""

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from replica.engine import Engine
from wire.outputs import RequestDelta

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[RequestDelta]], None],
        on_step_error: Callable[[Exception], None],
        on_tick: Callable[[], None] = lambda: None,
        idle_tick_s: float = 0.1,
    ):
        """on_step_error runs on the loop's thread after a failed step, so it may call
        into the engine (to abort what the step was serving). on_tick runs after every
        step, and at least every idle_tick_s while idle."""
        self.engine = engine
        self._on_outputs, self._on_step_error, self._on_tick = on_outputs, on_step_error, on_tick
        self._idle_tick_s = idle_tick_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args) -> Future:
        """Run fn(*args) on the engine's thread before its next step."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped.set()
        self._calls.put(None)  # wakes an idle loop
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._run_calls(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step fails its requests, not the replica
                    logger.exception("engine step failed")
                    self._on_step_error(e)
                    continue
                if outputs:
                    self._on_outputs(outputs)
            self._on_tick()

    def _run_calls(self, block: bool) -> None:
        """Every queued call; when idle, first wait for one (or for the next tick)."""
        try:
            item = self._calls.get(timeout=self._idle_tick_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as e:
                    future.set_exception(e)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
