"""Whether a Ray cluster can ever place a model replica: checked before the deployment is
created, so that a config asking for GPUs the cluster does not have fails at once instead of
waiting forever for resources (:mod:`deployments.fail_fast`).

Pure: reads the node table Ray returns (``ray.nodes()``), imports no Ray.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppArgs


def gpu_placement_problem(args: AppArgs, nodes: list[dict[str, Any]]) -> str | None:
    """Why no node of ``nodes`` (``ray.nodes()``) can ever hold one model replica's
    ``deployment.num_gpus``, or ``None`` when one can (or replicas need no GPU, or
    ``deployment.wait_for_gpus`` lets an autoscaling cluster add GPU nodes later)."""
    need = args.deployment.num_gpus
    if need == 0 or args.deployment.wait_for_gpus:
        return None
    alive = [n for n in nodes if n.get("Alive")]
    gpus = [float(n.get("Resources", {}).get("GPU", 0.0)) for n in alive]
    if max(gpus, default=0.0) >= need:
        return None
    have = ", ".join(f"{n.get('NodeManagerAddress', '?')}: {g:g} GPU"
                     for n, g in zip(alive, gpus, strict=True)) or "no nodes"
    lacking = "a GPU" if not any(gpus) else f"{need:g} GPU"
    return (f"deployment.num_gpus is {need:g} per model replica, but no node of this Ray "
            f"cluster has {lacking} ({have}). Start Ray with GPUs (ray start --num-gpus=N), "
            "lower deployment.num_gpus, serve on CPU (deployment.num_gpus: 0, model.device: "
            "cpu), or set deployment.wait_for_gpus: true to wait for GPU nodes to join")
