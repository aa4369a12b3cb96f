"""Cluster adapters: the request router, the autoscaling policy, the replica registry, the
idempotency store, the job broker, fail-fast placement checks and Ray compatibility."""
