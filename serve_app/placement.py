"""Whether a Ray cluster can ever place a model replica, and the replicas of every model of
an app at once (their GPU shares packed onto whole cards): checked before the deployment is
created, so that a config asking for GPUs the cluster does not have fails at once instead of
waiting forever for resources (:mod:`deployments.cluster.fail_fast`).

Pure: reads the node table Ray returns (``ray.nodes()``), imports no Ray.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppArgs

FEWEST, INITIAL, MOST = "at least", "initially", "at most"
"""Which replica count of each model: ``deployment.min_replicas`` (1 when unset), the initial
``deployment.num_replicas``, ``deployment.max_replicas``; all ``num_replicas`` for a model that
does not autoscale."""
COUNT_KEYS = {FEWEST: "min_replicas", INITIAL: "num_replicas", MOST: "max_replicas"}


def replica_count(args: AppArgs, when: str = INITIAL) -> int:
    """How many replicas of ``args``'s model run ``when`` (:data:`FEWEST`, :data:`INITIAL` or
    :data:`MOST`)."""
    dep = args.deployment
    if not dep.autoscaling:
        return dep.num_replicas
    return {FEWEST: dep.min_replicas or 1, INITIAL: dep.num_replicas,
            MOST: dep.max_replicas}[when]


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


def gpu_packing(models: list[AppArgs], gpus: int | None = None, when: str = INITIAL,
                ) -> tuple[list[list[tuple[str, float]]], list[tuple[str, float]]]:
    """Where the model replicas' GPU shares go: ``(per GPU the (model, share) it holds,
    shares left over)``, first-fit decreasing over ``gpus`` whole cards (``None``: as many as
    needed, so nothing is left over).

    Ray gives a replica with a fractional ``num_gpus`` a share of *one* card (``ray
    start --num-gpus`` counts cards; "Fractional GPUs", Ray Core docs: a task asking for 0.5
    GPU gets half of one device), so three models at 0.5 need two cards, not 1.5. Each
    model counts :func:`replica_count` replicas ``when`` (by default the initial count);
    replicas without a GPU take none.
    """
    shares = sorted(((m.model.name, m.deployment.num_gpus) for m in models
                     for _ in range(replica_count(m, when)) if m.deployment.num_gpus > 0),
                    key=lambda share: -share[1])
    cards: list[list[tuple[str, float]]] = [[] for _ in range(gpus or 0)]
    left: list[tuple[str, float]] = []
    for name, share in shares:
        card = next((c for c in cards if sum(s for _, s in c) + share <= 1.0 + 1e-9), None)
        if card is None and gpus is None:
            cards.append(card := [])
        if card is None:
            left.append((name, share))
        else:
            card.append((name, share))
    return cards, left


def cluster_cards(nodes: list[dict[str, Any]]) -> int:
    """Whole GPU cards of the live ``nodes`` (``ray.nodes()``)."""
    return sum(int(float(n.get("Resources", {}).get("GPU", 0.0)))
               for n in nodes if n.get("Alive"))


def packing_problem(models: list[AppArgs], cards: int, when: str = INITIAL) -> str | None:
    """Why the GPU shares of all ``models``' replicas ``when`` (:func:`replica_count`: by
    default the initial ones, which a deployment starts with) cannot be placed at once on
    ``cards`` GPUs (of any nodes: a share is of one card, so cards of one node pool with
    every other's), or ``None`` (they can, no model needs a GPU, or one waits for GPU nodes:
    ``deployment.wait_for_gpus``)."""
    if any(m.deployment.wait_for_gpus for m in models):
        return None
    _, left = gpu_packing(models, cards, when)
    if not left:
        return None
    needed = len(gpu_packing(models, when=when)[0])
    other = when != INITIAL and any(replica_count(m, when) != replica_count(m)
                                    for m in models)
    starts = "" if not other else (
        " The app starts (its initial replicas fit) but the autoscaler cannot add replicas "
        "past what fits." if not packing_problem(models, cards) else
        " Not even its initial replicas fit.")
    return (f"{f'{when} (deployment.{COUNT_KEYS[when]}) ' if other else ''}the models' "
            f"replicas need {needed} GPUs (their num_gpus shares packed onto whole cards: "
            f"vramgate plan shows how), but the cluster has {cards}; left over: "
            f"{', '.join(f'{name} ({share:g})' for name, share in left)}.{starts} Add GPUs, "
            f"lower deployment.num_gpus or {COUNT_KEYS[when if other else INITIAL]}, or set "
            "deployment.wait_for_gpus: true to wait for GPU nodes to join")
