"""Device memory: probes, cost models, budget derivation."""
