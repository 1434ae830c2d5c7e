"""A short chaos run (bench/chaos.py) in CI: streaming load on two replicas while a
replica, the coordinator, the HTTP proxy and the ingress are killed in turn.
Nothing may be lost or left hanging, every component must come back, every block must
be free at the end, and requests may fail only while the proxy or the ingress is down:
a replica's requests die with it no more, they migrate.

Back within 60 s, not the 30 s the chaos bench aims at: on two busy cores Serve takes
30-40 s to bring a replica back, about 26 s of it before the replica's constructor
runs (a new worker process importing torch and transformers)."""

from conftest import SERVE_HTTP_PORT

from bench.chaos import run_chaos


def test_a_short_chaos_run_loses_nothing(ray_cluster, model_path):
    report = run_chaos(
        str(model_path),
        SERVE_HTTP_PORT,
        app="chaos-test",
        replicas=2,
        clients=4,
        duration_s=16,
        kill_every_s=4,
        # Streams of a few seconds: with 32 tokens (about 1 s) the replica killed could be
        # between streams by the time of the kill, its report up to 1 s old (migrated=0
        # in a CI run), and no stream moved.
        max_tokens=96,
        engine_args={"num_kv_blocks": 256},
        recover_s=60,
    )
    summary = repr(report)
    assert [k.target for k in report.kills] == ["replica", "coordinator", "proxy", "ingress"]
    assert all(k.recovered_after_s is not None and k.recovered_after_s <= 60 for k in report.kills), summary
    assert report.lost == 0, summary
    assert report.errors_outside_proxy_or_ingress_outages == 0, report.unexplained_errors
    assert report.answered_in_full > 0 and report.migrated >= 1, summary
    assert report.blocks_free_at_end, summary
