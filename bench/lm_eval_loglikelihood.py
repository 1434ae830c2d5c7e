"""lm-eval's loglikelihood path end to end against `kvserve serve`, checked against HF.

Starts `kvserve serve --dtype float32` on a free port, runs lm-eval's `local-completions`
model on a small made-up multiple-choice task (bench/lm_eval/: 20 questions, 80
loglikelihood requests, each echo=True, logprobs=1, max_tokens=1, temperature 0, the
prompt as token ids), then recomputes every logged loglikelihood with HF transformers in
fp32 on the bundled model and records the largest difference (it must stay under 1e-4)
in bench/results/lm_eval_loglikelihood_<machine>.json, with lm-eval's results.

lm-eval is not a kvserve dependency; install it into the venv first, keeping its torch:
    .venv/bin/pip install lm_eval torch==2.13.0
Then: `make bench-lm-eval`, or .venv/bin/python -m bench.lm_eval_loglikelihood
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

from bench.machine import ROOT, machine, write_result
from bench.servers import Server, free_port, kvserve_command
from replica.model_loader import resolve_model

TASK = "kvserve_mc"
TASKS_DIR = ROOT / "bench" / "lm_eval"
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4


def run_lm_eval(port: int, model_path: Path, out: Path) -> None:
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url=http://127.0.0.1:{port}/v1/completions",
            f"tokenizer={model_path}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    command = [str(ROOT / ".venv/bin/lm_eval"), "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", TASK, "--include_path", str(TASKS_DIR), "--batch_size", "1"]
    command += ["--log_samples", "--output_path", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def read_outputs(out: Path) -> tuple[dict, list[dict]]:
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    lines = next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    return results, samples


def hf_loglikelihoods(model_path: Path, samples: list[dict]) -> list[dict]:
    """Each request's (context, continuation) as lm-eval encodes it (trailing spaces of
    the context move to the continuation; the whole is tokenized, then split after the
    context's tokens), scored by HF in fp32: the sum of the continuation's logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rows = []
    for sample in samples:
        for arguments, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            start = len(tokenizer(context, add_special_tokens=False).input_ids)
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits[start - 1 : -1], dim=-1)
            targets = torch.tensor(whole[start:])
            chosen = logprobs.gather(1, targets[:, None])[:, 0]
            greedy = bool((logprobs.argmax(dim=-1) == targets).all())
            served, served_greedy = response[0]  # the first repeat's, logged as strings
            served, served_greedy = float(served), str(served_greedy) == "True"
            rows.append(
                {
                    "doc_id": sample["doc_id"],
                    "continuation": continuation,
                    "kvserve": served,
                    "hf": chosen.sum().item(),
                    "kvserve_is_greedy": served_greedy,
                    "hf_is_greedy": greedy,
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/lm_eval_loglikelihood_<machine>.json"
    )
    args = parser.parse_args()
    model_path = resolve_model(None)
    port = free_port()
    log = Path(tempfile.gettempdir()) / "lm_eval_kvserve.log"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        server = Server(kvserve_command(port, "float32", free_port()), port, log).start()
        try:
            server.wait_ready(timeout_s=900)
            started = time.monotonic()
            run_lm_eval(port, model_path, out)
            lm_eval_s = time.monotonic() - started
        finally:
            server.stop(signal.SIGINT)  # as Ctrl-C: `kvserve serve` then stops the local Ray it started
        results, samples = read_outputs(out)
    rows = hf_loglikelihoods(model_path, samples)
    max_diff = max(abs(r["kvserve"] - r["hf"]) for r in rows)
    greedy_agree = sum(r["kvserve_is_greedy"] == r["hf_is_greedy"] for r in rows)
    host = machine(
        platform=platform.platform(),
        python=platform.python_version(),
        transformers=version("transformers"),
        lm_eval=version("lm_eval"),
    )
    report = {
        "task": TASK,
        "what": "lm-eval local-completions loglikelihoods from `kvserve serve --dtype float32` "
        "(echo + logprobs = prompt logprobs) against HF transformers fp32 over the same tokens",
        "lm_eval_results": results["results"][TASK],
        "lm_eval_config": {
            "model": results.get("config", {}).get("model"),
            "model_args": results.get("config", {}).get("model_args"),
        },
        "num_requests": len(rows),
        "max_abs_diff": max_diff,
        "tolerance": TOLERANCE,
        "is_greedy_agree": f"{greedy_agree}/{len(rows)}",
        "lm_eval_seconds": lm_eval_s,
        "requests": rows,
    }
    path = write_result("lm_eval_loglikelihood", args, report, host, args.out)
    print(f"{len(rows)} loglikelihoods; max |kvserve - HF| = {max_diff:.3g} (tolerance {TOLERANCE:g})")
    print(f"wrote {path}")
    return 0 if max_diff < TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
