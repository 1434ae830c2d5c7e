"""kvserve's benchmarks. Each runs as a module from the repository root,
`python -m bench.<name>`, and writes bench/results/<benchmark>_<machine>.json.

What the benchmarks share lives beside them, one concern a file:
- machine.py: the machine a result ran on, and the one writer of results;
- workloads.py: the offline workloads (Anyscale's and the mixed one);
- runners.py: each system on a workload (kvserve, HF static `generate`, transformers'
  continuous batching), timed alike;
- servers.py: servers started as a user starts them (`kvserve serve`, `vllm serve`);
- serve_apps.py: kvserve apps on a local Ray Serve, for the in-process serving runs;
- sse.py: the streaming client and latency percentiles;
- peers.py, vllm_peer.py and vllm_bench_serve.py: vLLM as a peer, in its own venv;
- report.py: docs/benchmarks.md from the results.
"""

import os

# Every model the benchmarks load is local (the bundled one, or one they build): nothing
# waits on the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
