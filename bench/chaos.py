"""Chaos run, like Ray's serve_failure release test, bounded and on loopback: steady
streaming load through the openai client on a Serve app of several replicas, while a
random LLMServer replica is killed every few seconds, and once each the coordinator,
the HTTP proxy and the ingress replica.

Every request sent is accounted for: answered in full with the text an undisturbed
server gives (greedy, so each prompt has one right answer, asked before the first kill),
answered short or with another text, failed (by kind, with its HTTP status), or lost
(neither answered nor failed by the end). A failure is excused only inside an outage
the run itself caused, of the proxy or the ingress, measured from just before the kill
until the component answered again: the requests in flight through it die with it, and
new connections are refused until it is back. Also counted: migrations (from /metrics),
5xx in and outside those outages, blocks free at the end, and recovery time after each
kill. A killed replica's replacement is awaited while the run goes on (one replica at
least stays up); the coordinator, the proxy and the ingress are each awaited before the
next kill, so that each one's recovery is timed on its own. `ChaosReport.problems()`
lists every broken promise; an empty list is a pass.

    python -m bench.chaos                    # -> bench/results/chaos_<machine>.json
    python -m bench.chaos --duration 30      # shorter

tests/test_migration.py runs a short version in CI through `run_chaos`, on the app its
migration test ran on.
"""

import argparse
import json
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    """One request, recorded when it is sent; times in seconds on the monotonic clock."""

    prompt: int  # its index in PROMPTS
    started: float
    ended: float | None = None  # None: neither answered nor failed (yet)
    # "ok" (in full, the undisturbed text), "short answer", "wrong text", "http error",
    # "timeout", "error event", or the client's error class.
    status: str = "in flight"
    http_status: int | None = None  # of a failed request, where there was one
    message: str = ""  # of a failed request
    text: str = ""  # what was streamed


@dataclass
class Kill:
    target: str  # "replica", "coordinator", "proxy" or "ingress"
    at: float  # seconds into the run, just before the kill
    recovered_after_s: float | None = None  # measured; None: not back within the time allowed
    running: int | None = None  # of a killed replica: its running requests, as last reported
    victim: str | None = None  # of a killed replica: its id

    def outage(self) -> tuple[float, float] | None:
        """When requests through the proxy or the ingress may fail (s into the run): from
        just before its kill until it answered again; until the run's end if it never did."""
        if self.target not in ("proxy", "ingress"):
            return None
        return self.at, self.at + (self.recovered_after_s if self.recovered_after_s is not None else 1e9)


@dataclass
class ChaosReport:
    duration_s: float
    replicas: int
    clients: int
    max_tokens: int
    started: float = 0.0  # the run's start, on the monotonic clock
    requests: int = 0
    answered_in_full: int = 0
    migrated: float = 0.0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    http_5xx: int = 0
    http_5xx_outside_outages: int = 0
    errors_outside_proxy_or_ingress_outages: int = 0
    # Each of those: its kind, message, and when it started and ended (s into the run).
    unexplained_errors: list[str] = field(default_factory=list)
    wrong_texts: int = 0  # answered in full, but not with the undisturbed text
    lost: int = 0  # neither answered nor failed by the end
    blocks_free_at_end: bool = False
    kills: list[Kill] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def max_recovery_s(self) -> float | None:
        times = [k.recovered_after_s for k in self.kills]
        return None if None in times or not times else max(times)

    def count(self) -> None:
        """The counts, from `outcomes` and `kills`."""
        outages = [window for k in self.kills if (window := k.outage())]

        def excused(o: Outcome) -> bool:
            start, end = o.started - self.started, o.ended - self.started
            return any(start <= until and end >= since for since, until in outages)

        done = [o for o in self.outcomes if o.ended is not None]
        failed = [o for o in done if o.status != "ok"]
        # A stream that ends, short or with another text, is wrong whenever it ends.
        unexplained = [o for o in failed if o.status in ("short answer", "wrong text") or not excused(o)]
        self.requests = len(self.outcomes)
        self.lost = len(self.outcomes) - len(done)
        self.answered_in_full = len(done) - len(failed)
        self.errors_by_kind = dict(Counter(o.status for o in failed))
        self.wrong_texts = self.errors_by_kind.get("wrong text", 0)
        self.http_5xx = sum(o.http_status is not None and o.http_status >= 500 for o in failed)
        self.http_5xx_outside_outages = sum(
            o.http_status is not None and o.http_status >= 500 for o in unexplained
        )
        self.errors_outside_proxy_or_ingress_outages = len(unexplained)
        self.unexplained_errors = [
            f"{o.status} {o.http_status or ''} {o.message[:200]!r}, "
            f"from {o.started - self.started:.1f} s to {o.ended - self.started:.1f} s"
            for o in unexplained
        ]

    def problems(self, recover_s: float) -> list[str]:
        """What broke the promise of docs/failures.md: no request lost, no 5xx and no
        failure outside the outages the run caused, every answer in full the undisturbed
        one, every component back within recover_s, every block free at the end."""
        found = []
        if self.lost:
            found.append(f"{self.lost} of {self.requests} requests lost")
        if self.http_5xx_outside_outages:
            found.append(f"{self.http_5xx_outside_outages} 5xx outside the proxy's and the ingress's outages")
        if self.unexplained_errors:
            found.append(f"failed outside the outages: {self.unexplained_errors}")
        not_back = [
            k.target for k in self.kills if k.recovered_after_s is None or k.recovered_after_s > recover_s
        ]
        if not_back:
            found.append(f"not back within {recover_s:g} s: {not_back}")
        if not self.blocks_free_at_end:
            found.append("KV blocks still taken at the end")
        return found


def snapshot(app: str) -> dict[str, ReplicaReport]:
    """The replicas' reports; none while the coordinator is down (killed, or coming back)."""
    try:
        return reports(app, timeout_s=5)
    except Exception:
        return {}


def greedy_completion(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, stream: bool):
    """Greedy, so that a prompt has one right answer, and never stopped early by EOS."""
    return client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body={"ignore_eos": True},
    )


def undisturbed_texts(base_url: str, model: str, prompts: int, max_tokens: int) -> list[str]:
    """Each prompt's answer before anything is killed, all asked at once as in the run."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=120)
    with ThreadPoolExecutor(prompts) as pool:
        answers = [
            pool.submit(greedy_completion, client, model, prompt, max_tokens, stream=False)
            for prompt in PROMPTS[:prompts]
        ]
        return [answer.result().choices[0].text for answer in answers]


def verdict(text: str, tokens: int | None, expected: str, max_tokens: int) -> tuple[str, str]:
    """A finished stream's status and what is wrong with it: "ok" only in full (usage
    counts max_tokens) with the undisturbed text."""
    if tokens != max_tokens:
        return "short answer", f"{tokens} of {max_tokens} tokens"
    if text != expected:
        same = len(os.path.commonprefix([text, expected]))
        return "wrong text", f"{len(text)} characters, the first {same} of {len(expected)} undisturbed"
    return "ok", ""


def _client_loop(
    base_url: str,
    model: str,
    expected: list[str],
    max_tokens: int,
    stop: threading.Event,
    flowing: threading.Event,
    outcomes: list[Outcome],
) -> None:
    """Streams completions of the prompts `expected` answers until `stop`; sets `flowing`
    at the first text streamed. Each request is in `outcomes` from the moment it is sent."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0, timeout=120)
    rng = random.Random(threading.get_ident())
    while not stop.is_set():
        outcome = Outcome(rng.randrange(len(expected)), time.monotonic())
        outcomes.append(outcome)
        status = "ok"
        try:
            tokens = None
            for chunk in greedy_completion(client, model, PROMPTS[outcome.prompt], max_tokens, stream=True):
                if chunk.choices and chunk.choices[0].text:
                    outcome.text += chunk.choices[0].text
                    flowing.set()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            status, outcome.message = verdict(outcome.text, tokens, expected[outcome.prompt], max_tokens)
        except openai.APIStatusError as e:
            status, outcome.http_status, outcome.message = "http error", e.status_code, str(e)
        except openai.APITimeoutError:
            status = "timeout"
        except openai.APIError as e:  # connection refused or dropped, an error event mid-stream
            status = "error event" if "replica unavailable" in str(e) else type(e).__name__
            outcome.message = str(e)
        outcome.status, outcome.ended = status, time.monotonic()
        if status != "ok":
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
        actor = ray.get_actor(f"SERVE_REPLICA::{app}#LLMServer#{victim}", namespace="serve")

        def back() -> bool:
            now = snapshot(app)
            return len(now) == replicas - len(down) + 1 and victim not in now

    elif target == "coordinator":
        actor = coordinator(app)

        def back() -> bool:
            return len(snapshot(app)) == replicas - len(down)

    else:
        actor = _serve_actor(
            "SERVE_PROXY_ACTOR" if target == "proxy" else f"SERVE_REPLICA::{app}#OpenAIIngress"
        )

        def back() -> bool:
            return _serving(base_url, model)

    kill = Kill(target, time.monotonic() - run_started, running=running, victim=victim)
    ray.kill(actor)
    return kill, back


def _time_recovery(kill: Kill, back, recover_s: float, down: set[str], run_started: float) -> None:
    """Sets kill.recovered_after_s: from just before the kill to the first time `back`
    held, measured."""
    time.sleep(0.5)  # let the death be noticed before asking whether it is over
    if _wait(back, recover_s) is not None:
        kill.recovered_after_s = time.monotonic() - run_started - kill.at
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
    prompts: int = len(PROMPTS),
) -> ChaosReport:
    """On a deployed app of `replicas` LLMServer replicas serving `model` (Serve's HTTP on
    `http_port`): load, kill, count. Replica kills go on every kill_every_s; the
    coordinator, proxy and ingress are each killed once, spread over the run. The clients
    ask the first `prompts` of PROMPTS."""
    base_url = f"http://127.0.0.1:{http_port}/{app}"
    report = ChaosReport(duration_s, replicas, clients, max_tokens)
    _wait(lambda: len(snapshot(app)) == replicas, 60)
    expected = undisturbed_texts(base_url, model, prompts, max_tokens)
    migrated_before = _migrations(base_url)
    stop, flowing = threading.Event(), threading.Event()
    client_args = (base_url, model, expected, max_tokens, stop, flowing, report.outcomes)
    threads = [threading.Thread(target=_client_loop, args=client_args, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:  # the clients stop however the run ends: a raise here would leave them sending
        # Kills start once streams flow: before that, a killed replica's requests have
        # sent nothing and are simply sent again, so a kill would test no migration.
        flowing.wait(recover_s)
        report.started = started = time.monotonic()
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
            recovery = (kill, back, recover_s, down, started)
            if target == "replica":  # timed while the run goes on; the others one at a time
                replacement = threading.Thread(target=_time_recovery, args=recovery)
                replacement.start()
                replacements.append(replacement)
            else:
                _time_recovery(*recovery)
        for replacement in replacements:
            replacement.join()
    finally:
        stop.set()
    for t in threads:  # a request still unanswered after this is lost
        t.join(timeout=150)
    report.migrated += _migrations(base_url) - migrated_before
    report.count()

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
    # fp32: a migrated stream recomputes its KV, and only in fp32 does that round exactly as
    # the decode steps did, so that its text is the undisturbed one.
    parser.add_argument("--dtype", default="float32")
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
    result = {
        "single_run": True,
        **asdict(report),
        "max_recovery_s": report.max_recovery_s,
        "problems": report.problems(recover_s=60.0),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}, indent=2))
    print(f"wrote {write_result('chaos', args, result, machine(ray=ray.__version__), args.out)}")


if __name__ == "__main__":
    main()
