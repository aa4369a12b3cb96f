"""Load for LLM servers (OpenAI ``/v1/completions``) and for vLLM's ``AsyncLLM`` in process:
the same requests, closed loop or open loop, and the figures of each run. Used by
:mod:`benchmarks.vllm`; loopback only, every run stops by itself.

A request: one of :data:`PROMPTS`, greedy, ``max_tokens`` drawn from 8-128, one in four
streamed (its time to first token is taken; the others' is their whole latency).

The client is aiohttp, not httpx: the load shares the cores with the servers it measures, and
in the 10x overload on the 2-core dev machine (127 req/s) httpx's client took 23 of the run's
~60 CPU seconds, more than any server process, and sent only a third of the planned requests.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from benchmarks.stats import percentile

PROMPTS = ("the quick brown fox jumps over the lazy dog",
           "a memory budget admits requests by measured bytes of device memory",
           "ray serve routes requests to replicas that hold a share of a gpu")
MAX_TOKENS = (8, 128)


@dataclass(frozen=True, kw_only=True)
class Done:
    """One request's end: HTTP status (0: the client's deadline passed first; -1: the
    connection failed, the server dropped or refused it), seconds, seconds to the first
    token, completion tokens, the error code, a ``Retry-After``."""

    status: int
    seconds: float
    ttft_s: float
    tokens: int = 0
    code: str = ""
    retry_after: bool = False


Send = Callable[[dict], Awaitable[Done]]


def bodies(seed: int, count: int, model: str) -> list[dict]:
    """``count`` request bodies, drawn from ``seed``."""
    rng = random.Random(seed)
    return [{"model": model, "prompt": rng.choice(PROMPTS), "temperature": 0,
             "max_tokens": rng.randint(*MAX_TOKENS), "stream": rng.random() < 0.25}
            for _ in range(count)]


def client(base_url: str) -> aiohttp.ClientSession:
    """A session for :func:`post` to ``base_url``: no connection limit, no timeout of its own
    (each request has its deadline)."""
    return aiohttp.ClientSession(base_url=base_url, timeout=aiohttp.ClientTimeout(total=None),
                                 connector=aiohttp.TCPConnector(limit=0))


async def post(http: aiohttp.ClientSession, body: dict, deadline_s: float = 600) -> Done:
    """``body`` to ``/v1/completions``, streamed or not, within ``deadline_s``."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            return await _post(http, body, started)
    except TimeoutError:
        return Done(status=0, seconds=time.monotonic() - started, ttft_s=deadline_s,
                    code="client_timeout")
    except aiohttp.ClientError as exc:  # a server under overload may drop connections
        elapsed = time.monotonic() - started
        return Done(status=-1, seconds=elapsed, ttft_s=elapsed, code=type(exc).__name__)


async def _post(http: aiohttp.ClientSession, body: dict, started: float) -> Done:
    if body["stream"]:
        body = {**body, "stream_options": {"include_usage": True}}
    async with http.post("/v1/completions", json=body) as response:
        if response.status != 200:
            raw = await response.text(errors="replace")
            return Done(status=response.status, seconds=time.monotonic() - started,
                        ttft_s=time.monotonic() - started, code=_code(raw),
                        retry_after="Retry-After" in response.headers)
        if not body["stream"]:
            usage = json.loads(await response.read())["usage"]
            elapsed = time.monotonic() - started
            return Done(status=200, seconds=elapsed, ttft_s=elapsed,
                        tokens=usage["completion_tokens"])
        first, tokens = None, 0
        async for raw_line in response.content:  # one server-sent event line at a time
            line = raw_line.decode()
            if line.startswith("data: {"):
                first = first or time.monotonic()
                if '"usage":{' in line.replace(" ", ""):
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"] or tokens
    elapsed = time.monotonic() - started
    return Done(status=200, seconds=elapsed, ttft_s=(first or time.monotonic()) - started,
                tokens=tokens)


def _code(raw: str) -> str:
    """The error code of an error body (OpenAI's ``{"error": {"code"}}``, or vLLM's)."""
    try:
        error = json.loads(raw)
    except ValueError:
        return raw[:40]
    error = error.get("error", error) if isinstance(error, dict) else {}
    return str(error.get("code") or error.get("type") or "?")


async def closed_loop(send: Send, clients: int, per_client: int, seed: int,
                      model: str) -> tuple[list[Done], float]:
    """``clients`` clients, each sending ``per_client`` requests one after another: the ends
    and the wall time."""
    started = time.monotonic()

    async def client(index: int) -> list[Done]:
        return [await send(body) for body in bodies(seed + index, per_client, model)]

    ends = await asyncio.gather(*(client(i) for i in range(clients)))
    return [done for dones in ends for done in dones], time.monotonic() - started


async def open_loop(send: Send, rate_per_s: float, seconds: float, seed: int,
                    model: str) -> tuple[list[Done], float]:
    """Poisson arrivals at ``rate_per_s`` for ``seconds``, each request on its own: the ends
    and the wall time (until the last answer)."""
    rng, started, tasks = random.Random(seed), time.monotonic(), []
    for body in bodies(seed, int(rate_per_s * seconds * 2) + 1, model):
        await asyncio.sleep(rng.expovariate(rate_per_s))
        if time.monotonic() - started > seconds:
            break
        tasks.append(asyncio.ensure_future(send(body)))
    ends = await asyncio.gather(*tasks)
    return list(ends), time.monotonic() - started


def closed_figures(dones: list[Done], wall_s: float) -> dict[str, float]:
    """tokens/s, p50/p99 latency and the streamed requests' median time to first token."""
    ok = [d for d in dones if d.status == 200]
    streamed = [d.ttft_s for d in ok if d.ttft_s < d.seconds]
    return {"tokens_per_s": sum(d.tokens for d in ok) / wall_s,
            "requests_per_s": len(ok) / wall_s,
            "p50_s": percentile([d.seconds for d in ok], 0.5),
            "p99_s": percentile([d.seconds for d in ok], 0.99),
            "ttft_p50_s": statistics.median(streamed) if streamed else float("nan"),
            "failed": len(dones) - len(ok), "requests": len(dones)}


def overload_figures(dones: list[Done], seconds: float, deadline_s: float) -> dict[str, float]:
    """Goodput (completions within their deadline, per second of the run), what was refused
    and how, and the served requests' p99."""
    good = [d for d in dones if d.status == 200 and d.seconds <= deadline_s]
    refused = [d for d in dones if d.status not in (-1, 0, 200)]
    return {"sent": len(dones), "served": sum(d.status == 200 for d in dones),
            "goodput_per_s": len(good) / seconds,
            "refused": len(refused),
            "refused_with_retry_after": sum(d.status == 503 and d.retry_after for d in refused),
            "client_timeouts": sum(d.status == 0 for d in dones),
            "connection_errors": sum(d.status == -1 for d in dones),
            "served_p99_s": percentile([d.seconds for d in dones if d.status == 200], 0.99)}
