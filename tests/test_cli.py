import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import openai
import psutil
import pytest
from conftest import HUB_ID, wait_for

from deployments import cli
from deployments.cli import main
from deployments.serve_process import SHUTDOWN_TIMEOUT_S
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc


def _kvserve(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_generate_streams_text():
    """`python -m deployments.cli`, as the `kvserve` script runs it, in a process of its own."""
    result = _kvserve(
        "generate", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "finish_reason=" in result.stderr


# The rest call main() in this process: the same code, without another interpreter's start.
def test_generate_streams_text_with_int8_weights(capsys):
    argv = ["generate", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32"]
    assert main([*argv, "--quantization", "int8"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "finish_reason=" in err


def test_quantization_reaches_the_engine(capsys):
    """float16 has no int8 kernels on CPU: the engine's refusal shows the flag got there."""
    assert main(["generate", "hi", "--dtype", "float16", "--quantization", "int8"]) == 2
    assert (
        "quantization='int8' runs on CPU with kvserve's CPU kernels in float32 or bfloat16"
        in capsys.readouterr().err
    )


def test_bad_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{bad", "speculative_config is not valid JSON"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}',
            "speculative_config: unknown keys ['lookahead']",
        ),
        ('{"method": "medusa", "num_speculative_tokens": 4}', "speculative_config: method must be one of"),
        ('["ngram"]', "speculative_config must be a JSON object"),
    ],
)
@pytest.mark.parametrize("command", [["serve"], ["batch", "in.jsonl", "out.jsonl"]])
def test_bad_speculative_config_is_an_argparse_error(command, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--speculative-config", value])
    assert exit_info.value.code == 2
    assert f"argument --speculative-config: {message}" in capsys.readouterr().err


def test_speculative_config_reaches_the_batch_engine_args(monkeypatch, tmp_path, capsys):
    """As a dict, beside the other engine arguments; a combination the engine refuses
    (speculation with tensor parallelism) stops it before Ray starts."""
    import ray

    from deployments import batch as batch_job

    given = {}

    def run_batch(input_path, output_path, engine_args, **kwargs):
        given.update(engine_args)
        return batch_job.BatchSummary(rows=0, errors=0, skipped=0, generated_tokens=0, seconds=1.0)

    monkeypatch.setattr(cli, "_check_model", lambda args: True)
    monkeypatch.setattr(batch_job, "run_batch", run_batch)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    batch = ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")]
    assert (
        main([*batch, "--speculative-config", NGRAM, "--quantization", "int8", "--kv-cache-dtype", "fp8"])
        == 0
    )
    assert given["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert given["quantization"] == "int8"
    assert given["kv_cache_dtype"] == "fp8"
    given.clear()
    assert main([*batch, "--speculative-config", NGRAM, "--tensor-parallel-size", "2"]) == 2
    assert not given
    assert "speculative_config does not yet work with tensor_parallel_size > 1" in capsys.readouterr().err


class _Serve:
    """`kvserve serve` in a child process with its own local Ray (RAY_ADDRESS=local); a
    thread reads its output, so that a full pipe never blocks it."""

    def __init__(self, port: int, grpc_port: int, *args: str, env: dict[str, str] | None = None):
        command = [sys.executable, "-m", "deployments.cli", "serve", "--port", str(port)]
        command += [
            "--grpc-port",
            str(grpc_port),
            "--dtype",
            "float32",
            "--kv-cache-memory-gb",
            "0.25",
            *args,
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_ADDRESS="local", **(env or {}))
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.url = f"http://127.0.0.1:{port}/v1"
        self.lines: list[str] = []
        self.banner = ""
        self._serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("kvserve is serving"):
                self.banner = line
                self._serving.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_serving(self) -> str:
        """The served model's name, from the banner."""
        deadline = time.monotonic() + 240
        while not self._serving.wait(1.0) and time.monotonic() < deadline and self.proc.poll() is None:
            pass
        assert self.banner, self.output
        return self.banner.split()[3]

    def stop(self, *signals: signal.Signals, to_all: bool = False) -> tuple[int, float, list[psutil.Process]]:
        """Sends the first signal (to every process of the server with `to_all`, as systemd
        does), each further one once the server has said it took the one before (as a
        second Ctrl-C comes after the first has shown); returns its exit code, how long it
        took, and the processes it had started that are still alive."""
        started = psutil.Process(self.proc.pid).children(recursive=True)
        assert {"raylet", "gcs_server"} <= {_name(p) for p in started}  # it started a local Ray
        t0 = time.monotonic()
        for p in [psutil.Process(self.proc.pid), *started] if to_all else [self.proc]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signals[0])
        for before, signum in zip(signals, signals[1:], strict=False):
            taken = f"kvserve: {before.name}: shutting down"
            wait_for(lambda taken=taken: taken in self.output or self.proc.poll() is not None, timeout_s=30)
            if self.proc.poll() is None:
                self.proc.send_signal(signum)
        code = self.proc.wait(timeout=90)  # a hang, not a speed bound
        seconds = time.monotonic() - t0
        _, alive = psutil.wait_procs(started, timeout=5)
        left = [p for p in alive if _running(p)]
        for p in left:
            p.kill()
        return code, seconds, left

    def kill(self) -> None:
        """After a failed test: the server and its Ray, not left behind."""
        if self.proc.poll() is None:
            for p in [*psutil.Process(self.proc.pid).children(recursive=True), psutil.Process(self.proc.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            self.proc.wait()


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _streams(url: str, model: str, n: int = 4, api_key: str = "unused") -> list[threading.Thread]:
    """n streaming chat completions long enough to outlast the server, from threads; returns
    once each has streamed its first chunk."""
    client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=120)
    first_chunks = threading.Semaphore(0)
    failed: list[str] = []

    def stream(i: int) -> None:
        chunks = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Story {i}, please."}],
            max_tokens=4000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        try:
            for k, _ in enumerate(chunks):
                if k == 0:
                    first_chunks.release()
        except (openai.APIError, OSError):
            pass  # the server went away mid-stream: what its shutdown does to a stream

    def run(i: int) -> None:
        try:
            stream(i)
        except (openai.APIError, OSError) as e:
            failed.append(repr(e))
            first_chunks.release()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for _ in threads:
        assert first_chunks.acquire(timeout=180)
    assert not failed, failed
    return threads


def _assert_ended_cleanly(server: _Serve, code: int, seconds: float, left: list, threads: list) -> None:
    """Exit code 0 within Kubernetes' 30 s grace period, the shutdown done before its
    watchdog's SHUTDOWN_TIMEOUT_S (25 s; docs/serving.md), no process of its local Ray
    left, no stream left hanging, and none of the messes shutdown used to print."""
    output = server.output
    assert code == 0, output
    assert seconds < 30, (seconds, output)
    assert f"shutdown did not finish within {SHUTDOWN_TIMEOUT_S:.0f} s" not in output, (seconds, output)
    assert not left, [(p.pid, p.name()) for p in left]
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    # Its own lines, not those it forwards from Ray's processes: "(raylet) ...", colored.
    own = [line for line in server.lines if not line.startswith(("(", "\x1b["))]
    for mess in ("Traceback", "Aborted", "SIGTERM received at time", "Failed to connect to GCS"):
        assert not any(mess in line for line in own), output


def test_serve_by_hub_id_with_tensor_parallel_size_2_then_sigterm_under_load(hf_hub_cache):
    """A model named by hub id, from an HF cache with no network (HF_HUB_OFFLINE), with API
    keys, as one replica split over two CPU processes (gloo). Then the SIGTERM that
    Kubernetes sends (to the server's process only) while streams run ends everything, the
    second rank too."""
    port, grpc_port = 18477, 18478
    env = {"KVSERVE_API_KEYS": "secret-1", "HF_HUB_CACHE": str(hf_hub_cache)}
    server = _Serve(port, grpc_port, "--model", HUB_ID, "--tensor-parallel-size", "2", env=env)
    try:
        assert server.wait_serving() == HUB_ID
        client = openai.OpenAI(base_url=server.url, api_key="secret-1", max_retries=0)
        out = client.completions.create(
            model=HUB_ID, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert "Paris" in out.choices[0].text
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="wrong").models.list()
        stub = pb_grpc.LLMStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        metadata = [("application", "kvserve"), ("authorization", "Bearer secret-1")]
        models = stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
        assert [m.id for m in models.models] == [HUB_ID]
        ranks = [
            p for p in psutil.Process(server.proc.pid).children(recursive=True) if "TPWorker" in _title(p)
        ]
        assert len(ranks) == 1  # rank 1; rank 0 is the replica itself
        threads = _streams(server.url, HUB_ID, api_key="secret-1")
        code, seconds, left = server.stop(signal.SIGTERM)
        _assert_ended_cleanly(server, code, seconds, left, threads)
    finally:
        server.kill()


def test_sigterm_to_every_process_ends_serve_cleanly():
    """systemd's SIGTERM, to every process of the service at once: the local Ray's GCS and
    raylet go too, and Serve cannot be shut down through them."""
    server = _Serve(18573, 18574)
    try:
        model = server.wait_serving()
        threads = _streams(server.url, model)
        code, seconds, left = server.stop(signal.SIGTERM, to_all=True)
        _assert_ended_cleanly(server, code, seconds, left, threads)
    finally:
        server.kill()


def test_ctrl_c_twice_while_starting_stops_at_once():
    """Ctrl-C while the local Ray starts (ray.init cannot be interrupted), then again: the
    second stops it at once, with exit code 0 and nothing of its Ray left."""
    server = _Serve(18577, 18578)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.proc.poll() is None:
            names = {_name(p) for p in psutil.Process(server.proc.pid).children(recursive=True)}
            if {"raylet", "gcs_server"} <= names:
                break
            time.sleep(0.2)
        code, seconds, left = server.stop(signal.SIGINT, signal.SIGINT)
        _assert_ended_cleanly(server, code, seconds, left, [])
        assert "SIGINT again: stopping now" in server.output
        assert not server.banner  # it never got to serve
    finally:
        server.kill()


def _name(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return p.name()
    return ""


def _title(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline())
    return ""
