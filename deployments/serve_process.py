"""`kvserve serve`'s process: it starts Ray and Serve on a thread, and on SIGINT or SIGTERM
shuts them down, and whatever of the local Ray it started, in bounded time."""

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from deployments.app import AppConfig  # imports Ray, which _import_ray imports first


def run(check: Callable[[], bool], app_config: Callable[[], "AppConfig | None"]) -> int:
    """Serves until a signal; the exit code. Both callables run on the start-up thread and
    print why they fail (exit code 2): `check` before Ray's import, so that a missing model
    is one line at once, and `app_config`, which imports Serve, after it."""
    stopping = _Stopping()
    stopping.install()
    return _Server(check, app_config, stopping).run()


def _with_gpus(config: "AppConfig") -> "AppConfig":
    """With tensor parallelism on a Ray that has GPUs, each rank takes one GPU, and a
    replica must find its ranks' GPUs on one node. (Without it a replica asks for no GPU,
    as before: replicas of a small model may share one.)"""
    import ray

    if config.tensor_parallel_size == 1:
        return config
    per_node = [node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]]
    if not max(per_node, default=0):
        return config
    if max(per_node) < config.tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size {config.tensor_parallel_size} needs that many GPUs on one node; "
            f"the nodes have {sorted(per_node, reverse=True)}"
        )
    return config.model_copy(update={"num_gpus_per_replica": 1})


SHUTDOWN_TIMEOUT_S = 25.0
"""After SIGINT or SIGTERM, how long `kvserve serve` gives Serve and Ray to stop before it
kills the local Ray's processes and exits anyway: within the 30 s that Kubernetes waits
before SIGKILL."""


def _say(message: str) -> None:
    """To stderr with os.write: safe in a signal handler, where print() can find stderr's
    buffer mid-write and raise."""
    os.write(sys.stderr.fileno(), f"kvserve: {message}\n".encode())


def _descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        with contextlib.suppress(psutil.Error):  # gone since
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


class _Stopping:
    """SIGINT and SIGTERM, handled alike: the first asks for a clean shutdown, a second
    for one at once."""

    def __init__(self) -> None:
        self.requested = threading.Event()  # by a signal, or by a failed start
        self.now = threading.Event()
        self.signalled = False
        self.code = 0

    def install(self) -> None:
        # Over an inherited SIG_IGN too: a server started in the background by a script
        # inherits SIGINT ignored.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signalled:
            _say(f"{name} again: stopping now")
            self.now.set()
            return
        self.signalled = True
        _say(f"{name}: shutting down (at most {SHUTDOWN_TIMEOUT_S:.0f} s; another signal stops it at once)")
        self.requested.set()

    def fail(self, code: int) -> None:
        self.code = code
        self.requested.set()


class _NotOnMainThread(logging.Filter):
    """Drops Ray's warning that ray.init, off the main thread, set no SIGTERM handler:
    that is why it runs there (Ray's handler exits with 15), and kvserve's handles it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SIGTERM handler is not set")


def _import_ray() -> None:
    """Imports Ray with two of its settings off in this process only (it reads them at
    import; the processes it starts keep its defaults):
    - its C++ crash handler, which takes SIGTERM in a driver: it logs a stack trace, passes
      the signal on and sets a 3 s alarm that aborts the process, so a shutdown that took
      longer than 3 s ended in `Aborted` (SIGABRT);
    - auto-connect, with which a Ray call still running on the start-up thread after
      ray.shutdown() would start a new local Ray that nothing stops."""
    driver_only = {"RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1", "RAY_ENABLE_AUTO_CONNECT": "0"}
    saved = {name: os.environ.get(name) for name in driver_only}
    os.environ.update(driver_only)
    try:
        import ray  # noqa: F401
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    logging.getLogger("ray._private.worker").addFilter(_NotOnMainThread())


class _Server:
    """`kvserve serve`: start-up runs on a thread, and the main thread only waits for a
    signal and shuts down, so that a signal at any moment (loading the model, starting
    Ray, deploying, serving) ends it the same way, in bounded time."""

    def __init__(
        self, check: Callable[[], bool], app_config: Callable[[], "AppConfig | None"], stopping: _Stopping
    ) -> None:
        self.check = check
        self.app_config = app_config
        self.stopping = stopping
        self.ray_lock = threading.Lock()  # held by ray.init, and by the shutdown from its start
        self.ray_started = False
        self.processes: list[psutil.Process] = []  # the local Ray's, taken as shutdown begins
        self.stopped = threading.Event()
        self.starter = threading.Thread(target=self._start_quietly, name="kvserve-start", daemon=True)

    def run(self) -> int:
        self.starter.start()
        while not self.stopping.requested.wait(1.0):
            pass
        return self._stop()

    def _start_quietly(self) -> None:
        """Once a shutdown has begun, what fails here is Serve or Ray going away under it.
        The thread then waits for the shutdown to end: the local Ray's processes are
        started to die with the thread that started them (PR_SET_PDEATHSIG is per thread),
        and its GCS and raylet would be killed mid-flight."""
        try:
            code = self._start()
        except BaseException:
            code = 0 if self.stopping.signalled else 1
            if code:
                traceback.print_exc()
        if code:
            self.stopping.fail(code)
        self.stopped.wait()

    def _start(self) -> int:
        if not self.check():
            return 2
        _import_ray()
        import ray
        from ray import serve

        from deployments.app import GRPC_SERVICER, build_app

        config = self.app_config()
        if config is None:
            return 2
        # Ray Serve's own throughput settings (user code on the replica's main event loop,
        # buffered access logs, gRPC between handles, GC frozen after start-up) take per-request
        # overhead off the few cores a CPU replica has, and so does gRPC from the proxy to the
        # ingress, which that mode leaves off. Every Serve process reads them, so they go to
        # the local Ray this starts and to the job's workers. Direct ingress stays off: with
        # it, Serve's proxy still answers on our ports, and its 30 s draining period holds up
        # shutdown.
        serve_env = {
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_PROXY_USE_GRPC": "1",
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
        }
        serve_env = {name: os.environ.get(name, value) for name, value in serve_env.items()}
        os.environ.update(serve_env)
        with self.ray_lock:
            if self.stopping.requested.is_set():
                return 0
            # Joins a running cluster, else starts a local Ray.
            ray.init(include_dashboard=False, runtime_env={"env_vars": serve_env})
            self.ray_started = True
        if self.stopping.requested.is_set():
            return 0
        try:
            config = _with_gpus(config)
        except ValueError as e:
            print(f"kvserve: error: {e}", file=sys.stderr)
            return 2
        serve.start(
            http_options={"host": config.host, "port": config.port},
            grpc_options={"port": config.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        )
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        url = f"http://{config.host}:{config.port}"
        print(f"kvserve is serving {config.model_name} at {url}/v1 (Ctrl-C stops it)")
        body = json.dumps({"model": config.model_name, "messages": [{"role": "user", "content": "Hi!"}]})
        auth = " -H 'Authorization: Bearer $KEY'" if config.api_keys else ""
        print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
        print(f"  gRPC (service kvserve.LLM) on {config.host}:{config.grpc_port}", flush=True)
        return 0

    def _stop(self) -> int:
        """Serve, then Ray, then whatever of the local Ray is left; past SHUTDOWN_TIMEOUT_S
        (or at a second signal) the watchdog ends the process instead."""
        code = self.stopping.code
        self.processes = _descendants()
        threading.Thread(target=self._watchdog, args=(code,), daemon=True).start()
        self.ray_lock.acquire()  # ray.init cannot be interrupted: let it finish first
        self.processes = _descendants()
        try:
            if self.ray_started:
                import ray
                from ray import serve

                if self._local_ray_alive(self.processes):
                    serve.shutdown()
                ray.shutdown()
        finally:
            self._end(self.processes)  # also what a ray.init that failed half-way started
            self.stopped.set()
        # The start-up thread can still be on its way out (a model download, a serve.run
        # whose app is gone). Exiting under it risks a crash in the interpreter's teardown.
        self.starter.join(timeout=2.0)
        if self.starter.is_alive():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code

    @staticmethod
    def _local_ray_alive(processes: list[psutil.Process]) -> bool:
        """False when the local Ray's GCS or raylet is gone or going: systemd signals every
        process of the service, Ctrl-C in a terminal every one in the foreground group.
        Serve's shutdown would then wait 30 s for a controller that cannot answer."""
        core = []
        for p in processes:
            with contextlib.suppress(psutil.Error):
                if p.name() in ("gcs_server", "raylet"):
                    core.append(p)
        gone, _ = psutil.wait_procs(core, timeout=1.0)
        return not gone

    @staticmethod
    def _end(processes: list[psutil.Process], timeout: float = 5.0) -> None:
        """Ends what ray.shutdown() left of the local Ray it started (a Ray this joined is
        not this process's child, and is left alone)."""
        left = _alive(processes)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, left = psutil.wait_procs(left, timeout=timeout)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def _watchdog(self, code: int) -> None:
        if self.stopping.now.wait(SHUTDOWN_TIMEOUT_S):
            reason = "stopping at once"
        else:
            reason = f"shutdown did not finish within {SHUTDOWN_TIMEOUT_S:.0f} s"
        _say(f"{reason}: killing the local Ray's processes and exiting")
        for p in _alive(self.processes + _descendants()):
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)
