"""Send a trace to an OpenAI-compatible server and time every streamed token.

Requests go to `/v1/completions` with the prompt as token ids (exact input lengths, and any
server that accepts token-id prompts can be measured), streamed, with usage at the end.
Arrivals follow the trace's times (Poisson or bursty), optionally capped by a concurrency limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from service.contract.wire import DEFAULT_TENANT
from service.tools.workload import TraceRequest


@dataclass(slots=True)
class RequestTiming:
    request_id: str
    prompt_len: int
    max_tokens: int
    tenant: str = DEFAULT_TENANT
    start_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end_s: float = 0.0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


GREEDY = {"temperature": 0.0}


async def _one(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    request: TraceRequest,
    ignore_eos: bool,
    timing: RequestTiming,
    sampling: dict = GREEDY,
) -> None:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        **sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if request.tenant != DEFAULT_TENANT:  # a trace of tenants: each request names its own
        body["user"] = request.tenant
    timing.start_s = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = str(chunk["error"].get("message", chunk["error"]))
                    return
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timing.token_times_s.append(time.perf_counter())
                if chunk.get("usage"):
                    timing.completion_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        timing.end_s = time.perf_counter()


async def run_trace(
    url: str,
    model: str,
    trace: list[TraceRequest],
    ignore_eos: bool,
    max_concurrency: int | None,
    timeout_s: float,
    sampling: dict = GREEDY,
) -> tuple[list[RequestTiming], float, float]:
    """Replay the trace, every request with the `sampling` fields (temperature, top_p, top_k); return the
    timings and the run's start and end (perf_counter seconds)."""
    limits = httpx.Limits(max_connections=max_concurrency or len(trace) or 1, max_keepalive_connections=64)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timings = [RequestTiming(r.request_id, len(r.prompt_token_ids), r.max_tokens, r.tenant) for r in trace]
    progress = tqdm(total=len(trace), desc="requests", unit="req")

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:

        async def launch(request: TraceRequest, timing: RequestTiming) -> None:
            await asyncio.sleep(max(0.0, request.arrival_time_s - (time.perf_counter() - started)))
            if gate is None:
                await _one(http, url, model, request, ignore_eos, timing, sampling)
            else:
                async with gate:
                    await _one(http, url, model, request, ignore_eos, timing, sampling)
            progress.update(1)

        started = time.perf_counter()
        await asyncio.gather(*(launch(r, t) for r, t in zip(trace, timings)))
        finished = time.perf_counter()
    progress.close()
    return timings, started, finished


async def first_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(f"{url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
