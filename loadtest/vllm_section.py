"""The load-test report's vLLM section: ``model.engine: vllm`` behind the gate against vLLM's
own server under closed-loop load and open-loop overload (:mod:`benchmarks.vllm`), and the
two KV lease modes (:mod:`benchmarks.kv_lease`). Run by ``python -m loadtest.run report``
when vLLM is installed (``--engines vllm`` for this section alone); loopback only.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping
from typing import Any

OVERLOAD_S, DEADLINE_S, MAX_QUEUE_WAIT_S = 60.0, 10.0, 4.0
"""The overload's length, each request's deadline, and vramgate's
``admission.max_queue_wait_s`` (below the deadline, so what it admits can finish in time)."""


def wanted(engines: str) -> bool:
    """Whether the report runs this section: asked for by name, or every section asked for
    (no ``--engines``) and vLLM importable here."""
    if engines:
        return "vllm" in engines.split(",")
    return importlib.util.find_spec("vllm") is not None


def run_section(quick: bool) -> dict[str, Any]:
    """Both benchmarks (``quick``: a 15 s overload, fewer requests per client)."""
    from benchmarks import kv_lease, vllm

    overload = argparse.Namespace(overload_s=15.0 if quick else OVERLOAD_S,
                                  deadline_s=DEADLINE_S, max_queue_wait_s=MAX_QUEUE_WAIT_S,
                                  skip_overload=False)
    closed, overloads = vllm.run(overload)
    leases = argparse.Namespace(clients=32, requests_each=2 if quick else 6, warm_up=64,
                                pool_blocks=24)
    return {"closed": closed, "overload": overloads, "kv_lease": kv_lease.run(leases),
            "deadline_s": DEADLINE_S, "overload_s": overload.overload_s,
            "kv_lease_clients": leases.clients}


def section_lines(section: Mapping[str, Any]) -> list[str]:
    """The report's markdown for :func:`run_section`'s figures."""
    from benchmarks import kv_lease, vllm

    return [
        "## vLLM behind the gate (`model.engine: vllm`, a tiny Llama on CPU)",
        "",
        "Closed loop (`python -m benchmarks.vllm`): the same model and requests through "
        "vLLM's `AsyncLLM` in process (the engine's ceiling), vLLM's own OpenAI server, "
        "vramgate with the vLLM engine and vramgate with its transformers engine.",
        "",
        *vllm.closed_table(section["closed"]),
        "",
        f"Overload: open loop at 3x and 10x the capacity vramgate + vLLM measured, "
        f"{section['overload_s']:g} s, every request abandoned by its client after "
        f"{section['deadline_s']:g} s; goodput is completions within that deadline per second.",
        "",
        *vllm.overload_table(section["overload"], section["deadline_s"]),
        "",
        "KV lease modes (`python -m benchmarks.kv_lease`): every request asks for 992 tokens "
        "and ends at EOS after 14-261; the KV pool is held to 24 blocks of 128 tokens.",
        "",
        *kv_lease.table(section["kv_lease"], section["kv_lease_clients"]),
        "",
    ]
