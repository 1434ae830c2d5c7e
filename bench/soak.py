"""Soak: a bounded load of mixed traffic on 2 replicas, checking that nothing is lost.

Requests go over HTTP (SSE or JSON) and gRPC (streaming or unary), half each, from a
pool of client threads. 20% are cancelled mid-stream, 5% are malformed (bad JSON,
invalid UTF-8, wrong types, out-of-range values, unknown model, oversized body), the
rest are valid. Every valid request must complete, or fail cleanly (429 /
RESOURCE_EXHAUSTED, or an error event); nothing may get a 5xx (gRPC INTERNAL, UNKNOWN
or UNAVAILABLE count as 5xx), every KV block must be free at the end, and the RSS of
the Serve processes must stay flat after warm-up.

    python -m bench.soak            # 2000 requests -> bench/results/soak_<machine>.json
    python -m bench.soak --smoke    # 60 requests, to the temp dir
"""

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import random
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil
import ray

from bench.machine import machine, write_result
from bench.serve_apps import deploy, local_serve, snapshot
from bench.sse import sse_event
from router.api.protos import kvserve_pb2 as pb
from router.api.protos import kvserve_pb2_grpc as pb_grpc
from wire.messages import ReplicaReport

HTTP_PORT, GRPC_PORT = 18655, 18656
APP, MODEL = "soak", "kvserve-soak"
BASE = f"http://127.0.0.1:{HTTP_PORT}"
PROMPTS = [
    "Tell me about rivers.",
    "Write a haiku about stone.",
    "List three colours.",
    "Why is the sky blue?",
]
GRPC_SERVER_ERRORS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}
MAX_REQUEST_BYTES = 256 * 1024

_local = threading.local()


def clients() -> tuple[httpx.Client, pb_grpc.LLMStub]:
    """One HTTP client and one gRPC channel per client thread."""
    if not hasattr(_local, "http"):
        _local.http = httpx.Client(base_url=BASE, timeout=120)
        _local.stub = pb_grpc.LLMStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
    return _local.http, _local.stub


def valid_body(rng: random.Random) -> dict:
    return {
        "model": MODEL,
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(4, 24),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randint(0, 1000),
    }


MALFORMED_HTTP = [
    b"{not json",
    b'{"model": "kvserve-soak", "prompt": "\xff\xfe"}',
    json.dumps({"model": MODEL, "prompt": 42}).encode(),
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}).encode(),
    json.dumps({"model": MODEL, "prompt": "hi", "n": 4}).encode(),
    json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 99}).encode(),
    json.dumps({"model": MODEL, "prompt": []}).encode(),
    json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
    json.dumps({"model": MODEL, "prompt": "x" * (MAX_REQUEST_BYTES + 1)}).encode(),
]
MALFORMED_GRPC = [
    pb.GenerateRequest(model=MODEL, prompt="hi", params=pb.SamplingParams(max_tokens=4, temperature=-1)),
    pb.GenerateRequest(model=MODEL, prompt="", params=pb.SamplingParams(max_tokens=4)),
    pb.GenerateRequest(model="no-such-model", prompt="hi", params=pb.SamplingParams(max_tokens=4)),
]


def http_valid(body: dict, stream: bool, cancel_after: int | None) -> dict:
    http, _ = clients()
    if not stream:
        r = http.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"status": r.status_code}
        choice = r.json()["choices"][0]
        return {"status": 200, "finish": choice["finish_reason"]}
    events, finish, error = 0, None, None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        for line in r.iter_lines():
            if (event := sse_event(line)) is None:
                continue
            if "error" in event:
                error = event["error"]["code"]
                continue
            events += 1
            finish = event["choices"][0]["finish_reason"] or finish
            if cancel_after is not None and events >= cancel_after:
                return {"status": 200, "cancelled": True}
    return {"status": 200, "finish": finish, "stream_error": error}


def grpc_valid(body: dict, stream: bool, cancel_after: int | None) -> dict:
    _, stub = clients()
    params = pb.SamplingParams(
        max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body["seed"]
    )
    request = pb.GenerateRequest(model=MODEL, prompt=body["prompt"], params=params)
    metadata = [("application", APP)]
    try:
        if not stream:
            reply = stub.Generate(request, metadata=metadata, timeout=120)
            return {"status": "OK", "finish": reply.finish_reason}
        call = stub.GenerateStream(request, metadata=metadata, timeout=120)
        finish = None
        for events, chunk in enumerate(call, start=1):
            finish = chunk.finish_reason or finish
            if cancel_after is not None and events >= cancel_after:
                call.cancel()
                return {"status": "OK", "cancelled": True}
        return {"status": "OK", "finish": finish}
    except grpc.RpcError as e:
        return {"status": e.code().name, "server_error": e.code() in GRPC_SERVER_ERRORS}


def one_request(index: int, seed: int) -> dict:
    """Runs request `index` of the schedule and classifies how it ended."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choices(["valid", "cancelled", "malformed"], weights=[75, 20, 5])[0]
    protocol = rng.choice(["http", "grpc"])
    outcome = {"kind": kind, "protocol": protocol}
    try:
        if kind == "malformed":
            if protocol == "http":
                http, _ = clients()
                payload = rng.choice(MALFORMED_HTTP)
                r = http.post(
                    "/v1/completions", content=payload, headers={"content-type": "application/json"}
                )
                outcome["status"] = r.status_code
            else:
                _, stub = clients()
                try:
                    stub.Generate(rng.choice(MALFORMED_GRPC), metadata=[("application", APP)], timeout=60)
                    outcome["status"] = "OK"
                except grpc.RpcError as e:
                    outcome["status"] = e.code().name
                    outcome["server_error"] = e.code() in GRPC_SERVER_ERRORS
        else:
            body = valid_body(rng)
            stream = kind == "cancelled" or rng.random() < 0.5
            cancel_after = rng.randint(1, 3) if kind == "cancelled" else None
            if kind == "cancelled":
                body["max_tokens"] = 64  # long enough to still be running when dropped
            run = http_valid if protocol == "http" else grpc_valid
            outcome.update(run(body, stream, cancel_after))
    except Exception as e:  # a client-side failure: the request is lost
        outcome["exception"] = f"{type(e).__name__}: {e}"
    return outcome


def classify(outcome: dict) -> str:
    status = outcome.get("status")
    if "exception" in outcome:
        return "lost"
    if (isinstance(status, int) and status >= 500) or outcome.get("server_error"):
        return "server_error"
    if outcome["kind"] == "malformed":
        return "rejected" if status not in (200, "OK") else "accepted_malformed"
    if outcome["kind"] == "cancelled":
        return "cancelled" if outcome.get("cancelled") else ("completed" if outcome.get("finish") else "lost")
    if status in (429, "RESOURCE_EXHAUSTED") or outcome.get("stream_error"):
        return "clean_error"
    return "completed" if outcome.get("finish") in ("length", "stop") else "lost"


def serve_pids() -> dict[str, int]:
    """PIDs of this app's replicas and of the proxy, through Ray's named actors."""
    pids = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#") or name.startswith("SERVE_PROXY_ACTOR"):
            actor = ray.get_actor(name, namespace=entry["namespace"])
            pids[name.split("::")[-1]] = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    return pids


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    return {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}


def wait_idle(timeout_s: float = 60) -> dict[str, ReplicaReport]:
    deadline = time.monotonic() + timeout_s
    while True:
        reports = snapshot(APP)
        idle = all(not s.num_running and not s.num_waiting for s in reports.values())
        if (idle and len(reports) == 2) or time.monotonic() > deadline:
            return reports
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=200, help="requests before the first RSS reading")
    parser.add_argument("--phases", type=int, default=4, help="RSS readings after warm-up")
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/soak_<machine>.json")
    parser.add_argument("--smoke", action="store_true", help="60 requests, written to the temp dir")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.warmup, args.phases = 60, 20, 2

    engine_args = {"num_kv_blocks": args.kv_blocks, "max_num_seqs": 32}
    config = {"app_name": APP, "served_model_name": MODEL, "replicas": 2, "engine_args": engine_args}
    config["max_request_bytes"] = MAX_REQUEST_BYTES
    # RSS after warm-up and after each later phase: early phases still map KV pages
    # touched for the first time and warm allocator caches; a leak keeps growing.
    bounds = [args.warmup + (args.requests - args.warmup) * k // args.phases for k in range(args.phases + 1)]
    phases = [range(args.warmup)] + [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    outcomes: list[dict] = []
    rss = []
    with local_serve(HTTP_PORT, GRPC_PORT):
        deploy(config, route_prefix="/")
        pids = serve_pids()
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            for phase in phases:
                outcomes += pool.map(lambda i: one_request(i, args.seed), phase)
                final = wait_idle()
                rss.append(rss_mb(pids))
        seconds = time.perf_counter() - started

    counts = collections.Counter(classify(o) for o in outcomes)
    by_kind = collections.Counter(o["kind"] for o in outcomes)
    by_protocol = collections.Counter(o["protocol"] for o in outcomes)
    valid = [o for o in outcomes if o["kind"] == "valid"]
    valid_ok = sum(classify(o) in ("completed", "clean_error") for o in valid)
    free = {r: (s.num_free_blocks, s.num_total_blocks) for r, s in final.items()}
    result = {
        "replicas": 2,
        "engine_args": engine_args,
        "seconds": round(seconds, 1),
        "requests_per_s": round(len(outcomes) / seconds, 2),
        "requests": len(outcomes),
        "by_kind": dict(by_kind),
        "by_protocol": dict(by_protocol),
        "outcomes": dict(counts),
        "valid_completed_or_clean_error_pct": round(100 * valid_ok / max(len(valid), 1), 2),
        "server_errors": counts["server_error"],
        "lost": counts["lost"],
        "accepted_malformed": counts["accepted_malformed"],
        "kv_blocks_free_at_end": free,
        "all_blocks_free": all(f == t for f, t in free.values()) and len(free) == 2,
        "rss_mb_after_warmup": {k: round(v, 1) for k, v in rss[0].items()},
        "rss_mb_end": {k: round(v, 1) for k, v in rss[-1].items()},
        "rss_growth_mb_per_phase": {
            name: [round(after[name] - before[name], 1) for before, after in zip(rss, rss[1:], strict=False)]
            for name in pids
        },
        "examples_of_losses": [o for o in outcomes if classify(o) in ("lost", "server_error")][:10],
        "targets": {"valid_completed_or_clean_error_pct": 100, "server_errors": 0, "all_blocks_free": True},
    }
    print(json.dumps({k: result[k] for k in list(result)[2:18]}, indent=2))
    host = machine(platform=platform.platform(), ray=ray.__version__)
    print(f"wrote {write_result('soak', args, result, host, args.out, args.smoke)}")


if __name__ == "__main__":
    main()
