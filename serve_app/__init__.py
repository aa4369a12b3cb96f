"""vramgate: memory-budget admission for model serving on Ray Serve."""
