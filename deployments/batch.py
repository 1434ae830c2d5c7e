"""Batch inference on Ray Data: rows in, one engine per actor of an autoscaling actor
pool, rows out.

Input: JSONL (one object per line) or Parquet, each row with `prompt` or `messages`,
optional sampling fields (`max_tokens`, `temperature`, ... as in SamplingParams) and an
optional `id` (default: a hash of the row). With LoRA adapters (`lora_modules`, name ->
folder), a row's optional `model` picks what runs it: an adapter's name, or the base
model's name (or none) for the base model; any other name is an error row. Output:
JSONL, or a directory of Parquet parts, with id, text, finish_reason, prompt_tokens,
completion_tokens and error.

JSONL is read as text and parsed in the actors, so a malformed line is one error row,
not a failed read, and a row whose id an earlier row has is an error row too. The
driver appends each finished batch to the output and syncs it, so after a crash
`--resume` skips the ids already written: no row is lost or written twice.
"""

import dataclasses
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from tqdm import tqdm

from replica.chat_template import chat_prompt_ids
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model_loader import BUNDLED_NAME, is_hub_id
from wire.lora_request import LoRARequest
from wire.sampling_params import SamplingParams

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("error", pa.string()),
    ]
)


@dataclass
class BatchSummary:
    rows: int
    errors: int
    skipped: int  # already in the output (--resume)
    generated_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def row_id(row: dict, raw: str | None = None) -> str:
    if row.get("id") is not None:
        return str(row["id"])
    text = raw if raw is not None else json.dumps(row, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def parse_line(line: str) -> tuple[str, dict | None, str | None]:
    """(id, row, error) for one JSONL line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return row_id({}, line), None, f"invalid JSON: {e}"
    if not isinstance(row, dict):
        return row_id({}, line), None, "a row must be a JSON object"
    return row_id(row, line if row.get("id") is None else None), row, None


def base_model_names(model: str | None) -> set[str]:
    """What a row's `model` may say to run the base model: the engine's `model` argument
    as given, and the name the Serve app gives it (`kvserve serve` without
    --served-model-name): the hub id, the directory's name, or the bundled model's name."""
    if model is None:
        return {BUNDLED_NAME}
    return {str(model), model if is_hub_id(model) else str(model).rstrip("/").rsplit("/", 1)[-1]}


class Generator:
    """One engine per actor; each call runs a whole batch through it, so the engine
    batches continuously inside the batch."""

    def __init__(self, engine_args: dict, lora_modules: dict[str, str] | None = None):
        self.engine = Engine(EngineConfig.from_kwargs(**engine_args))
        # Ids by position in lora_modules: every actor gets the same dict, so the same ids.
        modules = (lora_modules or {}).items()
        self.loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(modules)}
        self.base_names = base_model_names(engine_args.get("model"))

    def __call__(self, batch: pa.Table) -> dict:
        rows = batch.to_pylist()  # plain Python values, as in the input file
        if "text" in batch.column_names:  # JSONL lines
            parsed = [parse_line(row["text"]) for row in rows]
        else:  # Parquet rows
            parsed = [(row_id(row), row, None) for row in rows]
        results: dict[str, dict] = {}  # by id: the rows queued in the engine, and errors
        duplicates = []  # a row whose id an earlier row of this batch has: an error row of its own
        for rid, row, error in parsed:
            if rid in results:
                duplicates.append(_result(rid, error=duplicate_id_error(rid)))
                continue
            if error is None:
                error = self._add(rid, row)
            results[rid] = _result(rid, error=error)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = _result(
                        out.request_id,
                        text=out.output.text,
                        finish_reason=out.finish_reason,
                        prompt_tokens=out.num_prompt_tokens,
                        completion_tokens=out.num_output_tokens,
                    )
        columns = {name: [] for name in OUTPUT_SCHEMA.names}
        for result in [*results.values(), *duplicates]:
            for name in columns:
                columns[name].append(result[name])
        return columns

    def _add(self, rid: str, row: dict) -> str | None:
        """Queue one row in the engine; a bad row gets an error instead."""
        try:
            fields = {k: v for k, v in row.items() if k in SAMPLING_FIELDS and v is not None}
            params = SamplingParams(**fields)
            if params.n != 1:
                return "n must be 1 in a batch row: the output has one text per row"
            if row.get("messages") is not None:
                prompt = chat_prompt_ids(self.engine.tokenizer, list(row["messages"]))
            elif isinstance(row.get("prompt"), str):
                prompt = row["prompt"]
            else:
                return "a row needs a string `prompt` or a list of `messages`"
            lora = self._lora(row.get("model"))
            self.engine.add_request(prompt, params, request_id=rid, lora_request=lora)
        except Exception as e:  # anything wrong with one row fails that row only
            return f"{type(e).__name__}: {e}"
        return None

    def _lora(self, model: str | None) -> LoRARequest | None:
        """The adapter a row's `model` names; None for the base model. Without adapters
        the field is not read, as before they existed."""
        if not self.loras or model is None or model in self.base_names:
            return None
        if model in self.loras:
            return self.loras[model]
        raise ValueError(
            f"unknown model {model!r}: this batch runs {sorted(self.base_names)} "
            f"and the LoRA adapters {sorted(self.loras)}"
        )


def duplicate_id_error(rid: str) -> str:
    return f"duplicate id {rid!r}: an earlier row has it, so this row was not run"


def _result(
    rid: str, text=None, finish_reason=None, prompt_tokens=0, completion_tokens=0, error=None
) -> dict:
    return {
        "id": rid,
        "text": text,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "error": error,
    }


def is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet" or (path.is_dir() and any(path.glob("*.parquet")))


def done_ids(output: Path) -> set[str]:
    """Ids already written. A JSONL line cut short by a crash is dropped from the file."""
    if not output.exists():
        return set()
    if output.is_dir():
        parts = sorted(output.glob("*.parquet"))
        return {i for p in parts for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()}
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(complete))
    return {json.loads(line)["id"] for line in complete.splitlines() if line.strip()}


class OutputWriter:
    """Appends finished rows durably: JSONL lines, or one Parquet part per batch
    (written to a temporary name and renamed, so a part is whole or absent)."""

    def __init__(self, output: Path, parquet: bool):
        self.output, self.parquet = output, parquet
        (output if parquet else output.parent).mkdir(parents=True, exist_ok=True)

    def write(self, table: pa.Table) -> None:
        if self.parquet:
            tmp = self.output / f".part-{uuid.uuid4().hex}.tmp"
            pq.write_table(table, tmp)
            os.replace(tmp, self.output / f"part-{uuid.uuid4().hex}.parquet")
            return
        lines = "".join(json.dumps(row) + "\n" for row in table.to_pylist())
        with open(self.output, "ab") as f:
            f.write(lines.encode())
            f.flush()
            os.fsync(f.fileno())


def _mark_duplicates(table: pa.Table, written: set[str]) -> pa.Table:
    """Rows whose id an earlier batch of this run wrote become error rows: each input row
    still has its output row, and no id is answered twice. The actor checks ids within
    one batch. Adds the table's ids to `written`."""
    ids = table.column("id").to_pylist()
    seen_before = written.intersection(ids)
    written.update(ids)
    if not seen_before:  # the usual case: the batch's texts stay in Arrow
        return table
    rows = table.to_pylist()
    for row in rows:
        if row["id"] in seen_before and row["error"] is None:
            row.update(_result(row["id"], error=duplicate_id_error(row["id"])))
    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)


def run_batch(
    input_path: str,
    output_path: str,
    engine_args: dict | None = None,
    min_replicas: int = 1,
    max_replicas: int = 2,
    batch_size: int = 64,
    resume: bool = False,
    num_cpus_per_replica: float = 1.0,
    num_gpus_per_replica: float = 0.0,
    lora_modules: dict[str, str] | None = None,
) -> BatchSummary:
    """lora_modules: LoRA adapters by name -> local folder (PEFT files), which rows pick
    by their `model` field; the engine loads each on first use."""
    source, output = Path(input_path), Path(output_path)
    engine_args = dict(engine_args or {})
    if lora_modules:
        engine_args.setdefault("enable_lora", True)
        clash = base_model_names(engine_args.get("model")).intersection(lora_modules)
        if clash:
            raise ValueError(f"LoRA adapter names {sorted(clash)} are the base model's name")
    if "://" not in input_path and not source.exists():  # URIs (s3://...) go to Ray Data as they are
        raise FileNotFoundError(f"no input at {source}")
    parquet_out = output.suffix == ".parquet" or (output.is_dir() and is_parquet(output))
    if not resume and output.exists():
        raise FileExistsError(f"{output} exists: pass --resume to continue it, or remove it")
    skip = done_ids(output) if resume else set()

    if is_parquet(source):
        ds = ray.data.read_parquet(input_path)
        ds = ds.filter(lambda row: row_id(row) not in skip) if skip else ds
    else:
        ds = ray.data.read_text(input_path).filter(lambda row: bool(row["text"].strip()))
        ds = ds.filter(lambda row: parse_line(row["text"])[0] not in skip) if skip else ds
    ds = ds.map_batches(
        Generator,
        fn_constructor_kwargs={"engine_args": engine_args, "lora_modules": lora_modules},
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=min_replicas, max_size=max_replicas),
        num_cpus=num_cpus_per_replica,
        num_gpus=num_gpus_per_replica,
    )

    writer = OutputWriter(output, parquet_out)
    start, rows, errors, tokens = time.perf_counter(), 0, 0, 0
    written: set[str] = set()
    progress = tqdm(desc="rows", unit="row")
    try:
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            table = table.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)
            table = _mark_duplicates(table, written)
            writer.write(table)
            rows += table.num_rows
            errors += table.num_rows - table.column("error").null_count
            tokens += sum(table.column("completion_tokens").to_pylist())
            progress.update(table.num_rows)
            progress.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - start):.0f}", errors=errors)
    finally:
        progress.close()
    return BatchSummary(rows, errors, len(skip), tokens, time.perf_counter() - start)
