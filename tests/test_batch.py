"""Batch inference on a real local Ray Data pipeline with the bundled model."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import save_lora_adapter

from deployments.batch import run_batch
from kvserve import SamplingParams

BAD_ROWS = [
    '{"id": "bad-temperature", "prompt": "x", "temperature": -1}',
    '{"id": "bad-type", "prompt": 42}',
    '{"id": "bad-max-tokens", "prompt": "x", "max_tokens": "many"}',
    "this line is not JSON",
]


def write_rows(path, n: int, bad: bool = True) -> set[str]:
    """n good rows (ids g0..), every tenth a chat, plus the bad rows; returns the good ids."""
    lines = []
    for i in range(n):
        if i % 10 == 0:
            row = {"id": f"g{i}", "messages": [{"role": "user", "content": f"Say {i}."}]}
        else:
            row = {"id": f"g{i}", "prompt": f"Count from {i}:", "temperature": 0}
        row.update(max_tokens=4, ignore_eos=True)
        lines.append(json.dumps(row))
    if bad:
        lines[5:5] = BAD_ROWS
    path.write_text("\n".join(lines) + "\n")
    return {f"g{i}" for i in range(n)}


def read_output(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_row_comes_out_once_and_bad_rows_are_reported(ray_cluster, tmp_path, model_path):
    good = write_rows(tmp_path / "in.jsonl", 200)
    summary = run_batch(
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out.jsonl"),
        engine_args={"model": str(model_path)},
        min_replicas=1,
        max_replicas=2,
        batch_size=25,
        num_cpus_per_replica=0.5,
    )
    rows = read_output(tmp_path / "out.jsonl")
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == len(by_id) == 204  # one row per input row, none twice
    assert summary.rows == 204 and summary.errors == 4
    assert good <= set(by_id)
    for rid in good:
        assert by_id[rid]["error"] is None
        assert by_id[rid]["completion_tokens"] == 4 and by_id[rid]["finish_reason"] == "length"
        assert by_id[rid]["text"]
    errors = {r["id"]: r["error"] for r in rows if r["error"] is not None}
    assert "temperature" in errors["bad-temperature"]
    assert "prompt" in errors["bad-type"]
    assert "bad-max-tokens" in errors
    assert any("invalid JSON" in e for e in errors.values())


def test_rows_with_duplicate_ids_become_error_rows_and_none_is_lost(ray_cluster, tmp_path, model_path):
    """ "d1" twice in one batch, "d2" in the first and the last batch (10 rows each)."""
    rows = [{"id": f"r{i}", "prompt": f"Say {i}.", "max_tokens": 2} for i in range(30)]
    rows[1]["id"] = rows[2]["id"] = "d1"
    rows[0]["id"] = rows[29]["id"] = "d2"
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = run_batch(
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out.jsonl"),
        engine_args={"model": str(model_path)},
        max_replicas=1,
        batch_size=10,
        num_cpus_per_replica=0.5,
    )
    out = read_output(tmp_path / "out.jsonl")
    assert len(out) == summary.rows == 30 and summary.errors == 2
    assert sorted(r["id"] for r in out) == sorted(row["id"] for row in rows)
    for rid in ("d1", "d2"):
        answered = [r for r in out if r["id"] == rid and r["error"] is None]
        refused = [r for r in out if r["id"] == rid and r["error"] is not None]
        assert len(answered) == 1 and answered[0]["completion_tokens"] > 0
        assert len(refused) == 1 and refused[0]["error"].startswith(f"duplicate id {rid!r}")
        assert refused[0]["text"] is None and refused[0]["completion_tokens"] == 0


def test_parquet_in_parquet_out(ray_cluster, tmp_path, model_path):
    # ignore_eos: rows sample at the default temperature, and a sampled EOS would end one early
    rows = [{"id": f"p{i}", "prompt": f"Hello {i}", "max_tokens": 3, "ignore_eos": True} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    summary = run_batch(
        str(tmp_path / "in.parquet"),
        str(tmp_path / "out.parquet"),
        engine_args={"model": str(model_path)},
        max_replicas=1,
        batch_size=10,
        num_cpus_per_replica=0.5,
    )
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert summary.errors == 0 and all(r["completion_tokens"] == 3 for r in out)


def test_refuses_to_overwrite_without_resume(ray_cluster, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "out.jsonl").write_text("")
    with pytest.raises(FileExistsError):
        run_batch(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"))


def test_killed_run_resumes_with_exactly_one_row_per_id(ray_cluster, tmp_path):
    """`kvserve batch` as a job of the session's Ray: its driver is killed mid-run (Ray then
    ends the job's actors, as it would on a cluster), and a second run resumes."""
    good = write_rows(tmp_path / "in.jsonl", 100, bad=False)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-m", "deployments.cli", "batch", str(tmp_path / "in.jsonl"), str(out)]
    args += ["--batch-size", "10", "--max-replicas", "1", "--num-cpus-per-replica", "0.5"]
    address = ray_cluster.get_runtime_context().gcs_address
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_ADDRESS=address)
    first = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while not (out.exists() and len(out.read_text().splitlines()) >= 40):
            assert first.poll() is None and time.time() < deadline, "the first run ended or stalled early"
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and anything it started
        first.wait()
    written = len(read_output(out))
    assert 40 <= written < 100
    with open(out, "ab") as f:  # a crash can leave half a line behind
        f.write(b'{"id": "g1')
    resumed = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_output(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 100 and set(ids) == good
    assert f"{written} already done" in resumed.stdout


def test_tensor_parallel_engines_in_the_batch_job(ray_cluster, tmp_path, model_path, llm_fp32):
    """Each engine actor splits its model over itself and one worker of its own placement
    group; greedy rows come out as the offline engine writes them."""
    prompts = [f"Count from {i}:" for i in range(6)]
    lines = [
        json.dumps({"id": str(i), "prompt": p, "temperature": 0, "max_tokens": 8})
        for i, p in enumerate(prompts)
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = run_batch(
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out.jsonl"),
        engine_args={"model": str(model_path), "dtype": "float32", "tensor_parallel_size": 2},
        min_replicas=1,
        max_replicas=1,
        batch_size=3,
        num_cpus_per_replica=0.5,
    )
    assert summary.rows == 6 and summary.errors == 0
    want = llm_fp32.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    by_id = {r["id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert [by_id[str(i)]["text"] for i in range(6)] == [o.text for o in want]


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory, model_path) -> str:
    """A seeded random LoRA adapter of the bundled model, on every projection, as PEFT
    saves it: far enough from the base model that greedy text changes."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    path = tmp_path_factory.mktemp("lora-adapter")
    save_lora_adapter(model, path, rank=8, seed=0)
    return str(path)


def test_rows_pick_the_base_model_or_a_lora_adapter_by_model(ray_cluster, tmp_path, model_path, lora_adapter):
    """Each prompt runs on the base model (no `model`, or its name) and on the adapter;
    a row naming a model the batch does not serve is an error row, not a failed job."""
    prompts = ["Count from 1:", "The capital of France is"]
    rows = []
    for i, prompt in enumerate(prompts):
        for model in (None, model_path.name, "tiny-lora"):
            rows.append(
                {"id": f"{i}-{model}", "prompt": prompt, "model": model, "temperature": 0, "max_tokens": 4}
            )
    rows.append({"id": "unknown", "prompt": prompts[0], "model": "no-such-model", "max_tokens": 4})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = run_batch(
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out.jsonl"),
        engine_args={"model": str(model_path), "dtype": "float32"},
        max_replicas=1,
        batch_size=len(rows),
        num_cpus_per_replica=0.5,
        lora_modules={"tiny-lora": lora_adapter},
    )
    by_id = {r["id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert summary.rows == len(rows) and summary.errors == 1
    assert "unknown model 'no-such-model'" in by_id["unknown"]["error"]
    assert "tiny-lora" in by_id["unknown"]["error"]
    for i in range(len(prompts)):
        base, named, adapted = (by_id[f"{i}-{m}"] for m in (None, model_path.name, "tiny-lora"))
        assert base["error"] is named["error"] is adapted["error"] is None
        assert adapted["completion_tokens"] == 4
        assert named["text"] == base["text"]
        assert adapted["text"] != base["text"], (i, base["text"], adapted["text"])
