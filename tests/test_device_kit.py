"""The device kit (scripts/device_wheels.sh, scripts/device_check.sh, bench/gpu.py,
bench/quantized_gemm.py) that takes kvserve to a lent GPU machine: what travels is
exactly the listed wheels and the bundled tokenizer, within the size limit, and the GPU
benchmarks' smoke runs write every section. The whole rehearsal of the GPU run on CPU is
`make device-rehearsal` (minutes: it builds a venv of the GPU image's versions)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from replica import model_loader

ROOT = Path(__file__).resolve().parents[1]
WHEELS_SCRIPT = ROOT / "scripts" / "device_wheels.sh"


def pins() -> list[str]:
    lines = (ROOT / "scripts" / "device_wheels.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def device_wheels(wheels: Path, device: Path, *args: str, limit_mib: int = 60) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "WHEELS_DIR": str(wheels),
        "DEVICE_DIR": str(device),
        "LIMIT_MIB": str(limit_mib),
    }
    return subprocess.run(
        ["bash", str(WHEELS_SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """scripts/device_wheels.sh run for real (the registry for the wheels, the bundled
    model for the tokenizer), into temporary folders."""
    root = tmp_path_factory.mktemp("device-kit")
    wheels, device = root / "whl", root / "device"
    done = device_wheels(wheels, device)
    assert done.returncode == 0, done.stdout + done.stderr
    return wheels, device, done.stdout


def test_device_wheels_fetch_exactly_the_listed_wheels_within_the_limit(kit):
    wheels, _, stdout = kit
    names = sorted(p.name for p in wheels.iterdir())
    assert len(names) == len(pins())
    for pin in pins():
        name, version = pin.split("==")
        (match,) = [n for n in names if n.lower().startswith(f"{name.replace('-', '_').lower()}-{version}-")]
        # Installable on the GPU image's CPython 3.12 on x86-64 Linux.
        assert re.search(r"-(cp312-cp312|cp3\d+-abi3|py3-none)-(manylinux\w*_x86_64|any)\.whl$", match), match
    travel = float(re.search(r"to travel: ([\d.]+) MiB", stdout).group(1))
    assert 0 < travel <= 60


def test_device_tokenizer_is_the_bundled_one_and_no_gguf_is_read(kit, tokenizer, monkeypatch):
    _, device, _ = kit
    carried = AutoTokenizer.from_pretrained(device / "tokenizer")
    text = "The capital of France is Paris. <|im_start|>user\nHi!<|im_end|>"
    assert carried(text).input_ids == tokenizer(text).input_ids
    assert len(carried) == len(tokenizer) == 49152
    messages = [{"role": "user", "content": "Hi!"}]
    assert carried.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)

    # Where .device/ holds the tokenizer, the GGUF is never looked for.
    def no_gguf():
        raise AssertionError("the GGUF was read")

    monkeypatch.setattr(model_loader, "DEVICE_TOKENIZER", device / "tokenizer")
    monkeypatch.setattr(model_loader, "bundled_gguf_path", no_gguf)
    assert model_loader.bundled_tokenizer_path() == device / "tokenizer"


def test_check_refuses_a_stray_or_missing_wheel_a_missing_tokenizer_and_an_oversize(kit, tmp_path):
    wheels, device, _ = kit
    copy_wheels, copy_device = tmp_path / "whl", tmp_path / "device"
    shutil.copytree(wheels, copy_wheels)
    shutil.copytree(device, copy_device)
    assert device_wheels(copy_wheels, copy_device, "--check").returncode == 0

    (wheel,) = [p for p in copy_wheels.iterdir() if p.name.startswith("llguidance-")]
    stray = copy_wheels / wheel.name.replace("llguidance-1.9.1-", "llguidance-1.9.0-")
    shutil.copy(wheel, stray)
    refused = device_wheels(copy_wheels, copy_device, "--check")
    assert refused.returncode != 0 and "llguidance-1.9.0" in refused.stderr

    stray.unlink()
    wheel.unlink()
    refused = device_wheels(copy_wheels, copy_device, "--check")
    assert refused.returncode != 0 and "want one wheel for llguidance==1.9.1" in refused.stderr
    shutil.copy(wheels / wheel.name, wheel)

    (copy_device / "tokenizer" / "tokenizer.json").unlink()
    refused = device_wheels(copy_wheels, copy_device, "--check")
    assert refused.returncode != 0 and "no tokenizer" in refused.stderr
    shutil.copy(device / "tokenizer" / "tokenizer.json", copy_device / "tokenizer")

    refused = device_wheels(copy_wheels, copy_device, "--check", limit_mib=1)
    assert refused.returncode != 0 and "over the limit of 1 MiB" in refused.stderr


def smoke_run(module: str, out: Path) -> tuple[dict, str]:
    """A benchmark's --smoke run, writing `out`: its JSON and its output."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


def test_gpu_bench_smoke_writes_every_section(tmp_path):
    result, stdout = smoke_run("bench.gpu", tmp_path / "gpu.json")
    assert result["complete"] and result["smoke"] and result["device"] == "cpu"
    sections = ["engine", "cuda_graphs", "batch1_decode", "decode_kernel", "hf_model"]
    sections += ["hf_static_cache_batch1", "transformers_decoder"]
    for key in sections:
        assert result[key]["status"] in ("ran", "skipped"), (key, result[key])
    assert result["engine"]["status"] == result["batch1_decode"]["status"] == "ran"
    assert result["decode_kernel"] == {"status": "skipped", "reason": "needs a CUDA GPU"}
    for system in ("kvserve", "hf_static", "hf_generate_batch"):
        runs = result["throughput"][system]
        assert sorted(runs) == ["16", "4"]
        for run in runs.values():
            assert run["output_tokens_per_s"] > 0, (system, run)
    # Within their limits kvserve and transformers' continuous batching finish every
    # request; HF static runs only its first batch by design, and says so.
    for system in ("kvserve", "hf_generate_batch"):
        assert all(r["status"] == "ran" and r["requests"] == 8 for r in result["throughput"][system].values())
    for run in result["throughput"]["hf_static"].values():
        assert run["status"] == "ran" and run["requests"] == 4 and "first 1 of 2 batches" in run["subset"]
    assert "cut short" not in stdout
    # The profiles of decode steps, for both decoders, and transformers' batch-1 baseline.
    for key in ("profile", "transformers_decoder_profile"):
        for batch in ("batch_1", "batch_4"):
            profile = result[key][batch]
            assert profile["status"] == "ran" and profile["kernels_per_step"] > 0, (key, profile)
            assert profile["top_kernels"] and 0 <= profile["gpu_idle_share"] <= 1, (key, profile)
    assert result["transformers_decoder"]["batch1_decode"]["status"] == "ran"
    assert result["hf_static_cache_batch1"]["per_token_s"] > 0
    assert not result["hf_static_cache_batch1"]["compiled"]  # generate compiles only on a GPU
    assert set(result["targets"]) == {
        "speedup_vs_hf_static_at_cap_1536",
        "speedup_vs_hf_generate_batch",
        "batch1_step_over_floor",
        "decode_kernel_bandwidth_fraction",
        "batch1_step_over_hf_static_cache_compiled",
    }
    assert result["targets"]["speedup_vs_hf_generate_batch"]["status"] == "ran"


def test_quantized_gemm_smoke_times_every_kernel_on_every_shape(tmp_path):
    result, _ = smoke_run("bench.quantized_gemm", tmp_path / "quantized_gemm.json")
    assert result["device"] == "cpu" and result["machine"]["torch"] == __import__("torch").__version__
    assert result["engines"] == {"status": "skipped", "reason": "the engine part runs on CUDA only"}
    kernels = {"float32", "bfloat16", "int8", "fp8", "fp8_weight_only"}
    assert set(result["gemms"]) == {
        "q_proj/o_proj",
        "k_proj/v_proj",
        "gate_proj/up_proj",
        "down_proj",
        "lm_head",
    }
    for gemm in result["gemms"].values():
        assert sorted(gemm["seconds"]) == ["1", "40"]
        for times in gemm["seconds"].values():
            assert set(times) == kernels and all(t > 0 for t in times.values())


def test_engine_offline_api_and_gpu_bench_import_without_ray():
    """The GPU machine has no Ray: the engine, LLM and the GPU benchmarks must not import it."""
    code = (
        "import sys; import bench.gpu, bench.quantized_gemm, replica.attention.triton_backend; "
        "from kvserve import LLM; "
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_tests_past_the_device_checks_deadline_are_skipped_not_started():
    """scripts/device_check.sh's test budget: past KVSERVE_TESTS_DEADLINE, tests skip with a
    reason its log is searched for."""
    env = {**os.environ, "KVSERVE_TESTS_DEADLINE": "0"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            "tests/test_sampling_params.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\d+ skipped", done.stdout) and "passed" not in done.stdout.splitlines()[-1]
    assert "the device check's test budget ran out" in done.stdout


def test_the_kits_gpu_tests_run_where_ray_cannot_be_imported(tmp_path):
    """The GPU machine has no Ray, so neither the GPU test files nor conftest.py's hooks may
    need it: one test of the kit's files passes with every `import ray` refused."""
    blocked = tmp_path / "no-ray" / "ray"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('no Ray on the GPU machine')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT)])}
    test = "tests/test_flex_decode.py"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", test],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout + done.stderr
