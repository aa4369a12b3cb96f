"""Refuse a deployment that can never run, and make ``serve run`` say so and exit.

Two kinds of refusal are final: the cluster cannot ever place a model replica
(:func:`serve_app.placement.gpu_placement_problem`), and a replica refuses to start for a
reason that retrying cannot change (:data:`REFUSALS`: no CUDA on its node, a budget that
cannot hold the largest allowed request, an unreadable model directory, a config the engine
rejects). Ray Serve marks such an application ``DEPLOY_FAILED`` and retries its replicas,
while ``serve run CONFIG`` keeps waiting (Ray 2.60's ``serve run`` sleeps in a loop once it
has submitted a config file, whatever becomes of it) and ``/readyz`` answers 503.

:func:`stop_serve_run` ends that wait: it writes the one-line reason to the terminal of each
``serve run`` driver of this cluster and sends it ``SIGHUP``, its terminal "hanging up": the
driver exits (status 129 in a shell) and the local Ray instance it started goes with it. Not
``SIGTERM``: Ray's driver answers that with a native stack dump and exits 15 (or, in
Ray 2.60, sometimes aborts once its shutdown has completed: 134 in a shell); not
``SIGINT``: ``serve run`` then exits 0. A driver that ignores ``SIGHUP`` (``nohup serve run``)
gets ``SIGTERM`` all the same (:func:`stop_signal`): a stack dump beats waiting forever.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deployments.engines.devices import DeviceUnavailableError
from serve_app.config import AppArgs, ConfigError
from serve_app.memory.budget import InsufficientMemoryError

logger = logging.getLogger("ray.serve")


class DeploymentRefused(RuntimeError):
    """The deployment can never run as configured; the message names the knob to change."""


#: What a replica (or the measurement before the deployment) raises when retrying cannot help.
REFUSALS = (ConfigError, InsufficientMemoryError, OSError, DeviceUnavailableError,
            DeploymentRefused)
#: Seconds between logging the reason and stopping the driver, so that Ray's log streaming
#: delivers the log line to it first (Ray's log monitor polls files about every 0.1-1 s).
LOG_DELIVERY_S = 2.0


def stop_serve_run_with(reason: BaseException | str) -> str:
    """Log ``reason`` as one line and stop every ``serve run`` driver of this cluster with
    it (:func:`stop_serve_run`); return the line."""
    message = _one_line(reason)
    logger.error("vramgate: %s", message)
    stop_serve_run(message)
    return message


def stop_serve_run(message: str) -> int:
    """Write ``vramgate: <message>`` to the stderr of each live ``serve run`` driver of this
    cluster and send it ``SIGHUP`` (on its own node, through a task placed there); return
    how many were stopped. Other drivers (a Python program that called ``serve.run``, a
    test) are left alone: their caller sees the failure through Ray Serve's status. Never
    raises: where the drivers cannot be listed (no dashboard), it logs why."""
    if not ray.is_initialized():
        return 0
    try:
        from ray.util.state import list_jobs

        # This cluster's address, not found by scanning the machine: with another Ray
        # instance on the host the scan fails ("Found multiple active Ray instances") and
        # serve run was left waiting (measured: an e2e run after a test's own Ray).
        drivers = [job.driver_info for job in list_jobs(
            address=ray.get_runtime_context().gcs_address, filters=[("type", "=", "DRIVER")])
                   if _is_live_serve_run(job)]
    except Exception as exc:  # noqa: BLE001 - the state API is optional (no dashboard)
        logger.warning("cannot list the serve run drivers to stop them: %s", exc)
        return 0
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    here = ray.get_runtime_context().get_node_id()
    stopped = 0
    for driver in drivers:
        if (node_id := nodes.get(driver.node_ip_address)) is None:
            continue
        if node_id == here:
            stopped += _signal_driver_here(int(driver.pid), message)
            continue
        placed = NodeAffinitySchedulingStrategy(node_id, soft=False)
        stopped += ray.get(_signal_driver.options(scheduling_strategy=placed, num_cpus=0)
                           .remote(int(driver.pid), message))
    return stopped


def _is_live_serve_run(job: Any) -> bool:
    words = (job.entrypoint or "").split()
    serve_at = next((i for i, w in enumerate(words) if os.path.basename(w) == "serve"), None)
    return (job.driver_info is not None and str(job.status) == "RUNNING" and serve_at is not None
            and words[serve_at + 1:serve_at + 2] == ["run"])


@ray.remote(max_retries=0)
def _signal_driver(pid: int, message: str) -> int:
    return _signal_driver_here(pid, message)


def _signal_driver_here(pid: int, message: str) -> int:
    time.sleep(LOG_DELIVERY_S)
    try:
        with open(f"/proc/{pid}/fd/2", "a") as stderr:  # the operator's terminal
            stderr.write(f"\nvramgate: {message}\n")
    except OSError:
        pass  # not Linux, or another user's process: the log line has to do
    try:
        os.kill(pid, stop_signal(pid))
    except OSError as exc:
        logger.warning("cannot stop serve run (pid %d): %s", pid, exc)
        return 0
    return 1


def stop_signal(pid: int) -> signal.Signals:
    """``SIGHUP``, or ``SIGTERM`` when process ``pid`` ignores ``SIGHUP``: started under
    ``nohup`` (or from a parent that ignored it), it would keep waiting. Read from its
    ``SigIgn`` mask in ``/proc/PID/status`` (proc(5)); ``SIGHUP`` where that cannot be read.
    """
    try:
        with open(f"/proc/{pid}/status") as status:
            ignored = next((int(line.split()[1], 16) for line in status
                            if line.startswith("SigIgn:")), 0)
    except (OSError, ValueError):
        return signal.SIGHUP
    return signal.SIGTERM if ignored >> (signal.SIGHUP - 1) & 1 else signal.SIGHUP


def refusal_text(exc: BaseException, args: AppArgs) -> str:
    """A replica's refusal in words: an unreadable model names ``model.path``."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return (f"cannot load the model of model.path {args.model.path!r}: "
                f"{exc.strerror or exc}: {exc.filename}")
    return str(exc)


def _one_line(reason: BaseException | str) -> str:
    text = reason if isinstance(reason, str) else f"{reason}"
    if not isinstance(reason, str | DeploymentRefused | ConfigError):
        text = f"{type(reason).__name__}: {text}"
    return " ".join(text.split())
