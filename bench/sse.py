"""The streaming client of the serving benchmarks, and the latency figures drawn from it.
A streamed completion is server-sent events: `data: <json>` lines, the last one
`data: [DONE]`; a token event is a chunk that carries completion text."""

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


def sse_event(line: str) -> dict | None:
    """The JSON of one `data:` line; None for any other line and for [DONE]."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: ") :])


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str | None = None


async def stream(client: httpx.AsyncClient, path: str, payload: dict) -> Result:
    """One streaming request (`payload` names its model), timed from its send: the time to
    the first token event, the gaps between the later ones, and the usage's token count."""
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    result = Result(ok=True)
    pieces = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return Result(ok=False, error=f"{response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if (event := sse_event(line)) is None:
                continue
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                delta = choice.get("delta", {})
                if "role" in delta:
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                pieces.append(choice.get("text") or delta.get("content") or "")
    result.text = "".join(pieces)
    return result


async def send_at(base_url: str, jobs: list[tuple[float, str, dict]]) -> tuple[list[Result], float]:
    """Streams each (offset in s, path, payload) at its offset from now, as open-loop load:
    the results, and the seconds from the first send to the last token."""
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as client:
        start, tasks = time.perf_counter(), []
        for due, path, payload in jobs:
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            tasks.append(asyncio.create_task(stream(client, path, payload)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def latency_summary(results: list[Result], seconds: float) -> dict:
    """Errors, TTFT and inter-token latency p50 and p99, output tokens per second."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "seconds": seconds,
    }
