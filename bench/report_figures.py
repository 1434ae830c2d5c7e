"""The figures docs/benchmarks.md shows of each result: a few columns per benchmark, read
from the result's own JSON (older results' keys included). A benchmark without a case
here still gets its row: file, machine and commit."""


def number(x: float | None) -> str:
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def figures(benchmark: str, record: dict) -> dict[str, str]:
    """Column name -> cell, for one result of `benchmark`."""
    match benchmark:
        case "offline":
            return offline(record)
        case "serving_peers":
            return serving_peers(record)
        case "serving":
            return serving(record)
        case "gpu":
            return gpu(record)
        case "quantization":
            return {name: quantization_engine(row) for name, row in record["results"].items()}
        case "kv_cache_dtype":
            return {name: kv_cache_engine(row) for name, row in record["results"].items()}
        case "quantized_gemm":
            return quantized_gemm(record)
        case "kernel_choice":
            return {
                f"{run['dtype']}, {run['threads']} threads": "; ".join(
                    f"{k}: {v}" for k, v in run["chosen"].items()
                )
                for run in record["runs"]
            }
        case "lm_eval_loglikelihood":
            return {
                "max abs(kvserve − HF)": f"{record['max_abs_diff']:.2g} (tolerance {record['tolerance']:g})",
                "same greedy choice": record["is_greedy_agree"],
                "lm-eval acc": number(record["lm_eval_results"].get("acc,none")),
            }
        case "lora":
            return {
                name: f"{ratio(row['over_lora_off'])} lora_off" for name, row in record["offline"].items()
            }
        case "priority":
            summary = record["summary"]
            return {
                "TTFT p50, priority 0 over 1": ratio(summary["ttft_p50_ratio_high_to_low"]),
                "throughput over fcfs": ratio(summary["throughput_ratio_priority_to_fcfs"]),
                "bars met": bars(summary["bars_met"].values()),
            }
        case "spec_decode":
            return spec_decode(record)
        case "spec_overhead":
            return {
                f"c{run['concurrency']}": ratio(run["speculative_over_opted_out"]) for run in record["runs"]
            }
        case "spec_step_cost":
            return {f"batch {row['batch']}": ratio(row["ratio"]) for row in record["rows"]}
        case "ab_commits":
            return {case: ratio(row["head_over_base"]) for case, row in record["cases"].items()}
        case "attention_ab":
            return {case: f"{ratio(row['speedup_median'])} median" for case, row in record["cases"].items()}
        case "prefix_scale":
            return {
                name: f"{ratio(row['new_over_ideal'])} of ideal" for name, row in record["scenarios"].items()
            }
        case "tensor_parallel":
            return {
                "tp2 over tp1": ratio(record["tp2_over_tp1"]),
                "gloo all-reduce": f"{number(record['gloo_all_reduce_ms_isolated'])} ms",
            }
        case "soak":
            return {
                "valid requests answered": f"{record['valid_completed_or_clean_error_pct']}%",
                "5xx": str(record["server_errors"]),
                "lost": str(record["lost"]),
                "blocks free at end": str(record["all_blocks_free"]),
            }
        case "chaos":
            return {
                "requests": str(record["requests"]),
                "answered in full": str(record["answered_in_full"]),
                "unexplained errors": str(record["errors_outside_proxy_or_ingress_outages"]),
                "max recovery": f"{number(record['max_recovery_s'])} s",
            }
        case "kv_offload":
            return {pair.replace("_", " "): kv_offload_pair(r) for pair, r in record["ratios"].items()}
        case "profile_step":
            return {
                f"{run['attention_backend']}, {run['decoder_loop']}": number(run["output_tokens_per_s"])
                + " tok/s"
                for run in record["runs"]
            }
        case _:
            return {}


def kv_offload_pair(r: dict) -> str:
    """One system over another: the median TTFT of turns 2 and later, output tok/s."""
    return f"TTFT {ratio(r['ttft_p50_turns_2_on'])}, tok/s {ratio(r['output_tokens_per_s'])}"


def bars(met) -> str:
    met = list(met)
    return f"{sum(met)} of {len(met)}"


def offline(record: dict) -> dict[str, str]:
    """Each case's output tokens/s per system (the median of its runs)."""
    out = {"dtype": record.get("dtype", "—")}
    for row in record["results"]:
        out[f"{row['case']}, output tok/s"] = ", ".join(
            f"{system} {number(v['output_tokens_per_s'])}" for system, v in row["systems"].items()
        )
    return out


def serving_peers(record: dict) -> dict[str, str]:
    """Each concurrency's output tokens/s per server, kvserve's over vLLM's, and kvserve
    served at the largest concurrency over its engine alone."""
    out = {"dtype": record.get("dtype", "—")}
    over = {r["concurrency"]: r["output_throughput"] for r in record.get("kvserve_over_vllm", [])}
    runs: dict[int, list[str]] = {}
    for system, result in record["systems"].items():
        for run in result.get("runs", []):
            runs.setdefault(run["concurrency"], []).append(f"{system} {number(run['output_throughput'])}")
    for concurrency, cells in runs.items():
        tail = f" ({ratio(over[concurrency])})" if concurrency in over else ""
        out[f"concurrency {concurrency}, output tok/s"] = ", ".join(cells) + tail
    if "served_over_offline" in record:
        served = record["served_over_offline"]
        offline = number(record["offline_kvserve"]["output_throughput"])
        at = served["concurrency"]
        out["served over offline"] = f"{ratio(served['ratio'])} at concurrency {at} (offline {offline})"
    return out


def serving(record: dict) -> dict[str, str]:
    """TTFT and throughput at each arrival rate, then each router against the other."""
    out = {}
    for run in record.get("rates", []):
        throughput = number(run["output_tokens_per_s"])
        out[f"{run['rate_rps']:g} req/s"] = f"TTFT p50 {number(run['ttft_p50_s'])} s, {throughput} tok/s"
    if "routing" in record:
        out["p99 TTFT, kv over pow2"] = ratio(record["routing"]["p99_ttft_kv_over_pow2"])
    for key, runs in record.get("prefix", {}).items():
        out[f"prefix hits kv over pow2, {key.replace('_', ' ')}"] = ratio(runs["hit_rate_kv_over_pow2"])
    for router, bursts in record.get("bursts", {}).items():
        out[f"bursts, busiest replica's share ({router})"] = number(bursts["max_busiest_share"])
    return out


def gpu(record: dict) -> dict[str, str]:
    """kvserve's output tokens/s per cap, over HF static's where both ran; targets met."""
    runs = record["throughput"]
    out = {}
    for cap, run in runs.get("kvserve", {}).items():
        if run.get("status") not in ("ran", "partial"):
            continue
        cell = number(run["output_tokens_per_s"])
        theirs = runs.get("hf_static", {}).get(cap, {})
        if theirs.get("status") in ("ran", "partial"):
            cell += f" ({ratio(run['output_tokens_per_s'] / theirs['output_tokens_per_s'])} HF static)"
        out[f"cap {cap}, kvserve output tok/s"] = cell
    targets = record.get("targets", {})
    measured = [t["met"] for t in targets.values() if t.get("status") == "ran"]
    out["targets met"] = bars(measured) + (
        f" measured, of {len(targets)}" if len(measured) < len(targets) else ""
    )
    return out


def quantization_engine(row: dict) -> str:
    base = next(iter(row["vs"].values()))
    correct = sum(a["correct"] for a in row["answers"])
    return (
        f"perplexity {number(row['perplexity'])}, decode {ratio(base['decode_speedup'])}, "
        f"linears {ratio(base['linear_bytes'])}, {correct}/{len(row['answers'])} answers"
    )


def kv_cache_engine(row: dict) -> str:
    speedup = ratio(row["speedup_vs_unquantized_kv"])
    return f"{number(row['output_tokens_per_s'])} tok/s ({speedup}), {row['kv_cache']['blocks']} KV blocks"


def quantized_gemm(record: dict) -> dict[str, str]:
    """Each kernel's time over the first dense dtype's, at the most rows, per shape."""
    gemms = record.get("gemms") or {}
    out = {}
    dense = record["dense_dtypes"][0]
    for name, gemm in gemms.items():
        if not isinstance(gemm, dict) or "seconds" not in gemm:
            continue
        rows = max(gemm["seconds"], key=int)
        times = gemm["seconds"][rows]
        out[f"{name}, time over {dense} at {rows} rows"] = ", ".join(
            f"{k} {ratio(t / times[dense])}" for k, t in times.items() if k != dense
        )
    for label, engine in (record.get("engines") or {}).items():
        if isinstance(engine, dict) and engine.get("status") == "ran":
            out[f"engine {label}"] = f"{number(engine['throughput']['tokens_per_s'])} tok/s"
    return out


def spec_decode(record: dict) -> dict[str, str]:
    """Per system: the repeat workload's median time per output token, the random one's
    output tokens/s at each concurrency; and the bars met."""
    out = {}
    for system, row in (record.get("table") or {}).items():
        if "error" in row:
            out[system] = f"failed: {row['error']}"
            continue
        cells = [f"repeat TPOT {number(row['repeat_median_tpot_ms'])} ms"]
        cells += [
            f"random {key.split('_')[1]} {number(v)} tok/s"
            for key, v in row.items()
            if key.startswith("random_") and key.endswith("_output_throughput")
        ]
        out[system] = ", ".join(cells)
    if record.get("bars"):
        out["bars met"] = bars(b["pass"] for b in record["bars"].values())
    return out
