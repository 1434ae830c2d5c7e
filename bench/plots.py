"""The figures beside the offline and serving results: a PNG next to each JSON, drawn from
the result itself, so that a figure never shows other numbers than its JSON."""

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    return plt


def plot_offline(result: dict, path: Path) -> None:
    """Output tokens/s per workload case, a bar per system (median; whiskers: min-max)."""
    plt = _pyplot()
    rows = result["results"]
    systems = list(rows[0]["systems"])
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rows) + 2), 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(rows))]
        medians = [r["systems"][system]["output_tokens_per_s"] for r in rows]
        lows = [
            m - r["generated_tokens"] / max(r["systems"][system]["seconds"])
            for m, r in zip(medians, rows, strict=True)
        ]
        highs = [
            r["generated_tokens"] / min(r["systems"][system]["seconds"]) - m
            for m, r in zip(medians, rows, strict=True)
        ]
        ax.bar(xs, medians, width, label=system, yerr=[lows, highs], capsize=2)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_ylabel("output tokens / s (median; bars: min-max)")
    ax.set_title(f"Offline throughput, {result['model']} {result['dtype']}, {result['device']}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_serving(result: dict, path: Path) -> None:
    """bench.serving: latency against load, p99 TTFT under each router, prefix hit rates."""
    plt = _pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    rates = result["rates"]
    x = [r["rate_rps"] for r in rates]
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
        a.plot(x, [r[key] * 1000 for r in rates], marker="o", label=label)
    for key, label in (("itl_p50_s", "ITL p50"), ("itl_p99_s", "ITL p99")):
        a.plot(x, [r[key] * 1000 for r in rates], marker="s", linestyle="--", label=label)
    a.set(xlabel="arrival rate (req/s)", ylabel="ms", title="Latency vs load (KV router, 2 replicas)")
    a.legend()
    routing = result["routing"]
    names = ["kv", "pow2"]
    b.bar(names, [routing[n]["ttft_p99_s"] for n in names], color=["tab:green", "tab:gray"])
    for i, n in enumerate(names):
        b.text(
            i,
            routing[n]["ttft_p99_s"],
            f"{routing[n]['num_preemptions']} preemptions",
            ha="center",
            va="bottom",
        )
    b.set(
        ylabel="p99 TTFT (s)",
        title=f"Long/short mix, small KV: kv/pow2 = {routing['p99_ttft_kv_over_pow2']:.2f}",
    )
    groups = list(result["prefix"].items())
    width = 0.38
    for offset, router, color in ((-width / 2, "kv", "tab:green"), (width / 2, "pow2", "tab:gray")):
        xs = [i + offset for i in range(len(groups))]
        c.bar(xs, [runs[router]["hit_rate"] for _, runs in groups], width, label=router, color=color)
    labels = [f"{k.split('_')[1]} replicas\nkv/pow2 = {r['hit_rate_kv_over_pow2']:.2f}x" for k, r in groups]
    c.set_xticks(range(len(groups)), labels)
    c.set(ylabel="prefix-cache hit rate", ylim=(0, 1), title="Multi-turn chats")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_serving_peers(result: dict, path: Path) -> None:
    """bench.serving_peers: throughput and median time per output token by concurrency."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, color in (("kvserve", "tab:green"), ("vllm", "tab:gray")):
        runs = result["systems"][system]["runs"]
        x = [r["concurrency"] for r in runs]
        left.plot(x, [r["output_throughput"] for r in runs], marker="o", color=color, label=system)
        right.plot(x, [r["median_tpot_ms"] for r in runs], marker="o", color=color, label=system)
    left.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Throughput (vllm bench serve)")
    right.set(xscale="log", xlabel="concurrency", ylabel="ms", title="Median time per output token")
    for axis in (left, right):
        axis.legend()
    fig.suptitle(f"{result['workload']}; {result['machine']['cores']} cores, one run each", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
