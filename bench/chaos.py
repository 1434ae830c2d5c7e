"""Chaos run, like Ray's serve_failure release test, bounded and on loopback: steady
streaming load through the openai client on a Serve app of several replicas, while a
random LLMServer replica is killed every few seconds, and once each the coordinator,
the HTTP proxy and the ingress replica.

Counted: requests answered in full, migrated (from /metrics), errors by kind, 5xx,
errors outside the outage of the proxy or the ingress (from just before the kill until
the component answered again: the requests in flight through it die with it, and new
connections are refused until it is back), blocks free at the end, and recovery time
after each kill. A killed replica's replacement is awaited while the run goes on (one
replica at least stays up); the coordinator, the proxy and the ingress are each awaited
before the next kill, so that each one's recovery is timed on its own.

    python -m bench.chaos                    # -> bench/results/chaos_<machine>.json
    python -m bench.chaos --duration 30      # shorter

tests/test_migration.py runs a short version in CI through `run_chaos`, on the app its
migration test ran on.
"""

import argparse
import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import ray

from bench.machine import machine, write_result
from bench.serve_apps import coordinator, deploy, local_serve, undeploy
from bench.serve_apps import snapshot as reports
from wire.messages import ReplicaReport

APP, MODEL = "chaos", "chaos-model"
PROMPTS = [f"Request {i}: tell me about the sea and the ships on it." for i in range(32)]


@dataclass
class Outcome:
    started: float
    ended: float
    status: str  # "ok", or the error's kind
    http_status: int | None = None  # of a failed request, where there was one
    message: str = ""  # of a failed request


@dataclass
class Kill:
    target: str  # "replica", "coordinator", "proxy" or "ingress"
    at: float  # seconds into the run
    recovered_after_s: float | None = None  # None: not back within the time allowed
    running: int | None = None  # of a killed replica: its running requests, as last reported
    victim: str | None = None  # of a killed replica: its id


@dataclass
class ChaosReport:
    duration_s: float
    replicas: int
    clients: int
    max_tokens: int
    requests: int = 0
    answered_in_full: int = 0
    migrated: float = 0.0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    http_5xx: int = 0
    errors_outside_proxy_or_ingress_outages: int = 0
    # Each of those: its kind, message, and when it started and ended (s into the run).
    unexplained_errors: list[str] = field(default_factory=list)
    lost: int = 0  # neither answered nor failed with an error in time
    blocks_free_at_end: bool = False
    kills: list[Kill] = field(default_factory=list)

    @property
    def max_recovery_s(self) -> float | None:
        times = [k.recovered_after_s for k in self.kills]
        return None if None in times or not times else max(times)


def snapshot(app: str) -> dict[str, ReplicaReport]:
    """The replicas' reports; none while the coordinator is down (killed, or coming back)."""
    try:
        return reports(app, timeout_s=5)
    except Exception:
        return {}


def _client_loop(
    base_url: str,
    model: str,
    max_tokens: int,
    stop: threading.Event,
    flowing: threading.Event,
    outcomes: list[Outcome],
) -> None:
    """Streams completions until `stop`; sets `flowing` at the first text streamed."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=120)
    rng = random.Random(threading.get_ident())
    while not stop.is_set():
        started = time.monotonic()
        try:
            stream = client.completions.create(
                model=model,
                prompt=rng.choice(PROMPTS),
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            tokens = None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    flowing.set()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            ok = tokens == max_tokens
            outcomes.append(Outcome(started, time.monotonic(), "ok" if ok else "short answer"))
        except openai.APIStatusError as e:
            outcomes.append(Outcome(started, time.monotonic(), "http error", e.status_code, str(e)))
        except openai.APITimeoutError:
            outcomes.append(Outcome(started, time.monotonic(), "timeout"))
        except openai.APIError as e:  # connection refused or dropped, an error event mid-stream
            kind = "error event" if "replica unavailable" in str(e) else type(e).__name__
            outcomes.append(Outcome(started, time.monotonic(), kind, message=str(e)))
            time.sleep(0.2)  # a client backs off before it retries


def _serve_actor(prefix: str):
    """The one live Serve actor whose name starts with `prefix`."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix):
            return ray.get_actor(actor["name"], namespace="serve")
    raise LookupError(prefix)


def _wait(condition, timeout_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if condition():
                return time.monotonic() - started
        except Exception:
            pass
        time.sleep(0.1)
    return None


def _serving(base_url: str, model: str) -> bool:
    reply = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": "Hi", "max_tokens": 1},
        timeout=10,
    )
    return reply.status_code == 200


def _busiest_replica(app: str, wait_s: float) -> tuple[str, int]:
    """The replica running the most requests by a fresh report, and how many. Waits up to
    wait_s for one that runs any: killing an idle replica would leave nothing to migrate,
    and on a loaded machine a snapshot can catch every replica between requests, or miss
    the busy one's report. After wait_s, any report will do."""
    deadline = time.monotonic() + wait_s
    while True:
        late = time.monotonic() > deadline
        running = {r: s.num_running for r, s in snapshot(app).items() if late or s.age_s < 1.0}
        if running:
            victim = max(sorted(running), key=lambda r: (running[r], random.random()))
            if running[victim] > 0 or late:
                return victim, running[victim]
        elif late:
            raise LookupError(f"no replica of {app} reported in {wait_s} s")
        time.sleep(0.1)


def _kill(
    app: str,
    model: str,
    target: str,
    replicas: int,
    base_url: str,
    down: set[str],
    recover_s: float,
    run_started: float,
) -> tuple[Kill, Callable[[], bool]]:
    """Kill one component. Returns its Kill and a check that it is back: a replica's is
    that Serve replaced it and every replica up reports, a coordinator's that every
    replica up reports to the new one, the proxy's and the ingress's that a request is
    answered. `down`: the replicas killed and not yet replaced."""
    running = victim = None
    if target == "replica":
        victim, running = _busiest_replica(app, recover_s)
        down.add(victim)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{app}#LLMServer#{victim}", namespace="serve"))

        def back() -> bool:
            now = snapshot(app)
            return len(now) == replicas - len(down) + 1 and victim not in now

    elif target == "coordinator":
        ray.kill(coordinator(app))

        def back() -> bool:
            return len(snapshot(app)) == replicas - len(down)

    else:
        prefix = "SERVE_PROXY_ACTOR" if target == "proxy" else f"SERVE_REPLICA::{app}#OpenAIIngress"
        ray.kill(_serve_actor(prefix))

        def back() -> bool:
            return _serving(base_url, model)

    at = round(time.monotonic() - run_started, 2)
    return Kill(target, at, running=running, victim=victim), back


def _time_recovery(kill: Kill, back, recover_s: float, down: set[str]) -> None:
    time.sleep(0.5)  # let the death be noticed before asking whether it is over
    waited = _wait(back, recover_s)
    kill.recovered_after_s = None if waited is None else round(waited + 0.5, 2)
    if kill.victim is not None:
        down.discard(kill.victim)


def _migrations(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.search(r"^kvserve:request_migrations_total\{[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def run_chaos(
    app: str,
    model: str,
    http_port: int,
    replicas: int,
    clients: int = 6,
    duration_s: float = 120.0,
    kill_every_s: float = 8.0,
    max_tokens: int = 48,
    recover_s: float = 60.0,
) -> ChaosReport:
    """On a deployed app of `replicas` LLMServer replicas serving `model` (Serve's HTTP on
    `http_port`): load, kill, count. Replica kills go on every kill_every_s; the
    coordinator, proxy and ingress are each killed once, spread over the run."""
    base_url = f"http://127.0.0.1:{http_port}/{app}"
    report = ChaosReport(duration_s, replicas, clients, max_tokens)
    _wait(lambda: len(snapshot(app)) == replicas, 60)
    migrated_before = _migrations(base_url)
    stop, flowing, outcomes = threading.Event(), threading.Event(), []
    threads = [
        threading.Thread(
            target=_client_loop, args=(base_url, model, max_tokens, stop, flowing, outcomes), daemon=True
        )
        for _ in range(clients)
    ]
    for t in threads:
        t.start()
    try:  # the clients stop however the run ends: a raise here would leave them sending
        # Kills start once streams flow: before that, a killed replica's requests have
        # sent nothing and are simply sent again, so a kill would test no migration.
        flowing.wait(recover_s)
        started = time.monotonic()
        rounds = max(4, int(duration_s // kill_every_s))
        once = {rounds // 4: "coordinator", rounds // 2: "proxy", 3 * rounds // 4: "ingress"}
        # A replica comes back in 20-40 s (a new worker process imports torch and
        # transformers): the run goes on killing the other components meanwhile.
        down: set[str] = set()
        replacements = []
        for i in range(rounds):
            time.sleep(max(0.0, started + (i + 1) * kill_every_s - time.monotonic()))
            target = once.get(i, "replica")
            if target == "ingress":  # its counters die with it: bank them first
                report.migrated += _migrations(base_url) - migrated_before
                migrated_before = 0.0
            if target == "replica":  # one replica at least stays up
                _wait(lambda: len(down) < replicas - 1, recover_s)
            kill, back = _kill(app, model, target, replicas, base_url, down, recover_s, started)
            report.kills.append(kill)
            if target == "replica":  # timed while the run goes on; the others one at a time
                replacement = threading.Thread(target=_time_recovery, args=(kill, back, recover_s, down))
                replacement.start()
                replacements.append(replacement)
            else:
                _time_recovery(kill, back, recover_s, down)
        for replacement in replacements:
            replacement.join()
    finally:
        stop.set()
    for t in threads:
        t.join(timeout=150)
    report.lost = sum(t.is_alive() for t in threads)
    report.requests = len(outcomes)
    report.answered_in_full = sum(o.status == "ok" for o in outcomes)
    failed = [o for o in outcomes if o.status != "ok"]
    report.errors_by_kind = dict(Counter(o.status for o in failed))
    report.http_5xx = sum(o.http_status is not None and o.http_status >= 500 for o in failed)
    outages = [
        (started + k.at - 1.0, started + k.at + (k.recovered_after_s or duration_s) + 1.0)
        for k in report.kills
        if k.target in ("proxy", "ingress")
    ]
    unexplained = [
        o for o in failed if not any(o.started <= end and o.ended >= start for start, end in outages)
    ]
    report.errors_outside_proxy_or_ingress_outages = len(unexplained)
    report.unexplained_errors = [
        f"{o.status} {o.http_status or ''} {o.message[:200]!r}, "
        f"from {o.started - started:.1f} s to {o.ended - started:.1f} s"
        for o in unexplained
    ]
    report.migrated += _migrations(base_url) - migrated_before

    def all_free() -> bool:
        replicas_now = snapshot(app)
        idle = [
            s.num_free_blocks == s.num_total_blocks and not (s.num_running or s.num_waiting)
            for s in replicas_now.values()
        ]
        return len(idle) == replicas and all(idle)

    report.blocks_free_at_end = _wait(all_free, 30) is not None
    return report


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--kill-every", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/chaos_<machine>.json")
    args = parser.parse_args()
    port = 18531
    with local_serve(port, log_to_driver=True):
        config = {"app_name": APP, "model": None, "served_model_name": MODEL, "replicas": args.replicas}
        deploy({**config, "engine_args": {"dtype": args.dtype}}, route_prefix=f"/{APP}")
        try:
            report = run_chaos(
                APP,
                MODEL,
                port,
                args.replicas,
                clients=args.clients,
                duration_s=args.duration,
                kill_every_s=args.kill_every,
                max_tokens=args.max_tokens,
            )
        finally:
            undeploy(APP)
    result = {"single_run": True, **asdict(report), "max_recovery_s": report.max_recovery_s}
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('chaos', args, result, machine(ray=ray.__version__), args.out)}")


if __name__ == "__main__":
    main()
