"""Four half-GPU replicas over a head and two one-GPU worker nodes (``ray.cluster_utils``):
spread, served across nodes, a killed node costs only 503/504s, and full strength returns with
capacity. The scenario owns its Ray cluster, so it runs in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_four_half_gpu_replicas_survive_losing_a_node() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-m", "tests.e2e.multinode_scenario"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print("\n" + json.dumps(result, indent=1))
    workers = set(result["workers"])
    # Spread: two replicas on each worker (each has one GPU = two halves), none on the head.
    assert sorted(result["replica_nodes"]) == sorted(list(workers) * 2)
    assert set(result["nodes_that_served"]) == workers
    # The node killed hosts model replicas, never the ingress (see _worker_to_kill).
    assert "ServeReplica:vramgate:ModelServer" in result["killed_hosted"]
    assert not any("Ingress" in name for name in result["killed_hosted"])
    for phase in ("steady", "kill", "after_kill", "after_restore"):
        assert set(result[phase]) <= {"200", "503", "504"}, (
            phase, result[phase], result["killed_hosted"], result["kill_errors"][:3])
        assert result[phase].get("200", 0) > 0, (phase, result[phase])
    assert set(result["survivor_nodes"]) == workers - {result["killed"]}
    assert result["restored_nodes"] == 2
    # Durable jobs submitted just before the kill: none lost, none failed.
    assert result["jobs"]["statuses"] == {"succeeded": 40}, result["jobs"]
