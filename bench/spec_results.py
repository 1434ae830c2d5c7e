"""bench.spec_decode's figures: the servers' speculation counters (acceptance), a
system's rounds merged into one result, each speculating system against its base, and the
bars the speculative engine is held to."""

import re
import statistics

import httpx

# The bars the speculative engine is held to (kvserve-ngram against kvserve).
REPEAT_TPOT_SPEEDUP_BAR = 1.6
RANDOM_THROUGHPUT_RATIO_BAR = 0.97
SYSTEMS = ["kvserve", "kvserve-ngram", "vllm", "vllm-ngram"]


def spec_counters(url: str) -> dict | None:
    """The server's vllm:spec_decode_num_* counters (summed over labels), or None if none."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    counters: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"vllm:spec_decode_(num_\w+?)_total(?:\{[^}]*\})?\s+(\S+)$", line)
        if match and "per_pos" not in match.group(1):
            counters[match.group(1)] = counters.get(match.group(1), 0.0) + float(match.group(2))
    return counters or None


def acceptance(before: dict | None, after: dict | None) -> dict | None:
    """Drafts, draft tokens and accepted tokens between two counter readings, and rates."""
    if not before or not after:
        return None
    return with_rates({k: after[k] - before.get(k, 0.0) for k in after})


def with_rates(delta: dict) -> dict:
    """Counter deltas with the acceptance rate and mean acceptance length added."""
    delta = {k: v for k, v in delta.items() if k.startswith("num_")}
    drafts, drafted = delta.get("num_drafts", 0.0), delta.get("num_draft_tokens", 0.0)
    accepted = delta.get("num_accepted_tokens", 0.0)
    delta["acceptance_rate"] = accepted / drafted if drafted else None
    # Tokens per verified step: the accepted drafts plus the token the step samples itself.
    delta["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return delta


def repeat_summary(requests: list[dict], max_tokens: int, seconds: float, spec: dict | None) -> dict:
    tpots = [r["tpot_ms"] for r in requests if r["tpot_ms"] is not None]
    echoed = [r["items_echoed"] for r in requests if "items_echoed" in r]
    output_tokens = sum(r["output_tokens"] for r in requests)
    return {
        "num_prompts": len(requests),
        "max_tokens": max_tokens,
        "duration_s": seconds,
        "median_tpot_ms": statistics.median(tpots),
        "mean_tpot_ms": statistics.fmean(tpots),
        "median_ttft_ms": statistics.median(r["ttft_s"] for r in requests) * 1000,
        "mean_output_tokens": output_tokens / len(requests),
        "mean_prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in requests),
        "output_throughput": output_tokens / seconds,
        "spec_decode": spec,
        # Does the model do the task? Empty answers (special tokens only) mean broken outputs.
        "empty_answers": sum(r["text_head"] == "" for r in requests),
        "mean_items_echoed": statistics.fmean(echoed) if echoed else None,
        "requests": requests,
    }


def merge_rounds(rounds: list[dict]) -> dict:
    """A system's rounds as one result: the repeat requests in prompt order, and at each
    random concurrency the tokens over the seconds of all its runs (the medians are the
    rounds' means); each round's own figures kept under "rounds"."""
    out = {"command": rounds[0]["command"], "env": rounds[0]["env"], "rounds": rounds}
    failed = [r for r in rounds if "error" in r]
    if failed:
        return {**out, **{k: failed[0][k] for k in ("error", "server_error", "log_tail") if k in failed[0]}}
    for key in ("repeat", "repeat_opted_out"):
        if key in rounds[0]:
            out[key] = _merge_repeats([r[key] for r in rounds])
    out["random"] = []
    for runs in zip(*(r["random"] for r in rounds), strict=True):
        seconds = sum(run["duration"] for run in runs)
        tokens = sum(run["output_throughput"] * run["duration"] for run in runs)
        merged = {"concurrency": runs[0]["concurrency"], "duration": seconds}
        merged["output_throughput"] = tokens / seconds
        for key in ("num_prompts", "completed", "failed"):
            merged[key] = sum(run[key] for run in runs)
        for key in ("median_ttft_ms", "median_tpot_ms", "median_itl_ms"):
            merged[key] = statistics.fmean(run[key] for run in runs)
        merged["spec_decode"] = sum_counters([run["spec_decode"] for run in runs])
        out["random"].append(merged)
    return out


def _merge_repeats(repeats: list[dict]) -> dict:
    requests = sorted((q for rep in repeats for q in rep["requests"]), key=lambda q: q["prompt"])
    seconds = sum(rep["duration_s"] for rep in repeats)
    spec = sum_counters([rep["spec_decode"] for rep in repeats])
    return repeat_summary(requests, repeats[0]["max_tokens"], seconds, spec)


def sum_counters(deltas: list[dict | None]) -> dict | None:
    if any(d is None for d in deltas):
        return None
    keys = {k for d in deltas for k in d if k.startswith("num_")}
    return with_rates({k: sum(d.get(k, 0.0) for d in deltas) for k in keys})


def compare(base: dict, spec: dict) -> dict | None:
    """`spec` against `base`: repeat TPOT speedup, random throughput ratios, same answers."""
    if "error" in base or "error" in spec:
        return None
    out = {
        "repeat_median_tpot_speedup": base["repeat"]["median_tpot_ms"] / spec["repeat"]["median_tpot_ms"],
        "repeat_output_throughput_ratio": spec["repeat"]["output_throughput"]
        / base["repeat"]["output_throughput"],
        "repeat_same_answers": sum(
            a["text_sha1"] == b["text_sha1"]
            for a, b in zip(base["repeat"]["requests"], spec["repeat"]["requests"], strict=True)
        ),
        "repeat_num_prompts": len(base["repeat"]["requests"]),
    }
    if "repeat_opted_out" in spec:  # "speculative": false should cost nothing
        opted = spec["repeat_opted_out"]
        out["repeat_opted_out_median_tpot_over_base"] = (
            opted["median_tpot_ms"] / base["repeat"]["median_tpot_ms"]
        )
        out["repeat_opted_out_same_answers"] = sum(
            a["text_sha1"] == b["text_sha1"]
            for a, b in zip(base["repeat"]["requests"], opted["requests"], strict=True)
        )
    for a, b in zip(base["random"], spec["random"], strict=True):
        c = a["concurrency"]
        out[f"random_c{c}_output_throughput_ratio"] = b["output_throughput"] / a["output_throughput"]
        out[f"random_c{c}_median_tpot_ratio"] = b["median_tpot_ms"] / a["median_tpot_ms"]
    return out


def summarize(systems: dict) -> dict:
    summary = {}
    for name in ("kvserve", "vllm"):
        if name in systems and f"{name}-ngram" in systems:
            summary[f"{name}_ngram_over_{name}"] = compare(systems[name], systems[f"{name}-ngram"])
    kv = summary.get("kvserve_ngram_over_kvserve")
    if kv:
        summary["bars"] = {
            "repeat_median_tpot_speedup": {
                "bar": REPEAT_TPOT_SPEEDUP_BAR,
                "value": kv["repeat_median_tpot_speedup"],
                "pass": kv["repeat_median_tpot_speedup"] >= REPEAT_TPOT_SPEEDUP_BAR,
            },
            **{
                key: {
                    "bar": RANDOM_THROUGHPUT_RATIO_BAR,
                    "value": kv[key],
                    "pass": kv[key] >= RANDOM_THROUGHPUT_RATIO_BAR,
                }
                for key in kv
                if key.startswith("random_") and key.endswith("_output_throughput_ratio")
            },
        }
    # Absolute figures side by side: median TPOT (ms) and output tok/s per workload.
    table = {}
    for name, result in systems.items():
        if "error" in result:
            table[name] = {"error": result.get("server_error") or result["error"]}
            continue
        row = {"repeat_median_tpot_ms": result["repeat"]["median_tpot_ms"],
               "repeat_output_throughput": result["repeat"]["output_throughput"],
               "repeat_mean_output_tokens": result["repeat"]["mean_output_tokens"]}  # fmt: skip
        row["repeat_empty_answers"] = result["repeat"]["empty_answers"]
        row["repeat_mean_items_echoed"] = result["repeat"]["mean_items_echoed"]
        spec = result["repeat"]["spec_decode"]
        if spec:
            row["repeat_acceptance_rate"] = spec["acceptance_rate"]
            row["repeat_mean_acceptance_length"] = spec["mean_acceptance_length"]
        for run in result["random"]:
            row[f"random_c{run['concurrency']}_output_throughput"] = run["output_throughput"]
            row[f"random_c{run['concurrency']}_median_tpot_ms"] = run["median_tpot_ms"]
        table[name] = row
    summary["table"] = table
    # kvserve next to vLLM: the speedups from speculation, and the absolute repeat TPOTs.
    vl = summary.get("vllm_ngram_over_vllm")
    if kv and vl:
        tpot = {name: table[name]["repeat_median_tpot_ms"] for name in SYSTEMS}
        summary["kvserve_vs_vllm"] = {
            "repeat_median_tpot_ms": tpot,
            "repeat_median_tpot_speedup": {
                "kvserve": kv["repeat_median_tpot_speedup"],
                "vllm": vl["repeat_median_tpot_speedup"],
            },
            "kvserve_ngram_tpot_over_vllm_ngram_tpot": tpot["kvserve-ngram"] / tpot["vllm-ngram"],
        }
    return summary
